"""Two CPU processes of 4 simulated devices each (jax.distributed, gloo collectives, coordinator on 127.0.0.1) with
fsdp spanning them train with the same losses as one process with 8 devices, and resume like it after a stop or
after one process is killed. `_launch` starts several processes as docs/multi-node.md's launches do (by hand, or
with the variables `srun` sets); tests/training/test_multinode.py runs ring and context across them."""

import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, tiny_cfg
from xla_flags import for_children
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import TRAIN

from jaxlong.training.checkpoint import committed_steps

ROOT = Path(__file__).resolve().parents[2]


def _free_port(low: int = 0, high: int = 0) -> int:
    """A free TCP port on this machine (in `[low, high]` if given, tried in random order: two tests launching at
    once on two pytest workers must not both take the lowest free port, or one job's processes join the other's
    coordinator)."""
    ports = random.SystemRandom().sample(range(low, high + 1), high + 1 - low) if low else [0]
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{low}, {high}]")


def _launcher_env(launcher: str, n: int) -> list[dict]:
    """The variables that start process i of n: `hand` sets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (docs/multi-node.md, by hand); `slurm` sets what `srun` sets for one task per node on n nodes
    (`#SBATCH --nodes=n --ntasks-per-node=1`), which JAX's SLURM detection reads: the job id (the coordinator's port
    is derived from it), the step's node list (its first host is the coordinator), the task count, the task's rank
    and local rank, the step's node count.

    What cannot be simulated on one machine: the node list names this machine (`localhost`) rather than separate
    hosts, and the processes run on the CPU, so the GPUs a task drives (`slurm_local_device_ids`: all that are
    visible with one task per node) are checked by tests/core/test_processes.py instead."""
    if launcher == "hand":
        port = _free_port()
        return [dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
                for i in range(n)]
    base = 65535 - 2**12 + 1  # JAX's SLURM coordinator port: job id % 4096 + base
    job = _free_port(base, 65535) - base + 4096 * 7
    return [dict(SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_NODELIST="localhost",
                 SLURM_NTASKS=str(n), SLURM_NNODES=str(n), SLURM_STEP_NUM_NODES=str(n), SLURM_NTASKS_PER_NODE="1",
                 SLURM_PROCID=str(i), SLURM_NODEID=str(i), SLURM_LOCALID="0") for i in range(n)]


def _launch(args: list[str], n: int, timeout: float = 900, faults: dict | None = None,
            kill_all_when_one_dies: bool = False, module: str = "jaxlong.train",
            launcher: str = "hand") -> list[subprocess.CompletedProcess]:
    """`python -m <module> *args` as n processes (n = 1: an ordinary single-process run) started as `launcher`
    starts them (`_launcher_env`). `faults` maps a process id to its `JAXLONG_FAULT`; with `kill_all_when_one_dies`
    the others are killed (SIGKILL) as soon as one exits, as a cluster scheduler ends a job whose task died."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR") and not k.startswith(("SLURM_", "JAX_COORD"))}
    # Each process sets its device count (mesh.num_devices / processes); the compile-speed flags change no result.
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=for_children(os.environ.get("XLA_FLAGS", "")))
    # The test run's compilation cache; the runs of several processes share a directory of their own in it, as
    # their programs run cross-process (gloo) collectives: an entry written by a one-process run of the same
    # program is not known to be valid for them. A resume and an evaluation then reuse the first run's programs.
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache / "multiprocess" if n > 1 else cache)
    starts = _launcher_env(launcher, n) if n > 1 else [{}]
    procs = []
    for i in range(n):
        e = {**env, **starts[i]}
        if faults and i in faults:
            e["JAXLONG_FAULT"] = faults[i]
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=e, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        if kill_all_when_one_dies:
            deadline = time.monotonic() + timeout
            while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _ok(runs: list[subprocess.CompletedProcess]) -> str:
    """Process 0's output, after checking that every process exited with 0."""
    for r in runs:
        assert r.returncode == 0, r.stdout[-3000:]
    return runs[0].stdout


def _loss_by_step(run_dir: Path) -> dict[int, float]:
    """The logged loss of each step, the last value where a step was logged twice (before and after a kill)."""
    return {e.step: e.value for e in EventAccumulator(str(run_dir)).Reload().Scalars("loss")}


