"""Throughput estimate with kept attention: Llama-3.1-8B on 8 x H100, the ALST stack (Ulysses) and U-Pipe, with
`remat.keep_attention` beside the same stacks without it and the U-Pipe paper's Table 3.

    python experiments/keep_attention_estimate.py --target h100 --config configs/llama3_1_8b.yaml \
        --out experiments/results

Each row is one GPU compile of the train step for compile-only devices (no GPU used) with `--estimate`'s roofline
(`jaxlong.plan.cost.roofline`). The stacks are those of `estimate_llama3.1-8b_h100.md` (offload, tiled loss and
MLP, 8-way Ulysses, FSDP over the node; U-Pipe with U = C); each keeps attention for every layer when the host
budget holds it, else for as many layers as `jaxlong.plan.fit.kept_layers_that_fit` leaves room for beside the
offloaded layer inputs, of plain offload or of grouped offload (`remat.offload_every` = 2 or 4: fewer layer inputs
on the host, room for more kept layers), whichever is faster and fits; the compiled host and device bytes are
checked against the budgets. The rows without kept attention are read from
`estimate_llama3.1-8b_h100.csv` (the same estimate, same target).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles for compile-only GPUs; no driver

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import apply_setting, load_config, parse_override  # noqa: E402
from jaxlong.core.units import GiB, parse_bytes  # noqa: E402
from jaxlong.plan import planner  # noqa: E402
from jaxlong.plan.fit import kept_layers_that_fit, offload_groupings  # noqa: E402
from jaxlong.plan.target import parse_target  # noqa: E402

ALST = ["remat.policy=offload", "tiling.loss=true", "tiling.mlp=true"]
STACKS = {"ulysses": ("Ulysses (ALST stack)", ["attention.impl=ulysses"]),
          "upipe": ("U-Pipe (U = C = 8)", ["attention.impl=upipe", "attention.heads_per_stage=0"])}
LENGTHS = [131072, 262144, 524288, 1048576, 2097152, 3145728, 4194304, 5242880]


def _cfg(path, seq, extra):
    cfg = load_config(path, [])
    for text in [f"seq_len={seq}", *ALST, *extra]:
        apply_setting(cfg, *parse_override(text))
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--config", default="configs/llama3_1_8b.yaml")
    ap.add_argument("--host-budget", default=planner.HOST_BUDGET)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--out", default="experiments/results")
    args = ap.parse_args(argv)
    target = parse_target(args.target)
    host_budget = parse_bytes(args.host_budget, option="--host-budget")
    before = {}
    with open(os.path.join(args.out, "estimate_llama3.1-8b_h100.csv")) as f:
        for r in csv.DictReader(f):
            before[(int(r["seq_len"]), r["impl"])] = r
    rows = []
    for seq in [int(s) for s in args.lengths.split(",")]:
        for impl, (label, extra) in STACKS.items():
            base = _cfg(args.config, seq, extra)
            base.mesh.num_devices = target.devices
            n = kept_layers_that_fit(base, host_budget, 1)
            t0 = time.perf_counter()
            p = planner.plan(_cfg(args.config, seq, [*extra, f"remat.keep_attention={n}"]), target, estimate=True)
            if p["host_per_node"] > host_budget and n > 1:  # the analytic count was generous: scale it down
                n = max(1, int(n * host_budget / p["host_per_node"]) - 1)
                p = planner.plan(_cfg(args.config, seq, [*extra, f"remat.keep_attention={n}"]), target, estimate=True)
            grouping = 1
            if n < base.model.layers:  # grouped offload: fewer layer inputs on the host, room to keep more layers
                for k in offload_groupings(base.model.layers)[1:]:
                    m = kept_layers_that_fit(base, host_budget, k)
                    q = planner.plan(_cfg(args.config, seq, [*extra, f"remat.offload_every={k}",
                                                             f"remat.keep_attention={m}"]), target, estimate=True)
                    if planner.fits(q, target.device_memory, host_budget) and \
                            q["estimate"]["step_seconds"] < p["estimate"]["step_seconds"]:
                        p, n, grouping = q, m, k
            e = p["estimate"]
            old = before.get((seq, impl), {})
            paper = old.get("paper_tokens_per_s_per_gpu", "")
            rows.append({
                "seq_len": seq, "impl": impl, "stack": label, "keep_attention": n, "offload_every": grouping,
                "total_gib": p["total"] / GiB, "fits": planner.fits(p, p["device_memory"] or target.device_memory),
                "host_per_node_gib": p["host_per_node"] / GiB, "host_fits": p["host_per_node"] <= host_budget,
                "recompute_factor": e["recompute_factor"], "head_calls": e["attention_head_calls"],
                "step_seconds": e["step_seconds"], "tokens_per_s_per_gpu": e["tokens_per_s_per_gpu"], "mfu": e["mfu"],
                "before_tokens_per_s_per_gpu": float(old["tokens_per_s_per_gpu"]) if old else None,
                "before_mfu": float(old["mfu"]) if old else None,
                "before_recompute_factor": float(old["recompute_factor"]) if old else None,
                "paper_tokens_per_s_per_gpu": float(paper) if paper not in ("", "OOM") else paper or None,
                "host_budget_gib": host_budget / GiB,
                "compile_seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"{seq:>9,} {impl:8s} keep {n:2d}: {r['tokens_per_s_per_gpu']:8.1f} tok/s/GPU, MFU {r['mfu']:.1%}, "
                  f"recompute {r['recompute_factor']:.3f}, host {r['host_per_node_gib']:.0f} GiB/node, "
                  f"{r['compile_seconds']:.0f} s", flush=True)
    rows.sort(key=lambda r: (r["seq_len"], r["impl"] != "ulysses"))
    stem = os.path.join(args.out, "keep_attention_llama3.1-8b_h100")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_markdown(stem + ".md", rows, args, host_budget)
    plot(stem + ".png", rows)
    print(f"wrote {stem}.csv/.md/.png")
    return 0


def _ratio(a, b):
    return f"{a / b:.2f}" if isinstance(b, float) and b else ""


def write_markdown(path, rows, args, host_budget) -> None:
    with open(path, "w") as f:
        f.write("# Kept attention: Llama-3.1-8B on 8×H100, estimated throughput beside today's stacks and the paper's "
                "Table 3\n\n")
        f.write("**Estimates, not measurements.** Every row is XLA's GPU compile of the real train step for 8 "
                "compile-only H100 80 GB devices (no GPU present), its HLO counted by `jaxlong/plan/cost.py` and "
                "turned into a roofline step time (the assumptions of "
                "[estimate_llama3.1-8b_h100.md](estimate_llama3.1-8b_h100.md)). \"before\" is the same stack without "
                "kept attention, from that page's CSV; \"paper\" is measured (Untied Ulysses, arXiv 2602.21196, "
                "Table 3: full checkpointing, which runs attention's forward twice per step).\n\n")
        f.write(f"Machine: {machine()}; commit {commit()}. Command:\n\n```bash\npython experiments/"
                f"keep_attention_estimate.py --target {args.target} --config {args.config} --out {args.out}\n```\n\n")
        f.write("Both stacks: `remat.policy=offload tiling.loss=true tiling.mlp=true`, 8-way Ulysses, FSDP over the "
                "node, bf16 compute, cuDNN attention, batch 1, plus `remat.keep_attention=N` (host memory): N = 32 "
                f"(every layer) where the host budget ({host_budget / GiB:,.0f} GiB per node) holds it; else the "
                "faster that fits of the count that fits beside plain offload and the count that fits beside grouped "
                "offload (`remat.offload_every=k`, k = 2 and 4: one layer input per group of k on the host, the groups "
                "recomputed without their attention; `jaxlong.plan.fit.kept_layers_that_fit`). Head-calls: cuDNN "
                "attention calls per step weighted by their heads, forward / backward, counted in the compiled HLO.\n\n")
        f.write("| seq_len | stack | kept layers (grouping k) | total GiB/device | host GiB/node | recompute (before) | head-calls "
                "fwd / bwd | est. tokens/s per GPU | before | × before | paper | × paper | est. MFU (before) |\n")
        f.write("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            hc = r["head_calls"]
            before = r["before_tokens_per_s_per_gpu"]
            paper = r["paper_tokens_per_s_per_gpu"]
            kept = f"{r['keep_attention']}" + (f" (k = {r['offload_every']})" if r["offload_every"] > 1 else "")
            paper = f"{paper:,.0f}" if isinstance(paper, float) else (paper or "")
            f.write(f"| {r['seq_len']:,} | {r['stack']} | {kept} | {r['total_gib']:.1f} | "
                    f"{r['host_per_node_gib']:,.0f}{'' if r['host_fits'] else ' (over)'} | "
                    f"{r['recompute_factor']:.3f} ({r['before_recompute_factor'] or 0:.3f}) | "
                    f"{hc['forward']:g} / {hc['backward']:g} | {r['tokens_per_s_per_gpu']:,.0f} | "
                    f"{before or 0:,.0f} | {_ratio(r['tokens_per_s_per_gpu'], before)} | "
                    f"{paper} | {_ratio(r['tokens_per_s_per_gpu'], r['paper_tokens_per_s_per_gpu'])} | "
                    f"{r['mfu']:.1%} ({(r['before_mfu'] or 0):.1%}) |\n")
        f.write("\n![estimated tokens/s per GPU](keep_attention_llama3.1-8b_h100.png)\n")


def plot(path, rows) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for impl, (label, _) in STACKS.items():
        rs = [r for r in rows if r["impl"] == impl]
        xs = [r["seq_len"] / 2**20 for r in rs]
        ax.plot(xs, [r["tokens_per_s_per_gpu"] for r in rs], "o-", label=f"{label}, kept attention")
        ax.plot(xs, [r["before_tokens_per_s_per_gpu"] for r in rs], "o--", alpha=0.6, label=f"{label}, before")
    paper = [(r["seq_len"] / 2**20, r["paper_tokens_per_s_per_gpu"]) for r in rows
             if r["impl"] == "ulysses" and isinstance(r["paper_tokens_per_s_per_gpu"], float)]
    if paper:
        ax.plot(*zip(*paper), "k^:", label="paper Table 3 (measured, ALST)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (Mi tokens)")
    ax.set_ylabel("tokens/s per GPU (estimate)")
    ax.set_title("Llama-3.1-8B, 8×H100, GPU compile + roofline estimate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
