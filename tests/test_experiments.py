"""The experiments that train on batches of their own run through the trainer (`run(cfg, batches=fn, hooks=...)`),
in miniature: a few steps of the documented commands."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from xla_flags import for_children

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> str:
    # each experiment sets its own device count; the compile-speed flags change no result (tests/xla_flags.py)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": for_children(os.environ.get("XLA_FLAGS", ""))}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = (out.stdout + out.stderr).replace("\r", "\n")
    assert out.returncode == 0, text[-3000:]
    return text


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_the_passkey_curriculum_is_one_trainer_run_per_phase_ended_by_its_hook(tmp_path):
    """Two phases (128 then 256 tokens): the hook scores every 3 steps and ends phase 1 at step 6 (target 0 reached
    twice); phase 2 resumes checkpoint 6 at its own length and runs its 8 steps; the page has every evaluation."""
    out = _run(["experiments/passkey.py", "--phases", "128:8:100,256:4:100", "--max-steps", "8", "--warmup", "4",
                "--eval-every", "3", "--eval-per-depth", "2", "--final-per-depth", "2", "--depths", "0,1",
                "--final-depths", "0,0.5,1", "--corpus-every", "3", "--target", "0", "--patience", "2",
                "--work", str(tmp_path / "run"), "--out", str(tmp_path / "out" / "passkey")])
    assert "stopped after step 6 by a hook (every depth >= 0.0 2 times)" in out
    assert "--resume-with-changes: resuming checkpoint 6 with global_batch: 8 -> 4; seq_len: 128 -> 256" in out
    assert "done: step 14" in out and "final (14 steps" in out
    assert _steps(tmp_path / "run" / "run" / "checkpoints") == [6, 14]
    page = (tmp_path / "out" / "passkey.md").read_text()
    assert [line.split("|")[1].strip() for line in page.splitlines()
            if line.startswith("| ") and line.split("|")[2].strip() in ("128", "256")] == ["3", "6", "9", "12"]


@pytest.mark.slow
def test_the_ruler_demo_trains_with_the_trainer_and_its_hooks(tmp_path):
    """`--copy-weight` trains on generated RULER cases through the trainer: its hooks log the loss every 10 steps
    and score RULER every 6; the trainer's checkpoints (6, 12) carry the config `python -m jaxlong.eval` reads."""
    work = tmp_path / "work"
    out = _run(["experiments/ruler_demo.py", "--bpe", "4096", "--tie-embeddings", "--copy-weight", "30", "--mix",
                "niah_single_1", "--seq-len", "128", "--batch", "8", "--steps", "12", "--lr", "3e-3", "--eval-every",
                "6", "--checkpoint-every", "6", "--corpus-every", "4", "--bootstrap", "3", "--lengths", "128",
                "--eval-cases", "4", "--work", str(work), "--out", str(tmp_path / "out" / "ruler_demo")])
    log = (work / "train.log").read_text().splitlines()
    assert [line.split(":")[0] for line in log] == ["step 6", "step 10", "step 12"], log
    assert "ruler niah_single_1@128 " in log[0] and "loss " in log[1] and "ruler niah_single_1@128 " in log[2]
    assert "done: step 12" in out
    assert _steps(work / "run" / "checkpoints") == [6, 12]
    assert (tmp_path / "out" / "ruler_demo.md").read_text().count("| niah_single_1 | ") == 1
