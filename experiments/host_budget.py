"""Max context of one model under host-memory budgets per node, with offload and with grouped offload.

    python experiments/host_budget.py --target h100 --config configs/llama3_1_8b.yaml --out experiments/results

For each stack (the ALST stack: Ulysses, offload, tiled loss and MLP; U-Pipe: the same with U-Pipe, U = C) and
each remat (`offload`: every layer input on the host, with U-Pipe also one layer's output buffer; `grouped`:
`remat.offload_every=k`, the ladder's k), the device-limited max context is searched over GPU-compiled plans
(`jaxlong.plan.planner.max_context` against the target's memory, host unlimited). The host memory of a plan is
exactly linear in the sequence length (the offloaded layer inputs, `[S/C, hidden]` each, and U-Pipe's
`[S/C, H, d]` output buffer), so the host-limited max context under a budget B per node is
`B / (host bytes per token per node)`, rounded down to the search's granularity; the max context under B is the
smaller of the two. Every length in the table is then compiled once more with `--estimate`'s roofline: total
memory per device, host per node and the estimated tokens/s per GPU there. Compiles are cached in `--cache`
(JSON), so an interrupted run resumes. Estimates, not measurements: no GPU is used.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles for compile-only GPUs; no driver

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import apply_setting, load_config, parse_override  # noqa: E402
from jaxlong.core.units import TiB, fmt_gib, parse_bytes  # noqa: E402
from jaxlong.layers.remat import default_offload_every  # noqa: E402
from jaxlong.plan import planner  # noqa: E402
from jaxlong.plan.target import parse_target  # noqa: E402

STACKS = {
    "ALST": ["mesh.fsdp=1", "global_batch=1", "remat.policy=offload", "tiling.loss=true",
             "tiling.mlp=true", "attention.impl=ulysses", "data.packing=concat"],
    "U-Pipe": ["mesh.fsdp=1", "global_batch=1", "remat.policy=offload", "tiling.loss=true",
               "tiling.mlp=true", "attention.impl=upipe", "attention.heads_per_stage=0", "data.packing=concat"],
}
GRANULARITY = 65536


def configure(cfg, overrides: list[str]):
    out = copy.deepcopy(cfg)
    for text in overrides:
        apply_setting(out, *parse_override(text))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--config", default="configs/llama3_1_8b.yaml")
    ap.add_argument("--budgets", default="1TiB,1.5TiB,2TiB", help="host budgets per node")
    ap.add_argument("--start", type=int, default=4194304, help="first length of the device-limited searches")
    ap.add_argument("--check", type=int, default=10485760, help="also plan U-Pipe with grouped offload here")
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--cache", default=None, help="JSON cache of compiled plans (default runs/host_budget_*_cache.json)")
    args = ap.parse_args(argv)
    target = parse_target(args.target)
    base = load_config(args.config, [f"mesh.num_devices={target.devices}"])
    k = default_offload_every(base.model.layers)
    remats = {"offload": ["remat.offload_every=1"], f"grouped (k={k})": [f"remat.offload_every={k}"]}
    budgets = [parse_bytes(b, option="--budgets") for b in args.budgets.split(",")]
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"host_budget_{base.model.name}_{args.target.replace(':', '-')}")
    cache_path = args.cache or os.path.join("runs", os.path.basename(stem) + "_cache.json")
    os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}

    def plan_at(name: str, overrides: list[str], seq: int, estimate: bool = True) -> dict:
        key = f"{name}|{seq}|{estimate}"
        if key not in cache:
            t0 = time.time()
            cfg = configure(base, [*overrides, f"seq_len={seq}"])
            p = planner.plan(cfg, target, estimate=estimate)
            keep = ("total", "peak", "activations", "host", "host_per_node")
            cache[key] = {**{f: p[f] for f in keep}, "seconds": time.time() - t0,
                          "estimate": {f: p["estimate"][f] for f in ("tokens_per_s_per_gpu", "recompute_factor",
                                                                       "mfu", "step_seconds")} if estimate else None}
            json.dump(cache, open(cache_path, "w"), indent=1)
            print(f"  {name} at {seq:,}: total {fmt_gib(p['total'])} GiB, host {fmt_gib(p['host_per_node'])} "
                  f"GiB/node ({cache[key]['seconds']:.0f} s)", flush=True)
        return cache[key]

    rows = []
    for stack, stack_ov in STACKS.items():
        for remat, remat_ov in remats.items():  # Ulysses (and U-Pipe) over every device of the target
            name, ov = f"{stack}, {remat}", [*stack_ov, f"mesh.context={target.devices}", *remat_ov]
            key = f"{name}|device_max"
            if key not in cache:
                cfg = configure(base, ov)
                s, _ = planner.max_context(cfg, target.device_memory, target=target, start=args.start)
                cache[key] = s
                json.dump(cache, open(cache_path, "w"), indent=1)
            device_max = cache[key]
            at_max = plan_at(name, ov, device_max)
            per_token = at_max["host_per_node"] / device_max  # bytes of host per token per node (linear in S)
            print(f"{name}: device-limited {device_max:,} tokens, host {per_token / 1024:.1f} KiB per token per node",
                  flush=True)
            for budget in budgets:
                host_max = int(budget // per_token) // GRANULARITY * GRANULARITY if per_token else device_max
                seq = min(device_max, host_max)
                p = plan_at(name, ov, seq)
                rows.append({"stack": stack, "remat": remat, "host_budget_tib": budget / TiB, "max_context": seq,
                             "limit": "host" if host_max < device_max else "device", "device_max": device_max,
                             "total_gib": p["total"] / 2**30, "host_per_node_gib": p["host_per_node"] / 2**30,
                             "tokens_per_s_per_gpu": p["estimate"]["tokens_per_s_per_gpu"],
                             "recompute_factor": p["estimate"]["recompute_factor"], "mfu": p["estimate"]["mfu"]})
    check = plan_at(f"U-Pipe, grouped (k={k})", [*STACKS["U-Pipe"], f"mesh.context={target.devices}",
                                                  f"remat.offload_every={k}"], args.check)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    budget_gib = target.device_memory / 2**30
    lines = [f"# Max context under host budgets: {base.model.name} on {target.describe()}", "",
             "```bash", "python experiments/host_budget.py " + " ".join(argv if argv is not None else sys.argv[1:]),
             "```", "", f"Machine: {machine()}; commit {commit()}.", "",
             f"GPU compile for compile-only {target.device_name} devices (no GPU used); device budget "
             f"{budget_gib:.1f} GiB per device (compiled peak + cuDNN workspace + NCCL buffers + 2% headroom); "
             "tokens/s per GPU is `--estimate`'s roofline, an estimate. Host memory is per node of "
             f"{target.devices_per_node} GPUs. `limit`: what stops the context there.", "",
             "| stack | remat | host budget / node | max context (tokens) | limit | total (GiB / device) | "
             "host (GiB / node) | est. tokens/s per GPU | recompute |", "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['stack']} | {r['remat']} | {r['host_budget_tib']:g} TiB | {r['max_context']:,} | "
                     f"{r['limit']} | {r['total_gib']:.1f} | {r['host_per_node_gib']:,.0f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['recompute_factor']:.2f} |")
    lines += ["", f"U-Pipe with grouped offload (k={k}) at {args.check:,} tokens: total "
              f"{check['total'] / 2**30:.1f} GiB per device (budget {budget_gib:.1f}), host "
              f"{check['host_per_node'] / 2**30:,.0f} GiB per node, est. "
              f"{check['estimate']['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU."]
    open(stem + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
