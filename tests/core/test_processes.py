"""How a mesh splits over the processes of a launch (`process_layout_error`), and the GPUs a SLURM task drives
(`slurm_local_device_ids`) and the XLA:CPU flags a launch asks for, checked without launching processes."""

import os

import numpy as np
import pytest

from jaxlong.core import distributed
from jaxlong.core.mesh import process_layout_error


def _in_order(shape, processes):
    """The process of each mesh position when devices are taken process by process (`jax.devices()` order)."""
    n = int(np.prod(shape))
    return (np.arange(n) // (n // processes)).reshape(shape)


@pytest.mark.parametrize("shape,processes", [
    ((1, 1, 2, 8), 2),  # the docs' 2 nodes x 8 GPUs: ring across nodes, context inside
    ((1, 1, 4, 8), 4),
    ((1, 1, 1, 16), 2),  # context across nodes
    ((1, 2, 2, 2), 2),  # fsdp across
    ((2, 1, 2, 2), 4),  # data and ring across
    ((1, 1, 2, 8), 16),  # one process per GPU
    ((1, 1, 1, 8), 1),
])
def test_layouts_that_split(shape, processes):
    assert process_layout_error(_in_order(shape, processes)) is None


def test_layouts_that_cannot_split():
    # 2 processes of 6 devices: mesh.context=4 is cut unevenly (one process would hold 1.5 context groups)
    err = process_layout_error(_in_order((1, 3, 1, 4), 2))
    assert "mesh.context=4 would be cut unevenly" in err and "2 processes" in err and "6 devices each" in err
    # 3 processes of 2 devices over context=3
    assert "mesh.context=3" in process_layout_error(_in_order((1, 2, 1, 3), 3))
    # unequal devices per process (a node with fewer GPUs)
    ids = np.array([0] * 5 + [1] * 3).reshape(1, 1, 2, 4)
    assert "process 0: 5, process 1: 3" in process_layout_error(ids)
    # equal counts, but interleaved devices: not a block of the mesh
    ids = (np.arange(8) % 2).reshape(1, 1, 2, 4)
    assert "do not form a block" in process_layout_error(ids)


def test_simulated_cpu_devices_get_patient_collectives_unless_the_user_set_them(monkeypatch):
    """XLA:CPU aborts a process whose device threads reach a collective more than a minute apart, which simulated
    devices sharing a few cores do at long lengths: a CPU launch asks for an hour, keeping any value the user gave;
    a GPU launch's flags are left alone (XLA refuses a flag it does not know)."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    distributed.set_host_device_count(4)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                               "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
                                               "--xla_cpu_collective_timeout_seconds=3600"]
    mine = "--xla_force_host_platform_device_count=2 --xla_cpu_collective_call_terminate_timeout_seconds=900"
    monkeypatch.setenv("XLA_FLAGS", mine)
    distributed.set_host_device_count(4)
    assert os.environ["XLA_FLAGS"] == mine + " --xla_cpu_collective_timeout_seconds=3600"
    monkeypatch.setattr(distributed, "gpu_driver_present", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "")  # jax's own advice: any platform, here the CPU
    monkeypatch.setenv("XLA_FLAGS", "")
    distributed.set_host_device_count(4)
    assert os.environ["XLA_FLAGS"].split()[1:] == list(distributed.PATIENT_CPU_COLLECTIVES)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("XLA_FLAGS", "")
    distributed.set_host_device_count(4)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env,want", [
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, list(range(8))),
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "CUDA_VISIBLE_DEVICES": "4,5"}, [0, 1]),  # part of a node
    ({"SLURM_NTASKS": "16", "SLURM_STEP_NUM_NODES": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, None),  # one task per GPU
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "CUDA_VISIBLE_DEVICES": "0,1",
      "JAX_LOCAL_DEVICE_IDS": "0"}, None),  # the user's choice wins
    ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "CUDA_VISIBLE_DEVICES": ""}, None),  # no GPU: JAX's default
], ids=["task-per-node", "part-of-node", "task-per-gpu", "user-ids", "no-gpu"])
def test_slurm_task_per_node_drives_every_visible_gpu(monkeypatch, env, want):
    """JAX's SLURM detection gives each task the GPU of its local rank (one task per GPU); with one task per node,
    as docs/multi-node.md launches, the task must drive every GPU it sees."""
    for k in ("SLURM_NNODES", "JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**SLURM, **env}.items():
        monkeypatch.setenv(k, v)
    assert distributed.slurm_local_device_ids() == want
    assert distributed.process_count_from_env() == int(env["SLURM_NTASKS"])


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_coordination_service_refuses_a_port_in_use_and_ends_after_process_0(monkeypatch, capsys):
    """Process 0 starts JAX's coordination service beside it (`jaxlong.core.coordinator`): on a port something
    already listens on it refuses in one line (gRPC would share the port: two services, each with part of the
    clients); started by a process that then exits with no client connected, it ends within seconds and frees the
    port; where its process cannot start the service, a note says that JAX runs it inside process 0."""
    import socket
    import subprocess
    import sys
    import time

    from jaxlong.core import coordinator
    from jaxlong.core.errors import ConfigError

    port = _port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=f"coordinator port {port} .* is in use: .* choose another port"):
            coordinator.start(f"[::]:{port}", 2, 60, 3)
    parent = subprocess.run([sys.executable, "-c", "from jaxlong.core import coordinator, distributed; "
                             f"coordinator.start('[::]:{port}', 2, 60, 3); print(coordinator._listening('::', {port}))"],
                            capture_output=True, text=True, timeout=120)
    assert parent.returncode == 0 and parent.stdout.split() == ["True"], parent.stdout + parent.stderr
    deadline = time.monotonic() + 30
    while coordinator._listening("::", port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not coordinator._listening("::", port), "the service outlived its process 0 with no client"
    assert coordinator._connections(port) == 0
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a child that cannot start the service
    assert coordinator.start(f"[::]:{port}", 2, 60, 3) is False
    assert "the coordination service runs inside process 0" in capsys.readouterr().err
