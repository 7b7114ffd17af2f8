"""The memory ladder and max context per rung, for one config, written as Markdown + CSV + PNG.

    python experiments/memory_ladder.py --target h100 --config configs/llama3_1_8b.yaml --seq 3145728 \
        --out experiments/results
    python experiments/memory_ladder.py --config configs/llama3_1_8b.yaml --seq 3145728 --budget 80GiB  # CPU

Each rung adds one technique to the one before (the Untied Ulysses paper's Figure 1 order, see
`jaxlong.plan.LADDER`). Bytes are per device, from the compiled train step (`jaxlong.plan.plan`): with
`--target`, XLA's GPU compiler for compile-only devices of that GPU (no GPU needed; the budget defaults to the
GPU's memory, and each rung's total adds the attention workspace, collective buffers and headroom rows);
without it, the CPU approximation (float32 compile, activations scaled to the compute dtype). Max context is a
search over compiled sizes at 64K-token granularity, against the device budget and `--host-budget` per node.
`--heads-per-stage 32,16` adds rows for the U-Pipe rung at those heads per stage (tables and CSV, not the plot).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if any(a == "--target" or a.startswith("--target=") for a in sys.argv[1:]):
    # jax reads JAX_PLATFORMS when it is imported: the CUDA plugin compiles for compile-only GPUs, no driver
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import load_config, validate  # noqa: E402
from jaxlong.core.distributed import set_host_device_count  # noqa: E402
from jaxlong.plan.planner import HOST_BUDGET  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq", type=int, required=True, help="sequence length of the ladder (tokens)")
    ap.add_argument("--target", default=None, help="GPU target (h100, h200, a100, [:N][xM]); default: CPU plan")
    ap.add_argument("--budget", default=None, help="per-device budget (default: the target's memory, else 80GiB)")
    ap.add_argument("--host-budget", default=HOST_BUDGET, help=f"host memory per node for offloaded bytes (default {HOST_BUDGET})")
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--no-max-context", action="store_true")
    ap.add_argument("--heads-per-stage", default="", help="comma-separated U for extra U-Pipe rows, e.g. 32,16")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"seq_len={args.seq}", *args.overrides])
    target = None
    if args.target:
        from jaxlong.plan.target import parse_target  # noqa: PLC0415

        target = parse_target(args.target)
        cfg.mesh.num_devices = target.devices
        validate(cfg)
    set_host_device_count(cfg.mesh.num_devices)
    from jaxlong.core.units import GiB, parse_bytes  # noqa: PLC0415
    from jaxlong.plan.planner import (  # noqa: PLC0415
        apply_rung,
        format_context,
        format_table,
        ladder,
        max_context,
        plan,
        plot_ladder,
    )

    budget = parse_bytes(args.budget) if args.budget else (target.device_memory if target else 80 * GiB)
    host_budget = parse_bytes(args.host_budget, option="--host-budget")
    rows = []
    t0 = time.time()
    rungs = ladder(cfg)
    n_ladder = len(rungs)
    for u in filter(None, args.heads_per_stage.split(",")):
        upipe = next(c for name, _, c in rungs if name == "+U-Pipe")  # not the rungs after it (grouped offload)
        c = apply_rung(upipe, [f"attention.heads_per_stage={int(u)}"], cfg.mesh.num_devices)
        rungs.append((f"+U-Pipe U={u}", f"the U-Pipe rung with {u} heads per stage", c))
    for name, what, c in rungs:
        row = {"name": name, "what": what, **plan(c, target)}
        if not args.no_max_context:
            row["max_context"], _ = max_context(c, budget, target=target, host_budget=host_budget,
                                                start=262144 if target else 65536)
        rows.append(row)
        print(f"{name:18s} total {row['total'] / GiB:9.1f} GiB  max context {row.get('max_context', '-')}  "
              f"({time.time() - t0:.0f} s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = args.target.replace(":", "-") if args.target else "cpu"
    stem = os.path.join(args.out, f"ladder_{cfg.model.name}_{args.seq}_{tag}")
    with open(stem + ".csv", "w", newline="") as f:
        keys = ["name", "what", "params", "gradients", "optimizer", "activations", "host", "peak", "workspace",
                "collectives", "headroom", "total", "host_per_node", "max_context", "source"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    source = rows[-1]["source"]  # the full mesh (the first rung runs on one device)
    plot_ladder(rows[:n_ladder], budget, stem + ".png", f"{cfg.model.name}, {args.seq:,} tokens, {source}")
    rev = commit()
    with open(stem + ".md", "w") as f:
        f.write(f"# Memory ladder: {cfg.model.name}, {args.seq:,} tokens, {source}\n\n")
        f.write(f"Command: `python {' '.join(sys.argv)}` (commit {rev}, {time.time() - t0:.0f} s)\n\n")
        f.write(f"Machine: {machine()}; nothing allocated (compile only). Budget {budget / GiB:.1f} GiB per "
                f"device, host {host_budget / GiB:.0f} GiB per node.\n\n")
        f.write("GiB per device; `total` = compiled peak + attention workspace + collective buffers + headroom "
                "(GPU plans); host = what is offloaded to pinned host memory (layer inputs; with U-Pipe, one layer's "
                "output buffer).\n\n")
        f.write(format_table(rows, budget, host_budget) + "\n\n")
        if not args.no_max_context:
            f.write("| rung | max context (tokens) |\n|---|---:|\n")
            f.write("\n".join(f"| {r['name']} | {format_context(r['max_context'], 262144 if target else 65536)} |"
                              for r in rows) + "\n")
        f.write(f"\n![ladder]({os.path.basename(stem)}.png)\n")
    print(f"wrote {stem}.md/.csv/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
