"""Two CPU processes of 4 simulated devices each (jax.distributed, gloo collectives, coordinator on
127.0.0.1) train with the same losses as one process with 8 devices."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import TINY
from test_train import TRAIN

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], n: int, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """`python -m jaxlong.train *args` as n processes (n = 1: an ordinary single-process run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    port = _free_port()
    procs = []
    for i in range(n):
        e = dict(env)
        if n > 1:
            e.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxlong.train", *args], env=e, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _losses(run_dir: Path) -> list[float]:
    return [e.value for e in EventAccumulator(str(run_dir)).Reload().Scalars("loss")]


@pytest.mark.skip(reason="fails on the merged Grain pipeline; not yet diagnosed")
def test_two_processes_train_and_resume_like_one(tmp_path):
    """Losses of 2 x 4 devices equal those of 1 x 8; a two-process run stopped at a checkpoint and resumed by
    both processes (orbax restores each process's shards) continues with the same losses."""
    args = [*TINY, *TRAIN, "checkpoint_every=3", "optim.decay_steps=6", f"run_dir={tmp_path}"]
    one = _launch([*args, "steps=6", "run_name=one"], 1)
    assert one[0].returncode == 0, one[0].stdout[-3000:]
    for extra in (["steps=3"], ["steps=6", "--resume"]):  # stopped after step 3, then resumed
        two = _launch([*args, *extra, "run_name=two"], 2)
        for r in two:
            assert r.returncode == 0, r.stdout[-3000:]
    assert "on 8 x cpu" in two[0].stdout.lower()  # one mesh over the devices of both processes
    assert "resumed from" in two[0].stdout and "resumed from" not in two[1].stdout  # process 0 logs
    ref, got = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(got) == 6
    assert got[:3] == pytest.approx(ref[:3], rel=1e-5)
    assert got[3:] == pytest.approx(ref[3:], rel=1e-5)  # after the resume
    assert (tmp_path / "two" / "checkpoints" / "6").is_dir()
