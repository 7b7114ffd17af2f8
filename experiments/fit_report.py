"""The Markdown report of `python -m jaxlong.memory --fit` searches, rendered from their JSON files.

    for s in 131072 1048576 6815744 6881280 8388608 10485760; do
      python -m jaxlong.memory --fit --target h100 --config configs/llama3_1_8b.yaml seq_len=$s \\
          --max-compiles 40 --out experiments/results/fit_llama3.1-8b_${s}_h100.json
    done
    python experiments/fit_report.py experiments/results/fit_llama3.1-8b_*_h100.json \\
        --out experiments/results/fit_llama3.1-8b_h100.md

One section per search (sorted by length): every compiled candidate with its compiled peak, device total, host
memory per node, estimated tokens/s per GPU and recompute factor; why the others were not compiled; the
winner's command line. Estimates, not measurements: `--fit` compiles for compile-only GPUs and ranks by the
roofline of the compiled program (`jaxlong/plan/cost.py`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.provenance import commit, machine  # noqa: E402

GIB = 2**30
# Overrides every candidate shares (the mesh split is the only valid one with global_batch=1): left out of the rows.
COMMON = {"mesh.num_devices=8", "mesh.data=1", "mesh.fsdp=1", "mesh.ring=1", "mesh.context=8",
          "tiling.loss_tile=0"}


def describe(overrides: str) -> str:
    """A candidate's overrides in words: `U-Pipe U=8, offload every 4 layers, tiled loss, tiled MLP (1024 tiles)`."""
    o = dict(item.split("=", 1) for item in overrides.split() if item not in COMMON)
    parts = ["U-Pipe U=" + o["attention.heads_per_stage"] if o.get("attention.impl") == "upipe" else "Ulysses"]
    remat = o.get("remat.policy", "?")
    every = int(o.get("remat.offload_every", "1"))
    parts.append(f"`remat.policy={remat}`" + (f", `offload_every={every}`" if every > 1 else ""))
    if o.get("tiling.loss") == "true":
        parts.append("tiled loss")
    if o.get("tiling.mlp") == "true":
        tiles = int(o.get("tiling.mlp_tiles", "0"))  # 0: the default count (ALST's)
        parts.append("tiled MLP" + (f" ({tiles} tiles)" if tiles else ""))
    keep = int(o.get("remat.keep_attention", "0"))
    if keep:
        parts.append(f"attention kept in {keep} layers")
    return ", ".join(parts)


def gib(n: int | None, spec: str) -> str:
    return "none" if n is None else f"{n / GIB:{spec}} GiB"


def reason(text: str) -> str:
    """Why `--fit` settled a candidate without compiling it, without the candidate numbers."""
    if text.startswith("invalid"):
        return "invalid mesh splits (global_batch=1 is not divisible by mesh.fsdp)"
    if text.startswith("dominated"):
        return "dominated by a compiled candidate that fits and is lighter in every dimension"
    if text.startswith("needs at least the device memory"):
        return "need at least the device memory of a compiled candidate that does not fit"
    return text


