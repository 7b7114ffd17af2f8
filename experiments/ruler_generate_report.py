"""What the RULER-by-generation experiments share: reading a run's `python -m jaxlong.eval --ruler` evaluations back
from their files, and printing and plotting the scores (`experiments/smollm2_ruler_generate.py`,
`experiments/gemma3_ruler_generate.py`).

A score row is a dict: `scoring` (`generate`, `forced`, or `transformers` for transformers' text scored by jaxlong's
`string_match_all`), `task`, `length` (tokens), `rope` (`default`, or `yarn x<factor>` for an evaluation with YaRN
overrides), `cases`, `score` (in [0, 1], the mean over the cases), `setup` (the evaluation setup's name). A case row
is one generated case of `ruler_cases.csv`, with transformers' text and score beside it where a `transformers` file
was given.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

SCORINGS = ("generate", "forced", "transformers")


def rope_scaling(argv: list[str]) -> dict:
    """The `model.rope_scaling.*` overrides of an evaluation's arguments, as {key: value text}."""
    prefix = "model.rope_scaling."
    return dict(a[len(prefix):].split("=", 1) for a in argv if a.startswith(prefix))


YARN_KEYS = {"type", "factor", "original_max_position_embeddings"}  # the overrides `transformers` passes on


def yarn_factor(argv: list[str]) -> str | None:
    """The YaRN factor of an evaluation's arguments (as written), or None without YaRN."""
    rs = rope_scaling(argv)
    return rs["factor"] if rs.get("type") == "yarn" else None


def hf_key(key: str, factor: str | None) -> str:
    """A case's key in the `transformers` output: `task/length/index`, `+yarn x<factor>` after it with YaRN."""
    return key + (f"+yarn x{factor}" if factor else "")


def collect(run_dir: Path, hf: Path | None) -> tuple[list[dict], list[dict]]:
    """(score rows: scoring, task, length, rope, cases, score, setup; generated case rows with transformers')."""
    from jaxlong.evaluation.ruler import string_match_all

    rows, cases = [], []
    hf_cases = json.loads(hf.read_text())["cases"] if hf else {}
    for path in sorted(run_dir.glob("eval/*/step_1/summary.json")):
        s = json.loads(path.read_text())
        if "ruler" not in s:
            continue
        factor = yarn_factor(s["setup"]["overrides"])
        rope = f"yarn x{factor}" if factor else "default"
        scoring = s["ruler"]["scoring"]
        for r in s["ruler"]["rows"]:
            rows.append({"scoring": scoring, "task": r["task"], "length": r["length"], "rope": rope,
                         "cases": r["cases"], "score": r["score"], "setup": s["setup"]["name"]})
        if scoring != "generate":
            continue
        with open(path.parent / "ruler_cases.csv") as f:
            for c in csv.DictReader(f):
                h = hf_cases.get(hf_key(f"{c['task']}/{c['length']}/{c['index']}", factor))
                cases.append({"task": c["task"], "length": c["length"], "rope": rope, "index": c["index"],
                              "depth": c["depth"], "answer": c["answer"], "prompt_tokens": c["prompt_tokens"],
                              "jaxlong_score": c["score"], "jaxlong_stopped": c["stopped"],
                              "jaxlong": c["generated"],
                              "transformers_score": "" if h is None else
                              f"{string_match_all(h['text'], h['refs']):.4g}",
                              "transformers": "" if h is None else h["text"],
                              "same_text": "" if h is None else int(h["text"] == c["generated"])})
    by_cell: dict = {}
    for c in cases:
        if c["transformers"] != "" or c["same_text"] != "":
            by_cell.setdefault((c["task"], int(c["length"]), c["rope"]), []).append(float(c["transformers_score"]))
    for (task, length, rope), scores in by_cell.items():
        rows.append({"scoring": "transformers", "task": task, "length": length, "rope": rope,
                     "cases": len(scores), "score": sum(scores) / len(scores), "setup": "transformers (GGUF)"})
    return rows, cases


def columns(rows: list[dict]) -> list[dict]:
    """`rows` with `length` as the table's column: (tokens, 1 with YaRN else 0), so a length scored with YaRN is a
    column of its own (`16K +YaRN`) in the same task's line."""
    return [{**r, "length": (r["length"], int(r["rope"] != "default"))} for r in rows]


def column_label(column: tuple[int, int]) -> str:
    from jaxlong.evaluation.ruler.report import length_label

    return length_label(column[0]) + (" +YaRN" if column[1] else "")


def table(rows: list[dict], scoring: str) -> str:
    """One scoring's table as the CLI prints it (a YaRN cell as a task line of its own, `task +YaRN`)."""
    from jaxlong.evaluation.ruler import format_table

    return format_table([{**r, "task": r["task"] + (" +YaRN" if r["rope"] != "default" else "")}
                         for r in rows if r["scoring"] == scoring])


def heatmap(path: Path, rows: list[dict], title: str) -> None:
    """A PNG at `path`: a grid of score by task and length (column) for each scoring present in `rows`, titled
    `title`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labelled = columns(rows)
    tasks = list(dict.fromkeys(r["task"] for r in labelled if r["scoring"] == "generate"))
    lengths = sorted({r["length"] for r in labelled})
    panels = [s for s in SCORINGS if any(r["scoring"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 2.5, 0.42 * len(tasks) + 1.8),
                             sharey=True, squeeze=False)
    titles = {"generate": "jaxlong, by generation", "forced": "jaxlong, teacher-forced",
              "transformers": "transformers, by generation"}
    for ax, scoring in zip(axes[0], panels):
        g = np.full((len(tasks), len(lengths)), np.nan)
        for r in labelled:
            if r["scoring"] == scoring and r["task"] in tasks:
                g[tasks.index(r["task"]), lengths.index(r["length"])] = r["score"]
        im = ax.imshow(g, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [column_label(n).replace(" ", "\n") for n in lengths])
        ax.set_yticks(range(len(tasks)), tasks)
        for i, row in enumerate(g):
            for j, x in enumerate(row):
                ax.text(j, i, "-" if np.isnan(x) else f"{100 * x:.0f}", ha="center", va="center", fontsize=7)
        ax.set(xlabel="context length (tokens)", title=titles[scoring])
    fig.colorbar(im, ax=axes[0].tolist(), label="score (string_match_all; forced: exact match)")
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_csv(path: Path, rows: list[dict]) -> None:
    """`rows` (dicts with the same keys, at least one) as a CSV file at `path`, a header of the first row's keys."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
