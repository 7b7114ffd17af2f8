"""The results page of a recipe run (docs/recipes.md): per stage its steps, `seq_len`, first and last loss,
learning rate, the realised data shares and the wall-clock time, read from the run's TensorBoard events; for a DPO
stage (docs/post-training.md) also TRL's reward metrics at each step and on the held-out pairs; for a GRPO stage
TRL's rollout metrics at each step.

    python -m jaxlong.train --config configs/recipes/tiny_extension.yaml run_dir=/tmp/recipe
    python experiments/recipe_report.py /tmp/recipe/tiny_extension --config configs/recipes/tiny_extension.yaml \
        --seconds 120 --out experiments/results/recipe_tiny_extension.md
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(run: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's event files, `{tag: {step: value}}` (later files win)."""
    out: dict[str, dict[int, float]] = {}
    for f in sorted(run.glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f)).Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    return out


SHARES = """Shares: each source's share of the non-padding tokens fed since the stage started (`data/share/NAME`, the
last step of the stage). They hold the weights to within about one piece of a document (at most `seq_len` tokens)
per packing stream, so a short stage of a few rows per stream sits a few points off them. """


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the recipe's run directory (run_dir/run_name)")
    ap.add_argument("--config", required=True, help="the recipe file")
    ap.add_argument("--seconds", type=float, required=True, help="the command's wall-clock time")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", default="", help="a paragraph put after the gates' table")
    args = ap.parse_args()
    s = scalars(args.run)
    stages = sorted({int(v) for v in s["stage"].values()})
    shares = sorted(t for t in s if t.startswith("data/share/"))
    head = "| stage | steps | seq_len | loss (first → last) | peak lr |" + "".join(
        f" share {t.rsplit('/', 1)[1]} |" for t in shares)
    rows = [head, "|" + "---|" * (5 + len(shares))]
    for k in stages:
        steps = sorted(st for st, v in s["stage"].items() if int(v) == k)
        loss = [s["loss"][st] for st in steps]
        rows.append(f"| {k} | {steps[0]}-{steps[-1]} | {int(s['seq_len'][steps[0]]):,} | {loss[0]:.3f} → "
                    f"{loss[-1]:.3f} | {max(s['lr'][st] for st in steps):.2g} |"
                    + "".join(f" {s[t][steps[-1]]:.3f} |" for t in shares))
    gates = ["| stage | step | metrics | missed | results |", "|---|---:|---|---|---|"]
    for path in sorted((args.run / "gates").glob("stage*.json")):  # each stage's gate (jaxlong.training.gates)
        g = json.loads(path.read_text())
        metrics = ", ".join(f"{k} {v:.3f}" for k, v in g["metrics"].items())
        results = Path(g["results"]).relative_to(args.run.resolve()) if Path(g["results"]).is_absolute() \
            else g["results"]
        gates.append(f"| {g['stage']} ({g['name']}) | {g['step']} | {metrics} | {'; '.join(g.get('missed', [])) or 'none'}"
                     f" | `{results}` |")
    dpo = []
    if "rewards/accuracies" in s:  # DPO stages: TRL's metrics per step, then the held-out pairs'
        tags = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
        dpo = ["| step | " + " | ".join(tags) + " |", "|---:|" + "---:|" * len(tags)]
        dpo += [f"| {st} | " + " | ".join(f"{s[t][st]:.4f}" for t in tags) + " |"
                for st in sorted(s["rewards/accuracies"])]
        for st in sorted(s.get("eval/dpo/loss", {})):
            dpo.append(f"| {st} (held-out) | " + " | ".join(f"{s['eval/dpo/' + t][st]:.4f}" for t in tags) + " |")
        dpo = ["", "DPO (TRL's metrics, docs/post-training.md): each step's own batch, then the held-out pairs at the "
               "stage's end.", "", *dpo]
    if "reward" in s:  # GRPO stages: TRL's metrics per step (a rollout's repeat on its later steps)
        tags = [t for t in ("loss", "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy",
                            "clip_ratio/region_mean", "completions/mean_length", "timing/rollout_s",
                            "timing/train_s") if t in s]
        tags += sorted(t for t in s if t.startswith("rewards/") and t.endswith("/mean"))
        dpo += ["", "GRPO (TRL's metrics, docs/post-training.md#grpo-on-rollouts): each step's rollout, its "
                "completions scored by the rewards.", "", "| step | " + " | ".join(tags) + " |",
                "|---:|" + "---:|" * len(tags)]
        dpo += [f"| {st} | " + " | ".join(f"{s[t].get(st, float('nan')):.4f}" for t in tags) + " |"
                for st in sorted(s["reward"])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    text = f"""# Recipe: `{args.config}`

Machine: {platform.processor() or platform.machine()}, {platform.system()}, Python {platform.python_version()},
CPU only (8 simulated devices); commit {commit}. Wall-clock time of the whole recipe: {args.seconds:.0f} s.

```bash
python -m jaxlong.train --config {args.config} run_dir=/tmp/recipe
python experiments/recipe_report.py /tmp/recipe/{args.run.name} --config {args.config} \\
    --seconds {args.seconds:.0f} --out {args.out}
```

{chr(10).join(rows)}
{chr(10).join(dpo)}

{SHARES if shares else ""}Each stage warms up from a learning rate of 0 at its first step (`optim.schedule_start`).

Gates (docs/recipes.md#gates): the metrics each stage's gate measured on its last checkpoint (held-out loss in
nats/token; RULER exact match in [0, 1]), recorded in the run's `gates/stage<i>.json`, and the thresholds it
missed.

{chr(10).join(gates)}

{args.note}
"""
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
