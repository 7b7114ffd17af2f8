"""Estimated speed on two nodes: Ulysses x ring and U-Pipe x ring at 8M and 15M tokens, NVLink and network apart.

    python experiments/two_node_estimate.py --target h100:8x2 --config configs/llama3_1_8b.yaml \
        --out experiments/results

Each row is one GPU compile of the train step for compile-only devices (no GPU used) with `--estimate`'s roofline
(`jaxlong.plan.cost.roofline`): ring 2 across the nodes x Ulysses 8 inside each, offload with grouped checkpointing
(the ladder's k, so the host holds ceil(L/k) + k layer inputs), tiled loss and MLP. Ring attention's blocks run on
cuDNN; its collective-permutes are the only collectives that cross nodes, at the target's network bandwidth per
GPU, overlapped with the blocks' attention kernels (only their excess is exposed); the all-to-alls stay on NVLink.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles for compile-only GPUs; no driver

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import apply_setting, load_config, parse_override  # noqa: E402
from jaxlong.layers.remat import default_offload_every  # noqa: E402
from jaxlong.plan import planner  # noqa: E402
from jaxlong.plan.cost import significant  # noqa: E402
from jaxlong.plan.target import parse_target  # noqa: E402

METHODS = {
    "Ulysses x ring": ["attention.impl=ulysses"],
    "U-Pipe x ring": ["attention.impl=upipe", "attention.heads_per_stage=0"],
}
# The U-Pipe paper (arXiv 2602.21196) on 16 x H100 (8-way Ulysses x 2-way ring): max context of Llama3-8B.
PAPER = {"Ulysses x ring": "6M (USP-hybrid)", "U-Pipe x ring": "8M"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100:8x2")
    ap.add_argument("--config", default="configs/llama3_1_8b.yaml")
    ap.add_argument("--lengths", default="8388608,15728640")
    ap.add_argument("--out", default="experiments/results")
    args = ap.parse_args(argv)
    target = parse_target(args.target)
    if target.nodes < 2:
        print(f"error: --target {args.target} has one node; give NAME:DEVICESxNODES, e.g. h100:8x2", file=sys.stderr)
        return 2
    base = load_config(args.config, [])
    k = default_offload_every(base.model.layers)
    common = [f"mesh.num_devices={target.devices}", "mesh.data=1", "mesh.fsdp=1", f"mesh.ring={target.nodes}",
              f"mesh.context={target.devices_per_node}", "global_batch=1", "remat.policy=offload",
              f"remat.offload_every={k}", "tiling.loss=true", "tiling.mlp=true", "data.packing=concat"]
    rows = []
    for seq in (int(s) for s in args.lengths.split(",")):
        for method, ov in METHODS.items():
            cfg = copy.deepcopy(base)
            for text in [*common, *ov, f"seq_len={seq}"]:
                apply_setting(cfg, *parse_override(text))
            t0 = time.time()
            p = planner.plan(cfg, target, estimate=True)
            e = p["estimate"]
            rows.append({"method": method, "seq_len": seq, "total_gib": p["total"] / 2**30,
                         "fits": planner.fits(p, target.device_memory, planner.budgets(None, planner.HOST_BUDGET, None,
                                                                                         target, target.devices)[1]),
                         "host_per_node_gib": p["host_per_node"] / 2**30,
                         "nvlink_gb": e["link_wire_bytes"] / 1e9, "network_gb": e["network_wire_bytes"] / 1e9,
                         "ring_s": e["ring_seconds"], "ring_exposed_s": e["ring_exposed_seconds"],
                         "all_to_all_s": e["exposed_seconds"] - e["ring_exposed_seconds"],
                         "step_s": e["step_seconds"], "tokens_per_s_per_gpu": e["tokens_per_s_per_gpu"],
                         "mfu": e["mfu"], "recompute": e["recompute_factor"], "assumptions": e["assumptions"],
                         "compile_s": time.time() - t0})
            r = rows[-1]
            print(f"{method} at {seq:,}: total {r['total_gib']:.1f} GiB, est. {r['tokens_per_s_per_gpu']:,.0f} "
                  f"tokens/s per GPU ({r['compile_s']:.0f} s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"two_node_estimate_{base.model.name}_{args.target.replace(':', '-')}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in rows[0] if c != "assumptions"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    lines = [f"# Two nodes: {base.model.name} on {target.describe()}", "", "```bash",
             "python experiments/two_node_estimate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
             "```", "", f"Machine: {machine()}; commit {commit()}.", "", __doc__.split("\n\n", 2)[2].strip(), "",
             "| method | seq_len | fits | total (GiB / device) | host (GiB / node) | wire NVLink / network (GB per "
             "GPU per step) | ring sends (s) | of which exposed (s) | est. step (s) | est. tokens/s per GPU | est. MFU "
             "| recompute | paper, 16 x H100 (max context) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['seq_len']:,} | {'yes' if r['fits'] else 'no'} | {r['total_gib']:.1f} | "
                     f"{r['host_per_node_gib']:,.0f} | {significant(r['nvlink_gb'])} / {significant(r['network_gb'])} | "
                     f"{significant(r['ring_s'])} | {significant(r['ring_exposed_s'])} | {significant(r['step_s'])} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['recompute']:.2f} | {PAPER[r['method']]} |")
    lines += ["", "Assumptions of the estimate:", *[f"- {a}" for a in rows[0]["assumptions"].splitlines()]]
    open(stem + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
