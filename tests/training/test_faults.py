"""Fault injection: the trainer killed by SIGTERM, SIGINT or SIGKILL at many points of `run`, then resumed,
equals an uninterrupted run bit for bit from its last committed checkpoint; every committed checkpoint holds
exactly the uninterrupted run's state at its label; SIGTERM/SIGINT lose no finished step; after the resume no
temporary checkpoint directory is left. The fast tier kills at two points, the slow tier at the rest of `KILLS`.

The kill is sent by the trainer's testing hook (`JAXLONG_FAULT="<point>@<step>:<SIGNAL>"`, see
`jaxlong/training/loop.py`). SIGTERM and SIGINT are delivered to this process (the trainer's handlers are installed
while `run` runs); SIGKILL kills a child process, which shares the test run's persistent compilation cache
(tests/conftest.py). The resumes run here, with the train step compiled once per config.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY, tiered, tiny_cfg
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxlong.config import to_dict
from jaxlong.core.mesh import build_mesh
from jaxlong.training import step as step_lib
from jaxlong.training.checkpoint import TMP_MARK, Checkpointer, committed_steps
from jaxlong.training.loop import FAULT_ENV, FAULT_POINTS, Preempted, run

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 6, 2
TRAIN = ("model.vocab_size=257", "mesh.fsdp=2", "mesh.context=4", "optim.warmup_steps=1", "optim.lr=1e-2",
         f"steps={STEPS}", "keep_checkpoints=10", "data.max_tokens=20000",
         "eval_every=0")  # validation is tested on its own (tests/evaluation); no kill point is inside it

# (hook spec without the signal, steps finished when the signal arrives). A signal before the step's dispatch
# leaves it unfinished; from the step's return on, it is finished and must be saved. The last entry sends
# SIGTERM after step 3, then the signal under test during the save that the stop starts.
KILL_POINTS = [
    ("after_compile@1", 0),
    ("after_state@1", 0),
    ("before_dispatch@1", 0),
    ("after_step@1", 1),
    ("before_batch@3", 2),
    ("before_put@3", 2),
    ("before_dispatch@3", 2),
    ("after_step@3", 3),
    ("after_bind@3", 3),
    ("before_metrics@3", 3),
    ("during_metrics@3", 3),
    ("during_log@3", 3),
    ("before_save@3", 3),
    ("after_step@4", 4),
    ("before_save@4", 4),
    ("during_save@4", 4),
    ("end_of_step@4", 4),
    ("during_metrics@5", 5),
    ("after_step@6", 6),
    ("during_save@6", 6),
    ("after_loop@6", 6),
    ("after_commit@6", 6),
    ("after_step@3:SIGTERM,during_final_save@3", 3),
]
SIGNALS = ("SIGTERM", "SIGINT", "SIGKILL")

CHILD = """
import sys
import jax
jax.config.update("jax_default_matmul_precision", "highest")
from helpers import TINY, tiny_cfg
from jaxlong.training.loop import run
run(tiny_cfg(*sys.argv[1:]))
"""


# Which signal at which point. SIGTERM is sent at every point: the trainer's handler runs in this process and what
# it must save depends on where the signal lands. SIGINT goes through the very same handler (`_Signals._handle`
# in jaxlong/training/loop.py, for both signals), so it is sent where the handler's state differs: before the
# train state exists, during an asynchronous save, and during the final save a first signal started. SIGKILL
# kills a child process that runs no handler, so what a point tests is which checkpoints were committed when it
# died: one point per such state is killed (nothing committed yet; step 2's save committed or in flight; step 4's
# save in flight, and after it; the last save in flight, and committed; a final save in flight). The points
# between those states (after step 3, before the saves of steps 3 and 4, after step 6 and after the loop) leave
# what a neighbour leaves on disk, and SIGTERM is sent at each of them.
SIGINT_POINTS = ("after_compile@1", "during_save@4", "after_step@3:SIGTERM,during_final_save@3")
SIGKILL_POINTS = ("after_step@1", "before_batch@3", "during_save@4", "end_of_step@4", "during_save@6",
                  "after_commit@6", "after_step@3:SIGTERM,during_final_save@3")
KILLS = [(p, f, sig) for sig in SIGNALS for p, f in KILL_POINTS
         if sig == "SIGTERM" or p in (SIGINT_POINTS if sig == "SIGINT" else SIGKILL_POINTS)]


def test_kill_points_cover_the_hook():
    named = {p.split(":")[-1].split(",")[-1].split("@")[0] for p, _ in KILL_POINTS}
    assert named == set(FAULT_POINTS)
    points = {p for p, _ in KILL_POINTS}
    assert set(SIGINT_POINTS) <= points and set(SIGKILL_POINTS) <= points
    assert {p for p, _, sig in KILLS if sig == "SIGTERM"} == points  # every point, by the in-process handler


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [*TRAIN, f"run_dir={tmp_path}", "run_name=run", f"checkpoint_every={EVERY}", *extra]


def _compile_key(cfg, *also: str) -> str:
    d = to_dict(cfg)
    for k in ("run_dir", "run_name", "checkpoint_every", "keep_checkpoints", *also):
        d.pop(k)
    return json.dumps(d, sort_keys=True)


@pytest.fixture(scope="module")
def compile_once():
    """The train step compiled, and the initial state computed, once per config in this process; each run gets
    its own copy of the initial state (the trainer donates it). The trainer's logic is unchanged."""
    steps, inits = {}, {}
    real_compile, real_init = step_lib.compile_train_step, step_lib.init_state

    def compile_train_step(cfg, mesh):
        key = _compile_key(cfg, "seed")  # the seed changes the initial state and the data, not the step
        if key not in steps:
            steps[key] = real_compile(cfg, mesh)
        return steps[key]

    def init_state(cfg, mesh):
        key = _compile_key(cfg)
        if key not in inits:
            state = real_init(cfg, mesh)
            inits[key] = (jax.tree.map(np.asarray, state), jax.tree.map(lambda x: x.sharding, state))
        host, shardings = inits[key]
        return jax.tree.map(jax.device_put, host, shardings)

    mp = pytest.MonkeyPatch()
    mp.setattr(step_lib, "compile_train_step", compile_train_step)
    mp.setattr(step_lib, "init_state", init_state)
    yield
    mp.undo()


