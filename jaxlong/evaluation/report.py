"""What an evaluation of a checkpoint writes (`jaxlong.evaluation.checkpoint`): under `RUN_DIR/eval/<setup>/step_N/`
`summary.json`, `loss_by_position.{csv,png}`, `passkey.{csv,png}` and RULER's files (`ruler.csv`, `ruler.png`,
`ruler_cases.csv`, `ruler_prompts.jsonl`); TensorBoard events in `RUN_DIR/eval/<setup>/` (`eval/loss`,
`eval/perplexity`, `eval/passkey_accuracy`, `eval/loss_by_position/<start>`, the objective's `eval/<key>/...`,
`eval/ruler_<scoring>/<task>/<length>`; the same evaluation run again replaces its own); and the printed summary."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tensorboardX import SummaryWriter

from jaxlong.evaluation import ruler

__all__ = ["write", "format_summary", "write_results"]


def write(run_dir: Path, step: int, summary: dict, objective, ruler_cases: list, case_rows: list | None,
          tokenizer) -> Path:
    """Write an evaluation's results and events (module docstring), print its summary; returns the results
    directory."""
    setup_dir = run_dir / "eval" / summary["setup"]["name"]
    out = setup_dir / f"step_{step}"
    write_results(out, summary)
    for old in setup_dir.glob(f"events.out.tfevents.*.step_{step}"):  # this evaluation's earlier run: replaced
        old.unlink()
    writer = SummaryWriter(str(setup_dir), filename_suffix=f".step_{step}")
    if summary["loss"] is not None:
        writer.add_scalar("eval/loss", summary["loss"], step)
        writer.add_scalar("eval/perplexity", summary["perplexity"], step)
    for row in summary["loss_by_position"]:
        if row["tokens"]:  # else no target counted at these positions (chat data: the prompt's)
            writer.add_scalar(f"eval/loss_by_position/{row['start']:08d}", row["loss"], step)
    if "passkey" in summary:
        writer.add_scalar("eval/passkey_accuracy", summary["passkey"]["mean"], step)
    key = objective.summary_key
    for k, v in summary.get(key, {}).items() if key else ():
        if k != objective.unit:
            writer.add_scalar(f"eval/{key}/{k}", v, step)
    if "ruler" in summary:
        rl = summary["ruler"]
        ruler.log_scalars(writer, rl["rows"], step, ruler.tag_prefix(rl["scoring"]))
        ruler.write_results(out, rl["rows"], f"RULER ({rl['scoring']}), step {step}", cases=case_rows,
                            prompts=ruler.report.prompt_rows(ruler_cases, tokenizer.decode))
    writer.close()
    print(format_summary(summary, objective))
    print(f"results in {out}/ and TensorBoard (tensorboard --logdir {run_dir})")
    return out


def format_summary(summary: dict, objective=None) -> str:
    """The summary as the command prints it: validation loss (none with `--batches 0`), loss by position, the
    objective's held-out metrics (`Objective.report`), the passkey grid and RULER's table."""
    if summary["loss"] is None:
        lines = [f"step {summary['step']}: no validation loss (--batches 0)"]
    else:
        lines = [f"step {summary['step']}: validation loss {summary['loss']:.4f} nats/token, perplexity "
                 f"{summary['perplexity']:.3f} ({summary['tokens']:.0f} tokens)", "", "loss by position:",
                 f"{'positions':>18}  {'tokens':>9}  {'loss':>7}"]
    for r in summary["loss_by_position"]:
        lines.append(f"{r['start']:>8}-{r['end'] - 1:<9}  {r['tokens']:>9}  {r['loss']:7.4f}")
    key = getattr(objective, "summary_key", None)
    if key in summary:
        lines += ["", objective.report(summary[key])]
    if "passkey" in summary:
        pk = summary["passkey"]
        lines += ["", f"passkey retrieval ({pk['digits']} digits, {pk['per_cell']} per cell; rows: depth, columns: "
                      f"length), mean {pk['mean']:.3f}:",
                  f"{'depth':>6}  " + "  ".join(f"{n:>7}" for n in pk["lengths"])]
        for d, row in zip(pk["depths"], pk["accuracy"]):
            lines.append(f"{d:>6.2f}  " + "  ".join(f"{a:>7.2f}" for a in row))
        if pk["mean"] < 0.05:
            lines.append(f"passkey retrieval is at chance level (guessing all {pk['digits']} digits: "
                         f"{10.0 ** -pk['digits']:.0e}): the model has not learned to copy a fact from far back in "
                         f"its context, as small models trained briefly on text do not; a pretrained model "
                         f"(model.from_hf) or training on retrieval data (experiments/passkey.py) would")
    if "ruler" in summary:
        rl = summary["ruler"]
        how = ("by greedy generation, RULER's string_match_all" + (" (chat)" if rl.get("chat") else "")
               if rl["scoring"] == "generate" else "teacher-forced exact match")
        lines += ["", f"RULER {how}, % ({rl['cases']} cases per task and length), mean "
                      f"{100 * rl['mean']:.1f}:", ruler.format_table(rl["rows"])]
    return "\n".join(lines)


def write_results(out: Path, summary: dict) -> None:
    """`summary.json`, `loss_by_position.csv/.png` and (with passkey results) `passkey.csv/.png` under `out`."""
    import matplotlib  # noqa: PLC0415 (loaded when results are drawn, not when the trainer starts)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    rows = summary["loss_by_position"]
    with open(out / "loss_by_position.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["start", "end", "tokens", "loss"])
        w.writeheader()
        w.writerows(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([max(r["start"], 0.5) for r in rows], [r["loss"] for r in rows], "o-")
    ax.set(xscale="log", xlabel="token position (bucket start)", ylabel="mean loss (nats/token)",
           title=f"loss by position, step {summary['step']}")
    fig.tight_layout()
    fig.savefig(out / "loss_by_position.png", dpi=110)
    plt.close(fig)
    if "passkey" not in summary:
        return
    pk = summary["passkey"]
    with open(out / "passkey.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["depth", *pk["lengths"]])
        for d, row in zip(pk["depths"], pk["accuracy"]):
            w.writerow([d, *row])
    fig, ax = plt.subplots(figsize=(1.2 * len(pk["lengths"]) + 2, 0.5 * len(pk["depths"]) + 2))
    im = ax.imshow(pk["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(pk["lengths"])), [str(n) for n in pk["lengths"]])
    ax.set_yticks(range(len(pk["depths"])), [f"{d:.2f}" for d in pk["depths"]])
    for i, row in enumerate(pk["accuracy"]):
        for j, a in enumerate(row):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
    ax.set(xlabel="context length (tokens)", ylabel="needle depth", title=f"passkey retrieval, step {summary['step']}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "passkey.png", dpi=110)
    plt.close(fig)
