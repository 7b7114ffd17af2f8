"""The processes of a multi-process launch watch each other, and agree on when to stop.

Two problems of a launch of several processes (`jaxlong.core.distributed`), each solved through the key-value
store and barriers of JAX's coordination service (it runs beside process 0), outside the devices:

* **A lost process.** A process killed (SIGKILL, the out-of-memory killer, a failed node) leaves the others
  blocked in a collective or failing in it (gloo: "Connection reset by peer"), and JAX's own heartbeat then
  aborts them with a C++ stack dump. `Watchdog` is a daemon thread in every process: it writes its own heartbeat
  (a counter under `jaxlong/alive/<process>`) every `timeout / 8` seconds and reads everyone's; a process whose
  counter has not moved for `timeout` seconds, or a coordinator that cannot be reached for as long, is lost. The
  watchdog then prints one line naming the lost process and the run's latest complete checkpoint and ends its own
  process with `LOST_PROCESS` (exit status 4), before JAX's heartbeat (set longer, `jax_heartbeat_timeout`) would.
  The timeout is `lost_process_timeout_s` of the config. Process 0 is no exception: the coordination service runs
  beside it, not in it (`jaxlong.core.coordinator`), so its loss does not take the store along.
* **A stop on some processes only.** SIGTERM or SIGINT may reach the tasks of a job at different steps, or one
  task only. A process that stops alone enters the checkpoint save's collectives while the others enter the next
  step's, and all hang. `agree_stop` runs at every step boundary: each process posts its pending signal under
  the step's key before a barrier, and after it every process reads the same keys, so all stop after the same
  step and save it.

Source: the failure modes and the agreement follow JAX's preemption sync manager
(`jax.experimental.multihost_utils.reached_preemption_sync_point`), which agrees on a step the same way but only
for the signals JAX itself catches; docs/multi-node.md ("Preemption and lost processes").
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from tqdm import tqdm

LOST_PROCESS = 4  # the exit status of the processes left when one is lost


def _client():
    from jax._src import distributed as jax_distributed  # noqa: PLC0415 (the coordination service's client)

    return jax_distributed.global_state.client


def jax_heartbeat_timeout(timeout_s: float) -> int:
    """JAX's own heartbeat timeout (seconds) for a jaxlong timeout of `timeout_s`: long enough that the watchdog
    reports a lost process (one line) before JAX aborts with a stack dump."""
    return int(2 * timeout_s + 30)


class Watchdog:
    """Every process's heartbeat, and the verdict on a lost one (see the module docstring).

    `checkpoints` (set by the train loop) returns the text on the run's latest complete checkpoint for the
    lost-process line. `start()` runs
    the thread; `verdict(wait)` returns the line for a lost process, waiting up to `wait` seconds for one (the
    main thread calls it when a collective fails, so that the failure is reported as the lost process it is).
    """

    def __init__(self, process: int, processes: int, timeout_s: float):
        self.process, self.processes, self.timeout = process, processes, float(timeout_s)
        self.interval = max(self.timeout / 8, 0.05)
        self.checkpoints: Callable[[], str] | None = None
        self.lost: str | None = None
        self.judging = True
        self._closed = threading.Event()
        self._found = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxlong-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop judging the others, and go on beating until this process exits (its work is done: the others
        finish theirs in step with it, and must not take its exit for a loss)."""
        self.judging = False

    def close(self) -> None:
        """End the thread (its heartbeat too): for a process that leaves the launch, and for tests."""
        self._closed.set()

    def _watch(self) -> None:
        client = _client()
        counter, seen, unreachable_since = 0, {}, None
        while not self._closed.wait(self.interval):
            now = time.monotonic()
            try:
                counter += 1
                client.key_value_set(f"jaxlong/alive/{self.process}", str(counter), allow_overwrite=True)
                beats = dict(client.key_value_dir_get("jaxlong/alive/"))
                unreachable_since = None
            except Exception:  # noqa: BLE001 (the coordinator, process 0, cannot be reached)
                unreachable_since = unreachable_since or now
                if self.judging and now - unreachable_since >= self.timeout:
                    self.report(0, f"the coordination service it runs cannot be reached for {self.timeout:g} s")
                continue
            beats = {k.rsplit("/", 1)[1]: v for k, v in beats.items()}
            for p in range(self.processes):
                beat, last = beats.get(str(p)), seen.get(p)
                if p == self.process:
                    continue
                if last is None or last[0] != beat:  # first seen, or it moved
                    seen[p] = (beat, now)
                elif self.judging and now - last[1] >= self.timeout:
                    self.report(p, f"its heartbeat stopped for {self.timeout:g} s")

    def report(self, p: int, why: str) -> None:
        """Print the one line on process `p` lost because `why`, and end this process with `LOST_PROCESS`."""
        where = f"; {self.checkpoints()}" if self.checkpoints else ""
        self.lost = (f"process {p} of {self.processes} is lost ({why}, lost_process_timeout_s={self.timeout:g})"
                     f"{where}; process {self.process} stops")
        sys.stdout.flush()
        tqdm.write(f"error: {self.lost}", file=sys.stderr)  # on a line of its own, below a progress bar
        sys.stderr.flush()
        self._found.set()
        os._exit(LOST_PROCESS)  # the main thread may be blocked in a collective that never returns

    def verdict(self, wait: float) -> str | None:
        """The lost-process line, waiting up to `wait` seconds for the watchdog to find one (None: all alive)."""
        self._found.wait(wait)
        return self.lost