def _losses(run_dir: Path) -> list[float]:
    """The logged losses in step order (`_loss_by_step`)."""
    by_step = _loss_by_step(run_dir)
    return [by_step[k] for k in sorted(by_step)]


def _args(run_dir: Path) -> list[str]:
    """The runs of this file: 6 steps of the tiny model, a checkpoint every 3."""
    return [*TINY, *TRAIN, "checkpoint_every=3", "optim.decay_steps=6", f"run_dir={run_dir}"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted single-process run (8 devices) that both tests compare with: its loss at each step."""
    run_dir = tmp_path_factory.mktemp("one-process")
    one = _launch([*_args(run_dir), "steps=6", "run_name=one"], 1)
    assert one[0].returncode == 0, one[0].stdout[-3000:]
    losses = _loss_by_step(run_dir / "one")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return losses


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """A two-process run stopped at a checkpoint (steps=3) and resumed by both processes to step 6: its run
    directory and the resumed launch's processes."""
    run_dir = tmp_path_factory.mktemp("two-processes")
    args = _args(run_dir)
    for extra in (["steps=3"], ["steps=6", "--resume"]):  # stopped after step 3, then resumed
        two = _launch([*args, *extra, "run_name=two"], 2)
        for r in two:
            assert r.returncode == 0, r.stdout[-3000:]
    return run_dir / "two", two


@pytest.mark.subprocess
@pytest.mark.slow
def test_two_processes_train_and_resume_like_one(one_process, two_processes):
    """Losses of 2 x 4 devices equal those of 1 x 8; a two-process run stopped at a checkpoint and resumed by
    both processes (orbax restores each process's shards) continues with the same losses."""
    run_dir, two = two_processes
    assert "on 8 x cpu" in two[0].stdout.lower()  # one mesh over the devices of both processes
    assert "resumed from" in two[0].stdout and "resumed from" not in two[1].stdout  # process 0 logs
    ref, got = [one_process[s] for s in sorted(one_process)], _losses(run_dir)
    assert len(got) == 6
    assert got[:3] == pytest.approx(ref[:3], rel=1e-5)
    assert got[3:] == pytest.approx(ref[3:], rel=1e-5)  # after the resume
    assert (run_dir / "checkpoints" / "6").is_dir()


def _final_state(run_dir: Path, step: int) -> dict:
    """The train state of checkpoint `step` of a run of `_args`, restored in this process (8 devices)."""
    import jax
    import numpy as np

    from jaxlong.core.mesh import build_mesh
    from jaxlong.training import step as step_lib
    from jaxlong.training.checkpoint import Checkpointer

    cfg = tiny_cfg(*TRAIN, "checkpoint_every=3", "optim.decay_steps=6")
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=100)
    try:
        _, state = ckpt.restore(step_lib.abstract_state(cfg, build_mesh(cfg.mesh)), step)
    finally:
        ckpt.manager.close()
    return jax.tree.map(np.asarray, state)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path, two_processes):
    """SIGTERM reaches process 1 alone, after its step 3 (as a cluster may signal one task, or the tasks at
    different steps): the processes agree to stop after step 3, both save it and exit with 128 + 15, and `--resume`
    reaches final parameters bit-equal to the run stopped at step 3 by its config and resumed."""
    import numpy as np

    args = [*_args(tmp_path), "steps=6", "run_name=two"]
    stopped = _launch(args, 2, faults={1: "after_step@3:SIGTERM"}, timeout=600)
    assert [r.returncode for r in stopped] == [143, 143], stopped[0].stdout[-3000:] + stopped[1].stdout[-3000:]
    assert "process 1 received SIGTERM: every process stops after step 3, then saves it" in stopped[0].stdout
    assert "stopped by SIGTERM after step 3; latest committed checkpoint: step 3" in stopped[0].stdout
    assert committed_steps(tmp_path / "two" / "checkpoints") == [3]
    _ok(_launch([*args, "--resume"], 2))
    reference, got = _final_state(two_processes[0], 6), _final_state(tmp_path / "two", 6)
    import jax

    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(got)):
        assert np.array_equal(x, y), f"{jax.tree_util.keystr(path)} differs"


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_process_ends_the_others(tmp_path, lost):
    """Process `lost` is killed (SIGKILL) as it starts the step-6 save, the other left running (at that point the
    step-3 checkpoint is committed: a save starts after the previous one commits).

    Within the configured `lost_process_timeout_s` (3 s here) the other's watchdog ends it with exit status 4 and
    one line naming the lost process and the latest complete checkpoint (step 3), no traceback. Process 0 is no
    exception: JAX's coordination service runs beside it (`jaxlong.core.coordinator`), not in it, and outlives it
    long enough for that line; then it frees the port (a relaunch on it starts)."""
    args = [*_args(tmp_path), "steps=6", "run_name=two", "lost_process_timeout_s=3"]
    runs = _launch(args, 2, faults={lost: "during_save@6:SIGKILL"}, timeout=300)
    survivor = runs[1 - lost]
    assert runs[lost].returncode == -9
    assert committed_steps(tmp_path / "two" / "checkpoints") == [3]
    assert survivor.returncode == 4, survivor.stdout[-3000:]
    errors = [line for line in survivor.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, survivor.stdout[-3000:]
    assert errors[0].startswith(f"error: process {lost} of 2 is lost (its heartbeat stopped for 3 s, "
                                "lost_process_timeout_s=3); latest complete checkpoint: step 3 in "), errors[0]
    assert errors[0].endswith(f"relaunch every process with --resume; process {1 - lost} stops")
    assert "Traceback" not in survivor.stdout and "Fatal" not in survivor.stdout


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_killed_process_loses_no_checkpoint_and_both_resume_like_one(tmp_path, one_process):
    """Process 1 is killed (SIGKILL) just after it starts the step-6 save, the job's other process is killed with
    it; resuming both continues from the step-3 checkpoint with the losses of an uninterrupted single-process run.

    The kill waits for the event the test relies on, not for a number of steps: a save starts only after the
    previous one has committed (`Checkpointer.save` waits for it), so at `during_save@6` the step-3 checkpoint is
    committed whatever the machine's load, and the step-6 save, started an instant before, cannot commit without
    the killed process's shards."""
    args = [*_args(tmp_path), "steps=6"]
    killed = _launch([*args, "run_name=two"], 2, faults={1: "during_save@6:SIGKILL"}, kill_all_when_one_dies=True)
    assert killed[1].returncode == -9, killed[1].stdout[-3000:]
    assert killed[0].returncode != 0  # the job ended with it
    ckpts = sorted(int(d.name) for d in (tmp_path / "two" / "checkpoints").iterdir() if d.name.isdigit())
    assert ckpts == [3], ckpts  # the step-3 checkpoint survived whole; nothing later was committed
    resumed = _launch([*args, "run_name=two", "--resume"], 2)
    for r in resumed:
        assert r.returncode == 0, r.stdout[-3000:]
    assert "resumed from" in resumed[0].stdout
    # Steps 4..6 as the resumed job logged them equal the uninterrupted run's (the killed job's own event file may
    # hold fewer steps: SIGKILL loses what its event writer had not flushed yet).
    two, one = _loss_by_step(tmp_path / "two"), one_process
    assert {4, 5, 6} <= set(two)
    assert [two[s] for s in (4, 5, 6)] == pytest.approx([one[s] for s in (4, 5, 6)], rel=1e-5)
    assert (tmp_path / "two" / "checkpoints" / "6").is_dir()



@pytest.mark.subprocess
@pytest.mark.slow
def test_generation_across_two_processes_prints_what_one_process_prints(two_processes):
    """`python -m jaxlong.generate` on the two-process run, launched as two processes (FSDP 2 x Ulysses 4: the batch
    axes span the processes), with the weights replicated for decoding (`auto`: the processes agree on it) and
    sharded: both processes exit 0, and process 0 prints the greedy continuation one process prints."""
    run_dir, _ = two_processes
    args = [str(run_dir), "--prompt", "def fibonacci(n):", "--max-new-tokens", "8"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    for weights, placed in (("auto", "replicated"), ("sharded", "sharded")):
        one = subprocess.run([sys.executable, "-m", "jaxlong.generate", *args, f"decode_weights={weights}"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert one.returncode == 0 and one.stdout and f"weights {placed}" in one.stderr, one.stderr[-3000:]
        out = _ok(_launch([*args, f"decode_weights={weights}"], 2, module="jaxlong.generate"))
        # XLA's log lines, which the merged stderr may put inside the streamed text
        out = re.sub(r"[WIEF]\d{4} \d\d:\d\d:[^\n]*\n", "", out)
        assert one.stdout in out and "8 generated" in out and f"weights {placed}" in out, (one.stdout, out[-3000:])