def section(d: dict) -> list[str]:
    s = d["seq_len"]
    lines = [f"## {s:,} tokens (`seq_len={s}`)", "",
             f"{d['compiles']} compiles of {d['candidates']} valid candidates "
             f"({sum(c.get('compile_seconds', 0) for c in d['compiled']):.0f} s of compiling); host budget "
             f"{gib(d.get('host_budget'), ',.0f')} per node, device budget {gib(d.get('budget'), '.1f')}.", "",
             "| # | candidate (all `mesh.fsdp=1 mesh.context=8`) | peak (compiled) | device total | host / node "
             "| est. tokens/s/GPU | recompute | fits |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    win = d.get("winner") or {}
    for c in d["compiled"]:
        is_win = c["overrides"] == win.get("overrides")
        faster = win and not is_win and c["tokens_per_s_per_gpu"] > win["tokens_per_s_per_gpu"]
        fits = ("yes, **winner**" if is_win else "yes") if c["fits"] else "no"
        lines.append(f"| {c['index']} | {describe(c['overrides'])} | {c['peak'] / GIB:.1f} | {c['total'] / GIB:.1f} "
                     f"| {c['host_per_node'] / GIB:,.0f} | {c['tokens_per_s_per_gpu']:,.1f}{' (faster)' if faster else ''} "
                     f"| {c['recompute_factor']:.3f} | {fits} |")
    reasons = collections.Counter(reason(p["reason"]) for p in d["pruned"])
    lines += ["", "Not compiled: " + "; ".join(f"{n} {r}" for r, n in reasons.most_common()) + ".", ""]
    if win:
        faster_fit = [c for c in d["compiled"] if c["fits"] and c["tokens_per_s_per_gpu"] > win["tokens_per_s_per_gpu"]]
        lines.append(f"Winner: {describe(win['overrides'])}: {win['total'] / GIB:.1f} GiB per device, "
                     f"{win['host_per_node'] / GIB:,.0f} GiB of host per node, {win['tokens_per_s_per_gpu']:,.1f} "
                     f"estimated tokens/s per GPU. Compiled candidates estimated faster that fit: "
                     f"{len(faster_fit)}. Its command line, as printed:")
        lines += ["", "```bash", d["command"], "```", ""]
    else:
        close = d.get("closest") or {}
        lines += [f"Nothing fits (exit code 1). Closest: {describe(close.get('overrides', ''))}, "
                  f"{close.get('total', 0) / GIB:.1f} GiB per device.", ""]
    return lines


def wrap(lines: list[str], width: int = 120) -> list[str]:
    """Prose lines wrapped at `width`; table rows, headings and code blocks kept as they are."""
    out, code = [], False
    for line in lines:
        if line.startswith("```"):
            code = not code
        if code or line.startswith(("|", "#", "```")) or len(line) <= width:
            out.append(line)
        else:
            out += textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="`--fit --out` JSON files")
    ap.add_argument("--out", required=True, help="the Markdown file to write")
    ap.add_argument("--config", default="configs/llama3_1_8b.yaml", help="the searches' config (for the commands)")
    ap.add_argument("--target", default="h100", help="the searches' --target (for the commands)")
    ap.add_argument("--max-compiles", type=int, default=40, help="the searches' --max-compiles (for the commands)")
    ap.add_argument("--stem", default="experiments/results/fit_llama3.1-8b",
                    help="the JSON files' path before `_<seq_len>_<target>.json` (for the commands)")
    args = ap.parse_args(argv)
    runs = sorted((json.load(open(f)) for f in args.files), key=lambda d: d["seq_len"])
    first = runs[0]
    out = [f"# `--fit`: {first['model']} on {first['target']}, ranked by the compiled program's step-time estimate",
           "",
           "**Estimates, not measurements.** Every number comes from XLA's GPU compile of the real train step for "
           "compile-only GPUs (no GPU present), its memory as `python -m jaxlong.memory` reports it (compiled peak + "
           "cuDNN workspace + NCCL buffers + 2% headroom = device total) and its step time as the roofline estimate "
           "of the compiled HLO (`jaxlong/plan/cost.py`). Host memory is per node; the default host budget is "
           "1.5 TiB per node (`--host-budget`, [memory-planning.md](../../docs/memory-planning.md)). The recompute "
           "factor is the compiled step's FLOPs over the model FLOPs.",
           "",
           f"Machine: {machine()}; commit {commit()}. Commands:",
           "",
           "```bash",
           "for s in " + " ".join(str(d["seq_len"]) for d in runs) + "; do",
           f"  python -m jaxlong.memory --fit --target {args.target} --config {args.config} seq_len=$s \\",
           f"      --max-compiles {args.max_compiles} --out {args.stem}_${{s}}_{args.target}.json",
           "done",
           f"python experiments/fit_report.py {args.stem}_*_{args.target}.json \\",
           f"    --max-compiles {args.max_compiles} --stem {args.stem} --out {args.out}",
           "```",
           "",
           "| seq_len | compiles | winner | device total | host / node | est. tokens/s/GPU | recompute |",
           "|---:|---:|---|---:|---:|---:|---:|"]
    for d in runs:
        w = d.get("winner")
        if w:
            out.append(f"| {d['seq_len']:,} | {d['compiles']} | {describe(w['overrides'])} | {w['total'] / GIB:.1f} "
                       f"| {w['host_per_node'] / GIB:,.0f} | {w['tokens_per_s_per_gpu']:,.1f} "
                       f"| {w['recompute_factor']:.3f} |")
        else:
            out.append(f"| {d['seq_len']:,} | {d['compiles']} | nothing fits | – | – | – | – |")
    out.append("")
    for d in runs:
        out += section(d)
    with open(args.out, "w") as f:
        f.write("\n".join(wrap(out)).rstrip() + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