_WATCHDOG: Watchdog | None = None


def start_watchdog(process: int, processes: int, timeout_s: float) -> Watchdog:
    """Start this process's `Watchdog` (once; `jaxlong.core.distributed.initialize` calls it)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(process, processes, timeout_s).start()
    return _WATCHDOG


def watchdog() -> Watchdog | None:
    """This process's `Watchdog`, or None in a one-process run."""
    return _WATCHDOG


def explain_failure() -> None:
    """In an `except` block of a multi-process run: when the failure (e.g. gloo's "Connection reset by peer" in a
    collective) comes from a lost process, wait for the watchdog, which ends this process with its one line
    (exit status `LOST_PROCESS`); return when no process is lost within twice the timeout, or in a one-process
    run, so that the caller re-raises."""
    if _WATCHDOG is not None and _WATCHDOG.verdict(2 * _WATCHDOG.timeout + 10) is not None:
        time.sleep(10)  # the watchdog has printed its line and is ending the process: no traceback after it


def stop_watchdog() -> None:
    """This process's work is done: stop judging the others (`Watchdog.stop`)."""
    if _WATCHDOG is not None:
        _WATCHDOG.stop()


def agree_stop(step: int, local: int | None, wd: Watchdog | None = None) -> tuple[int, int] | None:
    """The stop every process agrees on at the boundary after step `step`: `(process, signal number)` of the
    lowest-numbered process that had a signal pending (`local` is this process's), or None. A collective of the
    coordination service: every process calls it once per step, with the same `step`. In a one-process run it
    returns `(0, local)` or None. `wd`: this process's watchdog (default: the one `start_watchdog` started).

    Raises:
      RuntimeError: the barrier did not complete within the lost-process timeout (a process is lost; the watchdog
        reports which).
    """
    wd = wd or _WATCHDOG
    if wd is None:
        return (0, local) if local else None
    client = _client()
    if local:
        client.key_value_set(f"jaxlong/stop/{step}/{wd.process}", str(int(local)))
    client.wait_at_barrier(f"jaxlong/step/{step}", int(wd.timeout * 1000))
    posted = sorted((int(k.rsplit("/", 1)[1]), int(v)) for k, v in client.key_value_dir_get(f"jaxlong/stop/{step}/"))
    return posted[0] if posted else None
