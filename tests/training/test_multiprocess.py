"""Two CPU processes of 4 simulated devices each (jax.distributed, gloo collectives, coordinator on 127.0.0.1) with
fsdp spanning them train with the same losses as one process with 8 devices, and resume like it after a stop or
after one process is killed. `_launch` starts several processes as docs/multi-node.md's launches do (by hand, or
with the variables `srun` sets); tests/training/test_multinode.py runs ring and context across them."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import TRAIN

ROOT = Path(__file__).resolve().parents[2]


def _free_port(low: int = 0, high: int = 0) -> int:
    """A free TCP port on this machine (in `[low, high]` if given)."""
    for port in range(low, high + 1) if low else [0]:
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
    # No persistent compilation cache here: these programs run with cross-process (gloo) collectives, and an
    # entry written by a one-process run of the same program is not known to be valid for them.
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR") and not k.startswith(("SLURM_", "JAX_COORD"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
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


@pytest.mark.subprocess
@pytest.mark.slow
def test_two_processes_train_and_resume_like_one(tmp_path, one_process):
    """Losses of 2 x 4 devices equal those of 1 x 8; a two-process run stopped at a checkpoint and resumed by
    both processes (orbax restores each process's shards) continues with the same losses."""
    args = _args(tmp_path)
    for extra in (["steps=3"], ["steps=6", "--resume"]):  # stopped after step 3, then resumed
        two = _launch([*args, *extra, "run_name=two"], 2)
        for r in two:
            assert r.returncode == 0, r.stdout[-3000:]
    assert "on 8 x cpu" in two[0].stdout.lower()  # one mesh over the devices of both processes
    assert "resumed from" in two[0].stdout and "resumed from" not in two[1].stdout  # process 0 logs
    ref, got = [one_process[s] for s in sorted(one_process)], _losses(tmp_path / "two")
    assert len(got) == 6
    assert got[:3] == pytest.approx(ref[:3], rel=1e-5)
    assert got[3:] == pytest.approx(ref[3:], rel=1e-5)  # after the resume
    assert (tmp_path / "two" / "checkpoints" / "6").is_dir()


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

