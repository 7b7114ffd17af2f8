"""JAX's coordination service in a process of its own, so that losing process 0 is a lost process like any other.

`jax.distributed.initialize` runs the coordination service (the key-value store, barriers and heartbeats every
process's JAX client talks to) inside process 0. When process 0 is killed the service goes with it, and JAX's
client in every other process aborts at once with a C++ stack dump, before jaxlong's watchdog
(`jaxlong.core.liveness`) can say which process was lost and which checkpoint is whole. Here process 0 starts the
service in a small child process (`python -m jaxlong.core.coordinator`) on the coordinator's port, and its own
`initialize` binds a throwaway service to a free local port that no client uses. The child outlives a killed
process 0 until the other processes have gone too (their watchdogs report the loss and end them), at most `linger_s`,
and then exits, freeing the port for a relaunch with `--resume`; after a normal exit the others only disconnect.

Source: torchelastic hosts its rendezvous store in the launcher's agent rather than in rank 0 for the same reason
(PyTorch, `torch.distributed.elastic`); docs/multi-node.md ("Preemption and lost processes").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from jaxlong.core.errors import ConfigError

_CHILD: subprocess.Popen | None = None


def linger_s(lost_process_timeout_s: float) -> float:
    """The most (seconds) the service outlives process 0 while other processes stay connected: past the time in
    which their watchdogs judge a process lost (`lost_process_timeout_s`) and JAX's own heartbeat
    (`liveness.jax_heartbeat_timeout`) would end them."""
    return 2 * lost_process_timeout_s + 60


def start(bind_address: str, processes: int, heartbeat_s: int, lost_process_timeout_s: float) -> bool:
    """Start the coordination service for `processes` processes in a child process bound to `bind_address`
    (`host:port`; JAX's heartbeat `heartbeat_s` seconds) and wait until it listens. Called by process 0 before
    its own `jax.distributed.initialize`. Returns False, with a note on stderr, where the child could not start
    the service (a jaxlib without the function it calls): JAX then runs it inside process 0, as by default.

    Raises:
      ConfigError: something already listens on the port (gRPC would share it: two services, each with part of
        the clients); the message names the port and what to do.
    """
    global _CHILD
    host, port = bind_address.rsplit(":", 1)
    if _listening(host.strip("[]"), int(port)):
        raise ConfigError(f"the coordinator port {port} (JAX_COORDINATOR_ADDRESS, or SLURM's from the job id) is in "
                          f"use: by the coordination service of an earlier run still ending (at most "
                          f"{linger_s(lost_process_timeout_s):g} s after its process 0) or by another program; "
                          f"wait, or choose another port")
    cmd = [sys.executable, "-m", "jaxlong.core.coordinator", bind_address, str(processes), str(heartbeat_s),
           str(os.getpid()), str(linger_s(lost_process_timeout_s))]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = child.stdout.readline().strip()
    child.stdout.close()
    if ready != "listening":
        child.wait(30)
        print(f"note: the coordination service runs inside process 0 (its own process could not start it: "
              f"{ready or 'exit status ' + str(child.returncode)}); losing process 0 ends the others with JAX's "
              f"message", file=sys.stderr)
        return False
    _CHILD = child
    return True


def _listening(host: str, port: int) -> bool:
    """Whether a socket listens on `port` of `host` ("::" or "" for every address): a plain bind (address reuse
    allowed, so that the closed connections of an earlier run do not count) fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return True
    return False


def _connections(port: int) -> int | None:
    """The established TCP connections to local `port` (the clients of the service), read from /proc/net; None
    where /proc/net cannot be read."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            return None
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                count += 1
    return count


def _serve(bind_address: str, processes: int, heartbeat_s: int, parent: int, linger: float) -> None:
    from jax._src.lib import _jax  # noqa: PLC0415 (jaxlib's service; no backend or device is created)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a job's stop signal is for the trainers: they
        signal.signal(sig, signal.SIG_IGN)                        # still need the store to agree on it and save
    try:
        service = _jax.get_distributed_runtime_service(bind_address, processes, heartbeat_timeout=heartbeat_s)
    except Exception as e:  # noqa: BLE001 (reported on one line by the parent)
        print(" ".join(str(e).split()), flush=True)
        return
    print("listening", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the parent has read its one line and closed the pipe
    while os.getppid() == parent:
        time.sleep(0.2)
    # Process 0 is gone: serve the others until they have gone too (after a normal exit they only disconnect;
    # after a kill their watchdogs need the store to agree that process 0 is lost), at most `linger` seconds.
    port, deadline, idle = int(bind_address.rsplit(":", 1)[1]), time.monotonic() + linger, 0
    while time.monotonic() < deadline and idle < 3:
        time.sleep(0.2)
        idle = idle + 1 if _connections(port) == 0 else 0
    service.shutdown()


if __name__ == "__main__":
    address, n, heartbeat, parent_pid, linger_for = sys.argv[1:6]
    _serve(address, int(n), int(heartbeat), int(parent_pid), float(linger_for))
