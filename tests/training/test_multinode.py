"""Any mesh axis across the processes, launched as docs/multi-node.md launches it, in miniature: two CPU processes of
4 simulated devices each (jax.distributed, gloo collectives) with ring, or context, spanning them train, resume and
evaluate like one process of 8 devices; started by hand (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID) and with the variables `srun` sets (`test_multiprocess._launcher_env` says what one machine cannot
simulate). A layout that cannot split over the processes is one line and exit 2."""

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import TINY
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_multiprocess import _launch, _ok

# The tiny model at seq_len 128 (ring 2 x context 4: 16 tokens per device; the byte tokenizer's passkey prompt needs
# 101 tokens), 3 steps with a checkpoint after step 2, validation after step 3 (and at the end of each run).
ACROSS = [*TINY, "seq_len=128", "model.vocab_size=257", "data.max_tokens=200000", "optim.lr=1e-2",
          "optim.warmup_steps=1", "optim.decay_steps=3", "mesh.num_devices=8", "mesh.fsdp=1", "checkpoint_every=2",
          "eval_every=3", "eval_batches=1"]
# layout: (overrides, the launcher of the first run, the launcher of the resume and the evaluation)
LAYOUTS = {
    # docs/multi-node.md's command (ring across the nodes, Ulysses inside, U-Pipe, one sequence per step), started
    # by hand, then resumed and evaluated as srun starts it
    "upipe-ring-spans-batch1": (["mesh.ring=2", "mesh.context=4", "attention.impl=upipe", "global_batch=1"],
                                "hand", "slurm"),
    # context (Ulysses) across the nodes, two sequences per step, started as srun starts it, then by hand
    "context-spans-batch2": (["mesh.ring=1", "mesh.context=8", "global_batch=2"], "slurm", "hand"),
}
EVAL = ["--lengths", "128", "--depths", "0.5", "--per-cell", "2"]  # one passkey cell at the training length


def _scalars(run_dir: Path, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in EventAccumulator(str(run_dir)).Reload().Scalars(tag)}


def _summary(run_dir: Path) -> dict:
    (path,) = (run_dir / "eval").rglob("summary.json")
    return json.loads(path.read_text())


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_any_axis_across_processes_trains_resumes_and_evaluates_like_one(tmp_path, layout):
    """Two processes of 4 devices with ring, or context, spanning them (every process builds every row and places
    its sequence slices): 2 steps, a checkpoint, a resume to step 3 in two processes and `python -m jaxlong.eval` in
    two processes give the losses, validation loss and evaluation of one process of 8 devices on the same mesh."""
    check_layout(tmp_path, layout, *LAYOUTS[layout])


def check_layout(tmp_path: Path, layout: str, overrides: list[str], first: str, then: str):
    """The test above for one layout: `overrides` (mesh, attention, batch), `first` the launcher of the first run,
    `then` that of the resume and the evaluation ("hand" or "slurm")."""
    args = [*ACROSS, *overrides, f"run_dir={tmp_path}"]
    ref = _launch([*args, "steps=3", "run_name=one"], 1)
    _ok(ref)
    out = _ok(_launch([*args, "steps=2", "run_name=two"], 2, launcher=first))
    assert "on 8 x cpu" in out
    assert (tmp_path / "two" / "checkpoints" / "2").is_dir()
    out = _ok(_launch([*args, "steps=3", "run_name=two", "--resume"], 2, launcher=then))
    assert "resumed from" in out
    one, two = _scalars(tmp_path / "one", "loss"), _scalars(tmp_path / "two", "loss")
    assert sorted(two) == [1, 2, 3]
    assert [two[s] for s in (1, 2, 3)] == pytest.approx([one[s] for s in (1, 2, 3)], rel=1e-5)
    val_one, val_two = _scalars(tmp_path / "one", "eval/loss"), _scalars(tmp_path / "two", "eval/loss")
    assert val_two[3] == pytest.approx(val_one[3], rel=1e-5)  # validation in the resumed two-process run

    out = _ok(_launch([str(tmp_path / "two"), *EVAL], 2, module="jaxlong.eval", launcher=then))
    summary = _summary(tmp_path / "two")
    assert summary["step"] == 3 and summary["loss"] == pytest.approx(val_one[3], rel=1e-5)
    rows = summary["loss_by_position"]  # per-token losses, gathered from both processes, in token order
    assert sum(r["tokens"] for r in rows) == summary["tokens"]
    by_position = sum(r["loss"] * r["tokens"] for r in rows if r["tokens"]) / summary["tokens"]
    assert by_position == pytest.approx(summary["loss"], rel=1e-5)
    assert len(summary["passkey"]["accuracy"]) == 1
    if layout == "upipe-ring-spans-batch1":  # the same evaluation in one process, of the two-process checkpoint
        shutil.copytree(tmp_path / "two" / "checkpoints", tmp_path / "copy" / "checkpoints")
        _ok(_launch([str(tmp_path / "copy"), *EVAL], 1, module="jaxlong.eval"))
        alone = _summary(tmp_path / "copy")
        assert alone["loss"] == pytest.approx(summary["loss"], rel=1e-5)
        assert [r["loss"] for r in alone["loss_by_position"]] == pytest.approx(
            [r["loss"] for r in summary["loss_by_position"]], rel=1e-5, nan_ok=True)
        assert alone["passkey"]["accuracy"] == summary["passkey"]["accuracy"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_mesh_that_cannot_split_over_the_processes_is_one_line_before_compiling(tmp_path):
    """2 processes of 3 devices cannot hold equal blocks of a mesh with mesh.context=2 and mesh.fsdp=3: each process
    says so in one line and exits with 2, before compiling (and so within seconds of starting)."""
    runs = _launch([*ACROSS, "mesh.num_devices=6", "mesh.fsdp=3", "mesh.context=2", "global_batch=3",
                    f"run_dir={tmp_path}"], 2)
    for r in runs:
        assert r.returncode == 2, r.stdout[-3000:]
        errors = [line for line in r.stdout.splitlines() if re.match(r"(config )?error: ", line)]
        assert len(errors) == 1 and "mesh.context=2 would be cut unevenly" in errors[0], r.stdout[-3000:]
        assert "compiled" not in r.stdout
