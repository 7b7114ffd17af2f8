"""Multi-process runs on `jax.distributed`: one process per host (or per GPU), all forming one mesh.

A run is multi-process when it is launched as several processes, detected as JAX does it:
  - explicitly: `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`;
  - SLURM (`srun`: `SLURM_NTASKS` > 1), Open MPI (`mpirun`: `OMPI_COMM_WORLD_SIZE` > 1): JAX's cluster
    auto-detection finds the coordinator, the process count and the process id. JAX's SLURM detection assumes one
    task per GPU (process i of a node drives that node's GPU i); with one task per node (`SLURM_NTASKS` equal to
    the step's node count) `slurm_local_device_ids` gives each process all the GPUs visible to it instead.
Every process runs the same program on the same config; `jax.devices()` is then the devices of all processes
and the mesh spans them. On CPUs the processes exchange data with gloo
(`jax_cpu_collectives_implementation`), which is how the multi-process path is tested on one machine.

These functions must run before anything touches a jax backend (`python -m jaxlong.train` calls them first):
importing jax is fine, creating a device or an array is not.
"""

from __future__ import annotations

import glob
import json
import os

import jax
import numpy as np

from jaxlong.core import coordinator, liveness
from jaxlong.core.errors import ConfigError


def use_cpu_platform() -> None:
    """Run jax on the CPU platform only (JAX_PLATFORMS=cpu): an installed CUDA plugin then does not initialize a
    driver (which fails, with a traceback, where there is none), and still serves deviceless GPU compiles
    (`jaxlong.plan.target`). Takes effect until a backend is created."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def gpu_driver_present() -> bool:
    """An NVIDIA driver is present (`/dev/nvidiactl`), checked without creating a jax backend."""
    return os.path.exists("/dev/nvidiactl")


def cpu_unless_gpu_driver() -> None:
    """`use_cpu_platform` unless an NVIDIA driver is present or JAX_PLATFORMS is already set."""
    if not gpu_driver_present() and "JAX_PLATFORMS" not in os.environ:
        use_cpu_platform()


# Simulated CPU devices share the host's cores, each running its program on its own thread: between two
# collectives one device's thread can run long after the others (a 1M-token prompt's chunk on 4 devices over 2
# cores spends minutes per layer in attention, and the OS may run two of the four threads first). XLA:CPU logs a
# warning after 20 s at a collective and aborts the process 40 s later
# (`xla_cpu_collective_call_terminate_timeout_seconds`; its collectives time out after 30 min). RULER at 1M tokens
# on 4 devices aborted so at about chunk 88 of 128, after an hour; with these flags it ran to the end, in 2 hours
# 11 minutes (experiments/results/host_memory_ruler_cpu.md; experiments/xla_cpu_collective_skew.py reproduces the
# abort). A deadlock on one host is a bug; waiting an hour for one costs less than losing hours of work. Set for
# CPU runs only (JAX_PLATFORMS naming cpu, or unset or empty with no GPU driver): the timeouts matter only to
# simulated devices, and XLA aborts a process whose XLA_FLAGS hold a flag its version does not know, a risk a GPU
# run need not take (both flags are known to the jax this package pins).
PATIENT_CPU_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=3600",
                           "--xla_cpu_collective_timeout_seconds=3600")


def set_host_device_count(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices unless XLA_FLAGS already sets a count (`cpu_unless_gpu_driver` first);
    for a CPU run (JAX_PLATFORMS naming cpu, or unset or empty without a GPU driver), for patient collectives too
    (`PATIENT_CPU_COLLECTIVES`, each unless XLA_FLAGS sets it). Harmless on GPUs."""
    cpu_unless_gpu_driver()
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={n}"
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()]
    cpu_run = ("cpu" in platforms) if platforms else not gpu_driver_present()
    if cpu_run:
        for flag in PATIENT_CPU_COLLECTIVES:
            if flag.split("=")[0] + "=" not in flags:
                flags = f"{flags} {flag}"
    os.environ["XLA_FLAGS"] = flags.strip()


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def process_count_from_env() -> int:
    """The number of processes this launch consists of (1 for an ordinary single-process run)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and _int_env("JAX_NUM_PROCESSES"):
        return _int_env("JAX_NUM_PROCESSES")
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        n = _int_env(name)
        if n and n > 1 and (name != "SLURM_NTASKS" or "SLURM_STEP_NODELIST" in os.environ):
            return n
    return 1


def slurm_local_device_ids() -> list[int] | None:
    """The local GPU ids for `jax.distributed.initialize` under `srun` with one task per node: every GPU visible to
    the task (`CUDA_VISIBLE_DEVICES`, else the `/dev/nvidia<N>` devices). None (JAX's default, one GPU per task,
    the `SLURM_LOCALID`-th) otherwise: several tasks per node, no SLURM step, no GPU, or `JAX_LOCAL_DEVICE_IDS`
    set by the user."""
    if "SLURM_STEP_NODELIST" not in os.environ or os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    nodes = _int_env("SLURM_STEP_NUM_NODES") or _int_env("SLURM_NNODES")
    if nodes is None or _int_env("SLURM_NTASKS") != nodes:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len([v for v in visible.split(",") if v.strip()]) if visible is not None else \
        len(glob.glob("/dev/nvidia[0-9]*"))
    return list(range(count)) or None


def start(mesh_cfg, lost_process_timeout_s: float = 120) -> int:
    """Start a launch before jax has a backend: check that `mesh_cfg.num_devices` (a `jaxlong.core.mesh.MeshConfig`)
    splits over the processes, ask for `num_devices / processes` simulated devices on the CPU
    (`set_host_device_count`) and `initialize` (with `lost_process_timeout_s`, seconds). Returns the process
    count. The mesh's split over the processes is checked once it is built
    (`jaxlong.core.mesh.check_process_layout`), before anything compiles.

    Raises:
      ConfigError: `mesh.num_devices` is not divisible by the process count.
      ValueError: see `initialize`.
    """
    processes = process_count_from_env()
    if mesh_cfg.num_devices % processes:
        raise ConfigError(f"mesh.num_devices={mesh_cfg.num_devices} is not divisible by the {processes} processes "
                          f"of this launch; use a multiple of {processes}")
    set_host_device_count(mesh_cfg.num_devices // processes)
    return initialize(lost_process_timeout_s)


def initialize(lost_process_timeout_s: float = 120) -> int:
    """`jax.distributed.initialize()` when launched as several processes; returns the process count. Each
    process then runs a `jaxlong.core.liveness.Watchdog`: a process silent for `lost_process_timeout_s` seconds
    ends the others with one line (JAX's own heartbeat timeout is set longer,
    `liveness.jax_heartbeat_timeout`).

    Raises:
      ValueError: JAX_COORDINATOR_ADDRESS is set without JAX_NUM_PROCESSES / JAX_PROCESS_ID (or not integers).
    """
    n = process_count_from_env()
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and n == 1 and _int_env("JAX_NUM_PROCESSES") is None:
        raise ValueError("JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES is not; set both and JAX_PROCESS_ID")
    if n == 1:
        return 1

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; ignored by GPUs
    heartbeat = liveness.jax_heartbeat_timeout(lost_process_timeout_s)
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        pid = _int_env("JAX_PROCESS_ID")
        if pid is None:
            raise ValueError("JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES are set but JAX_PROCESS_ID is not")
        address, devices = os.environ["JAX_COORDINATOR_ADDRESS"], None
    else:  # SLURM / Open MPI auto-detection
        address, n, pid, devices = _detect(n)
    bind = None
    # The coordination service runs beside process 0, not in it (jaxlong.core.coordinator); then the one
    # jax.distributed.initialize starts in process 0 listens on a free local port, unused.
    if pid == 0:
        own = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{address.rsplit(':', 1)[1]}")
        if coordinator.start(own, n, heartbeat, lost_process_timeout_s):
            bind = "127.0.0.1:0"
    jax.distributed.initialize(address, num_processes=n if address else None, process_id=pid,
                               local_device_ids=devices, coordinator_bind_address=bind,
                               heartbeat_timeout_seconds=heartbeat)
    liveness.start_watchdog(jax.process_index(), n, lost_process_timeout_s)
    return n


def _detect(n: int) -> tuple:
    """(coordinator address, process count, process id, local device ids) of a SLURM or Open MPI launch, as
    `jax.distributed.initialize` detects them; where this jax hides its detection, (None, n, None, ...) and
    `initialize` leaves it to JAX (the coordination service then runs inside process 0)."""
    try:
        from jax._src import clusters  # noqa: PLC0415 (what jax.distributed.initialize itself detects)

        return clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, slurm_local_device_ids(),
                                                                        None, 300)
    except (ImportError, AttributeError, TypeError):
        return None, n, None, slurm_local_device_ids()


def say(*args, **kwargs) -> None:
    """`print` on process 0 only (the other processes of a multi-process run stay quiet)."""
    if jax.process_index() == 0:
        print(*args, **kwargs)


def allgather_json(value) -> list:
    """`value` (JSON-serializable) of every process, in process order; `[value]` in a one-process run. A
    collective: every process must call it at the same point."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(gathered[i, :int(n)])) for i, n in enumerate(sizes)]
