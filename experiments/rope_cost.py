"""Compiled cost of the RoPE tables: FLOPs and peak memory of Llama-3.1-8B's train step at 1M tokens on 8 x H100
(GPU compile, no GPU), to the byte and the FLOP, for two setups (`--fit`'s 1M winner, and U-Pipe).

    JAX_PLATFORMS=cpu python experiments/rope_cost.py

Prints one Markdown row per setup: flops (per device per step, `jaxlong.plan.cost`), compiled peak (bytes and
GiB), activations. Run it on two commits to compare them (experiments/results/rope_cost_llama3.1-8b_h100.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxlong.config import load_config  # noqa: E402
from jaxlong.plan.planner import plan  # noqa: E402
from jaxlong.plan.target import parse_target  # noqa: E402

SETUPS = {"Ulysses, remat full, tiled loss": ["tiling.loss=true"],
          "U-Pipe, remat full, tiled loss": ["attention.impl=upipe", "tiling.loss=true"]}

if __name__ == "__main__":
    target = parse_target("h100")
    print("| setup | step FLOPs | compiled peak (bytes) | compiled peak (GiB) | activations (GiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, overrides in SETUPS.items():
        cfg = load_config("configs/llama3_1_8b.yaml", ["seq_len=1048576", f"mesh.num_devices={target.devices}",
                                                         *overrides])
        p = plan(cfg, target, estimate=True)
        print(f"| {name} | {p['estimate']['flops']:,.0f} | {p['peak']:,} | {p['peak'] / 2**30:.3f} | "
              f"{p['activations'] / 2**30:.3f} |", flush=True)
