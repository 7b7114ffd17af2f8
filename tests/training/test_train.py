"""The train loop end to end on tiny shapes: loss goes down, TensorBoard events, checkpoints, exact resume."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, tiny_cfg
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxlong.recipes import train as run

TRAIN = ("mesh.fsdp=2", "mesh.context=4", "seq_len=128", "global_batch=4", "data.max_tokens=200000",
         "optim.lr=1e-2", "optim.warmup_steps=1", "model.vocab_size=257")


def _cfg(tmp_path, *extra):
    return tiny_cfg(*TRAIN, f"run_dir={tmp_path}", *extra)


def test_training_reduces_loss_and_writes_events_and_checkpoints(tmp_path):
    """Eight steps: the loss falls, TensorBoard has its scalars, checkpoints every 4 steps; a hook every 3 steps
    (`jaxlong.training.hooks.Hook`) runs after steps 3, 6 and the last, and sees that step's logged loss and its
    parameters (those the last checkpoint holds)."""
    import jax
    import numpy as np

    from jaxlong.core.mesh import build_mesh
    from jaxlong.training import step as step_lib
    from jaxlong.training.checkpoint import Checkpointer
    from jaxlong.training.hooks import Hook

    seen = []

    def probe(ctx):
        seen.append((ctx.step, ctx.metrics["loss"], jax.tree.map(np.asarray, ctx.params)))

    cfg = _cfg(tmp_path, "steps=8", "checkpoint_every=4", "keep_checkpoints=3", "run_name=a")
    with pytest.raises(ValueError, match="every=0"):
        Hook(probe, every=0)
    out = run(cfg, hooks=[Hook(probe, every=3)])
    run_dir = tmp_path / "a"
    events = EventAccumulator(str(run_dir)).Reload()
    losses = [e.value for e in events.Scalars("loss")]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0]
    for tag in ("lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert tag in events.Tags()["scalars"]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [4, 8]  # every 4 steps, the last 2 kept
    assert out["metrics"]["loss"] == pytest.approx(losses[-1])
    assert [(step, loss) for step, loss, _ in seen] == [(3, pytest.approx(losses[2])), (6, pytest.approx(losses[5])),
                                                        (8, pytest.approx(losses[7]))]
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=10)
    try:
        _, state = ckpt.restore(step_lib.abstract_state(cfg, build_mesh(cfg.mesh)), 8)
    finally:
        ckpt.manager.close()
    for a, b in zip(jax.tree.leaves(seen[-1][2]), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(a, np.asarray(b))


def _copy_task(step, rows, seen, seq_len=128, vocab=257):
    """`run(cfg, batches=...)`'s batch of `step`: per row, random tokens and then the same tokens again, the loss
    on the copy only; a function of the step and the row (`jaxlong.training.batches`). Records `(step, rows)`."""
    import numpy as np

    seen.append((step, [int(r) for r in rows]))
    half = seq_len // 2
    first = np.stack([np.random.default_rng([step, int(r)]).integers(1, vocab, half + 1) for r in rows])
    tokens = np.concatenate([first, first[:, 1:]], axis=1)
    mask = np.zeros((len(rows), seq_len), np.float32)
    mask[:, half:] = 1.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
            "positions": np.broadcast_to(np.arange(seq_len), (len(rows), seq_len)),
            "segment_ids": np.ones((len(rows), seq_len), np.int32)}


@pytest.mark.slow
def test_batches_of_ones_own_train_checkpoint_and_resume_like_the_corpus(tmp_path):
    """`run(cfg, batches=fn)` trains on `fn(step, rows)` instead of the corpus (never read: `data.path` does not
    exist), with the trainer's checkpoints and `--resume`: stopped after step 2 and resumed, it is fed steps 3 and 4
    and reaches the same losses and parameters as an uninterrupted run. A hook may end a run early. A batch without
    a key is refused naming it."""
    import jax
    import numpy as np

    from jaxlong.core.mesh import build_mesh
    from jaxlong.training import step as step_lib
    from jaxlong.training.checkpoint import Checkpointer

    def final_params(name):
        ckpt = Checkpointer(tmp_path / name / "checkpoints", every=1, keep=10)
        try:
            return ckpt.restore(step_lib.abstract_state(cfg, build_mesh(cfg.mesh)), 4)[1]["params"]
        finally:
            ckpt.manager.close()

    no_corpus = ("data.path=/nonexistent/corpus.txt", "eval_every=0", "checkpoint_every=2", "optim.decay_steps=4")
    cfg = _cfg(tmp_path, "steps=4", "run_name=full", *no_corpus)
    full_seen, split_seen = [], []
    full = run(cfg, batches=lambda step, rows: _copy_task(step, rows, full_seen))
    run(_cfg(tmp_path, "steps=2", "run_name=split", *no_corpus),
        batches=lambda step, rows: _copy_task(step, rows, split_seen))
    resumed = run(_cfg(tmp_path, "steps=4", "run_name=split", *no_corpus), resume=True,
                  batches=lambda step, rows: _copy_task(step, rows, split_seen))
    assert full_seen == [(s, [0, 1, 2, 3]) for s in (1, 2, 3, 4)]
    assert split_seen == full_seen
    full_losses = [e.value for e in EventAccumulator(str(tmp_path / "full")).Reload().Scalars("loss")]
    split_losses = [e.value for e in EventAccumulator(str(tmp_path / "split")).Reload().Scalars("loss")]
    assert split_losses == pytest.approx(full_losses, rel=1e-6) and len(full_losses) == 4
    assert resumed["metrics"]["loss"] == pytest.approx(full["metrics"]["loss"], rel=1e-6)
    for a, b in zip(jax.tree.leaves(final_params("full")), jax.tree.leaves(final_params("split"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # a hook ends the run early (`StepContext.request_stop`): step 3's checkpoint is saved, `run` returns normally
    from jaxlong.training.hooks import Hook

    early_seen, every_4 = [], []
    early = run(_cfg(tmp_path, "steps=4", "run_name=early", *no_corpus),
                batches=lambda step, rows: _copy_task(step, rows, early_seen),
                hooks=[Hook(lambda ctx: ctx.step == 3 and ctx.request_stop("enough"), every=1),
                       Hook(lambda ctx: every_4.append(ctx.step), every=4)])
    assert (early["step"], early["stopped"]) == (3, "enough") and [s for s, _ in early_seen] == [1, 2, 3]
    assert every_4 == [3]  # the hooks due after the last step run after the step a hook made the last
    assert sorted(int(p.name) for p in (tmp_path / "early" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]
    assert full["step"] == 4 and full["stopped"] is None

    def changed(**keys):
        def fn(step, rows):
            b = {k: v for k, v in _copy_task(step, rows, []).items() if k not in keys}
            return None if keys.get("all") else {**b, **{k: v for k, v in keys.items() if v is not None}}
        return fn

    bad = _cfg(tmp_path, "steps=1", "run_name=bad", *no_corpus)
    for fn, message in [
        (changed(mask=None), r"fn\(1, rows\) returned no mask; a batch has inputs, targets, mask, positions, "
                             r"segment_ids, each \[rows=4, seq_len=128\]"),
        (changed(all=True), r"fn\(1, rows\) returned NoneType; it must return a dict"),
        (changed(inputs=np.full((4, 128), 257)), r"\['inputs'\] holds ids 257..257; token ids are in \[0, 257\)"),
        (changed(targets=np.full((4, 128), 1.5)), r"\['targets'\] has dtype float64; it must be integers"),
        (changed(mask=np.full((4, 128), np.nan)), r"\['mask'\] holds weights nan..nan; loss weights are finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(bad, batches=fn)


@pytest.mark.slow
def test_resume_gives_the_same_next_step_loss(tmp_path):
    full = run(_cfg(tmp_path, "steps=6", "checkpoint_every=3", "run_name=full"))
    run(_cfg(tmp_path, "steps=3", "optim.decay_steps=6", "checkpoint_every=3", "run_name=split"))  # "killed" at 3
    resumed = run(_cfg(tmp_path, "steps=6", "checkpoint_every=3", "run_name=split"), resume=True)
    full_losses = [e.value for e in EventAccumulator(str(tmp_path / "full")).Reload().Scalars("loss")]
    split_losses = [e.value for e in EventAccumulator(str(tmp_path / "split")).Reload().Scalars("loss")]
    assert [e for e in split_losses][:3] == pytest.approx(full_losses[:3], rel=1e-6)
    assert split_losses[3:] == pytest.approx(full_losses[3:], rel=1e-5)  # steps 4..6 after the resume
    assert resumed["metrics"]["loss"] == pytest.approx(full["metrics"]["loss"], rel=1e-5)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(_cfg(tmp_path, "steps=2", "run_name=none"), resume=True)


@pytest.mark.slow
def test_upipe_trains_to_the_same_loss_curve_as_ulysses(tmp_path):
    def curve(impl, *extra):
        run(_cfg(tmp_path, "steps=20", "checkpoint_every=100", f"run_name={impl}", f"attention.impl={impl}", *extra))
        return [e.value for e in EventAccumulator(str(tmp_path / impl)).Reload().Scalars("loss")]

    ulysses = curve("ulysses")
    upipe = curve("upipe", "attention.heads_per_stage=4")
    assert len(upipe) == 20 and upipe[-1] < 0.7 * upipe[0]
    assert upipe == pytest.approx(ulysses, rel=2e-4)


def test_a_step_that_cannot_fit_device_memory_is_refused_before_allocating(monkeypatch):
    import jax
    from helpers import mesh_for

    from jaxlong.config import ConfigError
    from jaxlong.training import step as step_lib
    from jaxlong.training.loop import check_fits

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4")
    compiled = step_lib.compile_train_step(cfg, mesh_for(cfg, 8))
    device = type(jax.local_devices()[0])
    monkeypatch.setattr(device, "memory_stats", lambda self: {"bytes_limit": 1024})
    with pytest.raises(ConfigError, match="per device but the device has 1.00 KiB"):
        check_fits(compiled)


def test_an_existing_run_is_not_overwritten_and_bad_data_fails_before_compiling(tmp_path):
    from jaxlong.config import ConfigError

    run(_cfg(tmp_path, "steps=2", "checkpoint_every=2", "run_name=once"))
    with pytest.raises(ConfigError, match="already holds checkpoints .* pass --resume"):
        run(_cfg(tmp_path, "steps=2", "run_name=once"))
    with pytest.raises(ValueError, match="data.path"):
        run(_cfg(tmp_path, "steps=2", "run_name=bad", f"data.path={tmp_path}/missing.txt"))
    assert run(_cfg(tmp_path, "steps=2", "run_name=once"), resume=True)["metrics"] == {}  # nothing to do


@pytest.mark.slow
def test_sigterm_saves_the_last_finished_step(tmp_path, monkeypatch):
    import os
    import signal

    from jaxlong.training import stepping as trainer

    calls = {"n": 0}
    real_put = trainer.put_batch

    def put_then_preempt(batch, mesh, *args):
        calls["n"] += 1
        if calls["n"] == 4:  # the 4th batch: steps 1-3 are finished
            os.kill(os.getpid(), signal.SIGTERM)
        return real_put(batch, mesh, *args)

    monkeypatch.setattr(trainer, "put_batch", put_then_preempt)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tmp_path, "steps=10", "checkpoint_every=100", "run_name=pre"))
    from jaxlong.training.checkpoint import Checkpointer

    assert Checkpointer.latest_in(tmp_path / "pre" / "checkpoints") == 3


def test_a_gpu_sized_model_on_the_cpu_is_refused_before_the_data_and_the_compile(tmp_path, monkeypatch):
    """configs/llama3_1_8b.yaml on the CPU: its train state alone exceeds host memory, so the trainer says so in
    one line (naming what to run instead) before reading data or compiling."""
    from jaxlong.config import ConfigError, load_config
    from jaxlong.training import loop, start

    monkeypatch.setattr(start.data_lib, "DocumentSource", lambda *a: pytest.fail("read the corpus"))
    monkeypatch.setattr(start.step_lib, "compile_train_step", lambda *a: pytest.fail("compiled"))
    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "llama3_1_8b.yaml"),
                      ["seq_len=131072", "mesh.context=8", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB for its train state alone .* python -m jaxlong.memory "
                                          r"--target h100") as e:
        loop.run(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.subprocess
def test_profile_writes_a_trace_of_its_steps(tmp_path):
    """`python -m jaxlong.train --profile` (a child process, as a user runs it: the profiler is the process's): a
    `jax.profiler` trace of `profile_steps` steps, from the second, under RUN/plugins/profile where TensorBoard's
    profile plugin reads it, and the line that says so."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "jaxlong.train", "--profile", *TINY, *TRAIN, "steps=3",
                           "profile_steps=1", "eval_every=0", "run_name=p", f"run_dir={tmp_path}"],
                          env={**os.environ, "PYTHONPATH": str(root)}, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((tmp_path / "p" / "plugins" / "profile").glob("*/*.xplane.pb"))) == 1
    assert f"profile of 1 steps written under {tmp_path / 'p'}/plugins/profile" in proc.stdout + proc.stderr