def _restore(cfg, ckpt_dir: Path, step: int) -> dict:
    ckpt = Checkpointer(ckpt_dir, every=1, keep=100)
    try:
        label, state = ckpt.restore(step_lib.abstract_state(cfg, build_mesh(cfg.mesh)), step)
    finally:
        ckpt.manager.close()
    assert label == step == int(state["step"])
    return jax.tree.map(np.asarray, state)


def _losses(event_files) -> dict[int, float]:
    out = {}
    for f in sorted(event_files):
        out.update({e.step: e.value for e in EventAccumulator(str(f)).Reload().Scalars("loss")})
    return out


def _event_files(run_dir: Path) -> set[Path]:
    return set(run_dir.glob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, compile_once):
    """The uninterrupted run: its loss at every step and its state at every step (a checkpoint each step)."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = tiny_cfg(*_overrides(tmp, "checkpoint_every=1"))
    run(cfg)
    ckpt_dir = tmp / "run" / "checkpoints"
    assert committed_steps(ckpt_dir) == list(range(1, STEPS + 1))
    states = {s: _restore(cfg, ckpt_dir, s) for s in range(1, STEPS + 1)}
    losses = _losses(_event_files(tmp / "run"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return {"states": states, "losses": losses}


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        assert np.array_equal(x, y), f"{what}: {jax.tree_util.keystr(path)} differs"


def _kill(spec: str, overrides: list[str], monkeypatch) -> None:
    signals = [getattr(signal, entry.rsplit(":", 1)[1]) for entry in spec.split(",")]
    if signal.SIGKILL in signals:  # in a child process
        env = {**os.environ, FAULT_ENV: spec, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
        proc = subprocess.run([sys.executable, "-c", CHILD, *overrides], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        return
    monkeypatch.setenv(FAULT_ENV, spec)
    with pytest.raises(Preempted) as stop:
        run(tiny_cfg(*overrides))
    monkeypatch.delenv(FAULT_ENV)
    assert stop.value.signum == signals[0]  # the first signal names the stop


# The fast tier kills at one point with each kind of delivery: SIGTERM in this process during an asynchronous
# save, SIGKILL in a child process after a committed save (one compile, from the persistent cache); the slow
# tier runs the rest of `KILLS`.
FAST_KILLS = [("during_save@4", 4, "SIGTERM"), ("before_batch@3", 2, "SIGKILL")]


@pytest.mark.parametrize(*tiered(
    "point,finished,sig", KILLS, fast={f"{p.replace(':SIGTERM,', '+')}-{s}" for p, _, s in FAST_KILLS},
    ids=[f"{p.replace(':SIGTERM,', '+')}-{s}" for p, _, s in KILLS]))
def test_killed_run_resumes_bit_for_bit(point, finished, sig, reference, tmp_path, monkeypatch):
    overrides = _overrides(tmp_path)
    cfg = tiny_cfg(*overrides)
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _kill(f"{point}:{sig}", overrides, monkeypatch)

    committed = committed_steps(ckpt_dir)
    if sig == "SIGKILL":  # may lose the steps since the last committed save, never a committed one
        assert max(committed, default=0) <= finished
    else:  # loses nothing: the last finished step is committed, and nothing is half-written
        assert max(committed, default=0) == finished
        assert not [p.name for p in ckpt_dir.glob(f"*{TMP_MARK}*")]
    for s in committed:  # never corrupt, never mislabelled
        _assert_same_state(_restore(cfg, ckpt_dir, s), reference["states"][s], f"checkpoint {s}")

    last = max(committed, default=0)
    before = _event_files(run_dir)
    out = run(cfg, resume=bool(committed))
    resumed_losses = _losses(_event_files(run_dir) - before)
    assert resumed_losses == {s: reference["losses"][s] for s in range(last + 1, STEPS + 1)}
    if last < STEPS:
        assert out["metrics"]["loss"] == pytest.approx(reference["losses"][STEPS], rel=1e-6)
    assert committed_steps(ckpt_dir)[-1] == STEPS
    assert not [p.name for p in ckpt_dir.glob(f"*{TMP_MARK}*")]
    _assert_same_state(_restore(cfg, ckpt_dir, STEPS), reference["states"][STEPS], "final state")


# ----------------------------------------------------------------------------------------------
# Resume checks what it resumes; a failed save says so and leaves nothing behind.


@pytest.fixture
def two_steps(tmp_path, compile_once):
    """A run of STEPS with a checkpoint at step 2 (stopped there by SIGTERM)."""
    return _stopped_after_two_steps(tmp_path)


def _stopped_after_two_steps(tmp_path: Path, *extra: str) -> list[str]:
    """The overrides of a run of STEPS (and `extra`) stopped by SIGTERM after step 2, its only checkpoint."""
    overrides = _overrides(tmp_path, *extra)
    os.environ[FAULT_ENV] = "end_of_step@2:SIGTERM"
    try:
        with pytest.raises(Preempted):
            run(tiny_cfg(*overrides))
    finally:
        del os.environ[FAULT_ENV]
    assert committed_steps(tmp_path / "run" / "checkpoints") == [2]
    return overrides


@pytest.mark.parametrize(*tiered(
    "change, listed",
    [
        (["seed=1"], "seed: 0 -> 1"),
        (["seq_len=128"], "seq_len: 64 -> 128"),
        (["model.rope_theta=10000"], "model.rope_theta: 500000.0 -> 10000.0"),
        (["optim.lr=0.02", "data.max_tokens=30000"], "data.max_tokens: 20000 -> 30000; optim.lr: 0.01 -> 0.02"),
    ],
    fast={2, 3}))
def test_resume_refuses_changes_of_model_data_or_schedule(two_steps, change, listed, capsys):
    from jaxlong.train.__main__ import main

    assert main(["--resume", *TINY, *two_steps, *change]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --resume: this config differs from checkpoint 2's")
    assert f"{listed}; set them back, or pass --resume-with-changes" in err


def _advice(err: str) -> list[str]:
    """The overrides a resume refusal says to add (`add K=V ... to keep the checkpoint's schedule`), as a shell
    would split them."""
    match = re.search(r"; add (.+?) to keep the checkpoint's schedule and train on", err)
    assert match, err
    return shlex.split(match.group(1))


def test_resume_with_more_steps_says_how_to_keep_the_schedule(two_steps, capsys):
    """A longer `steps=` stretches a schedule whose length follows `steps`: the refusal names the value that keeps
    it, and the command with it then trains on."""
    from jaxlong.train.__main__ import main

    assert main(["--resume", *TINY, *two_steps, "steps=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --resume: steps=8 would change checkpoint 2's learning")
    assert err.endswith("or pass --resume-with-changes to change it")
    assert _advice(err) == [f"optim.decay_steps={STEPS}"]
    assert main(["--resume", *TINY, *two_steps, "steps=8", *_advice(err)]) == 0
    assert committed_steps(Path(tiny_cfg(*two_steps).run_dir) / "run" / "checkpoints")[-1] == 8


@pytest.mark.slow
def test_resume_of_a_run_shorter_than_its_warmup_trains_on_as_advised(tmp_path, compile_once, capsys):
    """A run of fewer steps than its warmup (its schedule: warmup 8, cosine to step 9) stopped at step 2: a longer
    `steps=` is refused with advice that keeps that schedule, and the command with the advice trains on."""
    from jaxlong.train.__main__ import main

    overrides = _stopped_after_two_steps(tmp_path, "optim.warmup_steps=8")
    assert main(["--resume", *TINY, *overrides, "steps=12"]) == 2
    err = capsys.readouterr().err.strip()
    assert _advice(err) == ["optim.decay_steps=9"]  # not steps=6, which is shorter than the warmup
    assert main(["--resume", *TINY, *overrides, "steps=12", *_advice(err)]) == 0
    assert committed_steps(tmp_path / "run" / "checkpoints")[-1] == 12


def test_resume_with_changes_overrides_the_check(two_steps, capsys):
    out = run(tiny_cfg(*two_steps, "seed=1"), resume=True, allow_changes=True)
    assert "--resume-with-changes: resuming checkpoint 2 with seed: 0 -> 1\n" in capsys.readouterr().out
    assert np.isfinite(out["metrics"]["loss"]) and committed_steps(Path(out["run_dir"]) / "checkpoints")[-1] == STEPS


@pytest.mark.parametrize("flag", ["--resume", "--resume-with-changes"])
def test_a_checkpoint_that_does_not_fit_the_model_is_one_line_naming_the_key(two_steps, flag, capsys):
    """A changed model shape is refused from the checkpoint's metadata, before anything compiles or orbax
    reads an array, in one line naming the key; it comes before any other change (here the schedule that
    `steps=8` stretches), and the line suggests no flag, as none resumes into other shapes."""
    from jaxlong.train.__main__ import main

    assert main([flag, *TINY, *two_steps, "steps=8", "model.hidden=128"]) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert "\n" not in err and err.startswith("error: --resume: checkpoint 2 holds parameters of other "
                                              "shapes (params['embed']: saved [257, 64] float32, this config [257, 128]")
    assert "model.hidden: 64 -> 128; a checkpoint restores only into the model it was saved with" in err
    assert "--resume-with-changes" not in err and "schedule" not in err
    assert "resuming" not in out


SHAPE_CHANGES = {"resume": ["-m", "jaxlong.train", "--resume-with-changes"], "eval": ["-m", "jaxlong.eval"]}


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_refused_changed_shape_prints_no_traceback_in_four_tries(two_steps, tmp_path):
    """`python -m jaxlong.train --resume-with-changes model.hidden=128` (3 tries) and `python -m jaxlong.eval
    RUN model.hidden=128` (1 try) each end with one line on stderr and exit code 2: no orbax or asyncio
    traceback at exit (a race at the interpreter's exit: several tries)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run_dir = tmp_path / "run"
    for name, tries in (("resume", 3), ("eval", 1)):
        args = [*TINY, *two_steps] if name == "resume" else [str(run_dir)]
        for _ in range(tries):
            proc = subprocess.run([sys.executable, *SHAPE_CHANGES[name], *args, "model.hidden=128"], env=env,
                                  cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 2, proc.stderr[-3000:]
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "model.hidden: 64 -> 128" in lines[0], proc.stderr[-3000:]


@pytest.mark.slow
def test_resume_on_another_mesh_continues_the_run(two_steps, reference):
    """Mesh axes may change on resume: the state is resharded on restore; the losses equal up to float
    reassociation."""
    cfg = tiny_cfg(*two_steps, "mesh.fsdp=1", "mesh.context=8")
    run_dir = Path(cfg.run_dir) / "run"
    before = _event_files(run_dir)
    run(cfg, resume=True)
    losses = _losses(_event_files(run_dir) - before)
    assert losses == pytest.approx({s: reference["losses"][s] for s in range(3, STEPS + 1)}, rel=1e-4)


def _failing_save(monkeypatch, fail_at: int):
    """orbax's save creates its temporary directory, then the storage fails (e.g. disk full) at `fail_at`."""
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == fail_at:
            (Path(self.directory) / f"{step}.orbax-checkpoint-tmp-123").mkdir()
            raise OSError(28, "No space left on device")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)


def test_a_failed_save_stops_the_run_and_leaves_no_partial_checkpoint(tmp_path, compile_once, monkeypatch):
    from jaxlong.training.checkpoint import CheckpointError

    _failing_save(monkeypatch, fail_at=4)
    with pytest.raises(CheckpointError, match="could not save step 4: OSError: .*No space left on device.*; "
                                              "latest committed checkpoint: step 2"):
        run(tiny_cfg(*_overrides(tmp_path)))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert committed_steps(ckpt_dir) == [2] and not list(ckpt_dir.glob(f"*{TMP_MARK}*"))


def test_a_failed_save_on_stop_is_reported_not_claimed(tmp_path, compile_once, monkeypatch, capsys):
    _failing_save(monkeypatch, fail_at=3)
    monkeypatch.setenv(FAULT_ENV, "after_step@3:SIGTERM")
    with pytest.raises(Preempted):
        run(tiny_cfg(*_overrides(tmp_path)))
    out = capsys.readouterr().out
    assert "could not save step 3: OSError" in out and "steps 3..3 are lost" in out
    assert "latest committed checkpoint: step 2;" in out
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert committed_steps(ckpt_dir) == [2] and not list(ckpt_dir.glob(f"*{TMP_MARK}*"))
