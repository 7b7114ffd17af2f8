"""RULER results: a CSV (task, length, cases, correct, score), the task x length heatmap (PNG, the familiar RULER
grid), a text table and TensorBoard scalars; per case, what the model answered (a CSV) and the prompt it was
asked (JSON lines). `rows` are `jaxlong.evaluation.ruler.score.results` rows."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

COLUMNS = ("task", "length", "cases", "correct", "score")
CASE_COLUMNS = ("task", "length", "index", "depth", "correct", "answer", "predicted")
PROMPT_FIELDS = ("task", "length", "index", "depth", "prompt")


def grid(rows: list[dict]) -> tuple[list[str], list[int], np.ndarray]:
    """`(tasks, lengths, scores)`: scores float `[tasks, lengths]` (nan where a pair was not run)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    out = np.full((len(tasks), len(lengths)), np.nan)
    for r in rows:
        out[tasks.index(r["task"]), lengths.index(r["length"])] = r["score"]
    return tasks, lengths, out


def length_label(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def format_table(rows: list[dict]) -> str:
    """Scores in percent, a task per line and a length per column, with the mean over tasks last."""
    tasks, lengths, g = grid(rows)
    width = max([len(t) for t in tasks] + [4])
    lines = [f"{'RULER':<{width}}  " + "  ".join(f"{length_label(n):>6}" for n in lengths)]
    for t, row in zip(tasks, g):
        lines.append(f"{t:<{width}}  " + "  ".join("     -" if np.isnan(x) else f"{100 * x:6.1f}" for x in row))
    lines.append(f"{'mean':<{width}}  " + "  ".join(f"{100 * x:6.1f}" for x in np.nanmean(g, axis=0)))
    return "\n".join(lines)


def write_csv(path: str | Path, rows: list[dict], columns: Sequence[str] = COLUMNS) -> None:
    """`rows` as a CSV of `columns` (a row's other keys left out)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def case_rows(cases, answers, right, decode) -> list[dict]:
    """One row per case (`CASE_COLUMNS`): task, length, index, `depth` (the first answer-bearing needle's depth in
    [0, 1], empty for cwe and fwe), `correct` (`right`, `jaxlong.evaluation.ruler.is_right`: 0 or 1), the `answer`
    text and the `predicted` text: the teacher-forced argmax at the answer's positions (`answers`,
    `predict_answers`) decoded with `decode` (the run's `tokenizer.decode`)."""
    return [{"task": c.task, "length": c.length, "index": c.index, "depth": f"{c.depths[0]:.3f}" if c.depths else "",
             "correct": int(r), "answer": c.answer_text, "predicted": decode(a)}
            for c, a, r in zip(cases, answers, right, strict=True)]


def prompt_rows(cases: Sequence, decode: Callable) -> Iterator[dict]:
    """One object per case (`PROMPT_FIELDS`), made as they are read (a long prompt's text is made once, when it is
    written): `task`, `length`, `index` and `depth` as the case's `ruler_cases.csv` row has them (the depth a number
    in [0, 1] rounded to 3 places, None for cwe and fwe), and `prompt`, the text of the tokens the model read before
    its answer, decoded with `decode` (the run's `tokenizer.decode`, which leaves special tokens out): by generation
    (`GenerationCase`) the whole prompt, RULER's template, context and answer prefix; teacher-forced (`RulerCase`)
    the input up to the answer's first token."""
    for c in cases:
        if hasattr(c, "prompt"):  # a GenerationCase
            ids, depth = c.prompt, c.depth
        else:  # a RulerCase: the targets are tokens[1:], the answer's first at target position answer[0]
            ids, depth = c.tokens[:int(c.answer[0]) + 1], (c.depths[0] if c.depths else None)
        yield {"task": c.task, "length": c.length, "index": c.index,
               "depth": None if depth is None else round(float(depth), 3), "prompt": decode(ids)}


# Characters that JSON leaves as they are and some readers take for line ends (Python's str.splitlines among them):
# written escaped, so that each object stays on its line for every reader.
LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def write_prompts(path: str | Path, prompts: Iterable[dict]) -> None:
    """`prompt_rows` as JSON lines (UTF-8, one object a line, in the cases' order): what the model was asked.
    Text stays readable (not ASCII-escaped) but for the characters some readers split lines at (`LINE_BREAKS`)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False).translate(LINE_BREAKS) + "\n")


def write_heatmap(path: str | Path, rows: list[dict], title: str = "RULER") -> None:
    """Score by task (rows) and length (columns), 0 red to 1 green, each cell annotated."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tasks, lengths, g = grid(rows)
    fig, ax = plt.subplots(figsize=(1.0 * len(lengths) + 3, 0.45 * len(tasks) + 1.8))
    im = ax.imshow(g, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(tasks)), tasks)
    for i, row in enumerate(g):
        for j, x in enumerate(row):
            ax.text(j, i, "-" if np.isnan(x) else f"{100 * x:.0f}", ha="center", va="center", fontsize=8)
    ax.set(xlabel="context length (tokens)", title=title)
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tag_prefix(scoring: str) -> str:
    """The TensorBoard tag prefix of RULER scores of a scoring mode: `eval/ruler_generate`, `eval/ruler_forced`
    (the two kinds of score never share a tag)."""
    return f"eval/ruler_{scoring}"


def log_scalars(writer, rows: list[dict], step: int, prefix: str = "eval/ruler_generate") -> None:
    """`prefix/<task>/<length>` for each row, `prefix/<task>` (mean over lengths) and `prefix/mean` (over all
    rows), through any writer with `add_scalar(tag, value, step)` (tensorboardX's `SummaryWriter`)."""
    tasks, lengths, g = grid(rows)
    for r in rows:
        writer.add_scalar(f"{prefix}/{r['task']}/{r['length']:08d}", float(r["score"]), step)
    for t, row in zip(tasks, g):
        writer.add_scalar(f"{prefix}/{t}", float(np.nanmean(row)), step)
    writer.add_scalar(f"{prefix}/mean", float(np.mean([r["score"] for r in rows])), step)


def write_results(out: str | Path, rows: list[dict], title: str = "RULER", cases: list[dict] | None = None,
                  prompts: Iterable[dict] | None = None) -> list[Path]:
    """`out/ruler.csv` and `out/ruler.png`, with `cases` (`case_rows`, `generation_case_rows`) `out/ruler_cases.csv`
    and with `prompts` (`prompt_rows` of the same cases) `out/ruler_prompts.jsonl`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "ruler.csv", rows)
    write_heatmap(out / "ruler.png", rows, title)
    paths = [out / "ruler.csv", out / "ruler.png"]
    if cases is not None:
        write_csv(out / "ruler_cases.csv", cases, list(cases[0]) if cases else CASE_COLUMNS)  # what the model answered
        paths.append(out / "ruler_cases.csv")
    if prompts is not None:
        write_prompts(out / "ruler_prompts.jsonl", prompts)
        paths.append(out / "ruler_prompts.jsonl")
    return paths
