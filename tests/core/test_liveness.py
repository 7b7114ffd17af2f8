"""The watchdog and the stop agreement of a multi-process launch (`jaxlong.core.liveness`), against an in-memory
stand-in for JAX's coordination service; tests/training/test_multiprocess.py runs them across real processes."""

import threading
import time

import pytest

from jaxlong.core import liveness
from jaxlong.training.loop import latest_checkpoint_text


class FakeCoordinator:
    """The key-value store and barriers of JAX's coordination service, in memory, for `n` simulated processes."""

    def __init__(self, n: int):
        self.n, self.kv, self.lock, self.down = n, {}, threading.Lock(), False
        self.barriers: dict[str, int] = {}

    def client(self):
        return self

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        with self.lock:
            assert allow_overwrite or key not in self.kv, key
            self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def wait_at_barrier(self, barrier_id, timeout_in_ms):
        with self.lock:
            self.barriers[barrier_id] = self.barriers.get(barrier_id, 0) + 1
        deadline = time.monotonic() + timeout_in_ms / 1000
        while self.barriers[barrier_id] < self.n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {barrier_id} timed out")
            time.sleep(0.001)


class Exited(BaseException):
    pass


@pytest.fixture
def coordinator(monkeypatch):
    fake = FakeCoordinator(2)
    monkeypatch.setattr(liveness, "_client", fake.client)
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise Exited(code)

    monkeypatch.setattr(liveness.os, "_exit", fake_exit)
    fake.exits = exits
    return fake


def _watch(wd: liveness.Watchdog, seconds: float) -> None:
    """Run the watchdog's loop in this thread until it exits the process (`Exited`) or `seconds` pass."""
    t = threading.Thread(target=lambda: _catch(wd._watch), daemon=True)
    t.start()
    t.join(seconds)


def _catch(fn):
    try:
        fn()
    except Exited:
        pass


def test_a_process_whose_heartbeat_stops_is_reported_once_with_the_latest_checkpoint(coordinator, tmp_path, capsys):
    """Process 1 beats a few times, then stops (killed): process 0's watchdog names it, the timeout and the latest
    complete checkpoint, and ends its process with LOST_PROCESS; while process 1 beats, nothing is reported."""
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "_CHECKPOINT_METADATA").write_text("{}")  # committed
    (tmp_path / "6.orbax-checkpoint-tmp-12").mkdir()  # an uncommitted save is not a checkpoint
    wd = liveness.Watchdog(0, 2, timeout_s=0.4)
    wd.checkpoints = lambda: latest_checkpoint_text(tmp_path)
    beating = threading.Event()
    beating.set()

    def process_1():
        k = 0
        while beating.is_set():
            k += 1
            coordinator.key_value_set("jaxlong/alive/1", str(k), allow_overwrite=True)
            time.sleep(0.02)

    threading.Thread(target=process_1, daemon=True).start()
    _watch(wd, 1.0)  # process 1 alive: no verdict within 2.5 timeouts
    assert wd.lost is None and coordinator.exits == []
    wd.close()
    wd = liveness.Watchdog(0, 2, timeout_s=0.4)
    wd.checkpoints = lambda: latest_checkpoint_text(tmp_path)
    beating.clear()
    _watch(wd, 5.0)
    assert coordinator.exits == [liveness.LOST_PROCESS]
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    assert err.startswith("error: process 1 of 2 is lost (its heartbeat stopped for 0.4 s, "
                          "lost_process_timeout_s=0.4); latest complete checkpoint: step 3 in "), err
    assert err.endswith("relaunch every process with --resume; process 0 stops")
    assert wd.verdict(0) == err.removeprefix("error: ")


def test_an_unreachable_coordinator_is_process_0_lost(coordinator, capsys):
    coordinator.down = True
    wd = liveness.Watchdog(1, 2, timeout_s=0.3)
    _watch(wd, 5.0)
    assert coordinator.exits == [liveness.LOST_PROCESS]
    assert capsys.readouterr().err.startswith("error: process 0 of 2 is lost (the coordination service it runs "
                                              "cannot be reached for 0.3 s")


def test_a_stopped_watchdog_keeps_beating_and_judges_no_one(coordinator):
    """After its own work is done a process must not take the others' exit for a loss, and they must not take
    its exit for one either: `stop` ends the judging, not the heartbeat."""
    wd = liveness.Watchdog(0, 2, timeout_s=0.2)
    wd.stop()
    _watch(wd, 1.0)
    wd.close()
    assert coordinator.exits == [] and int(coordinator.kv["jaxlong/alive/0"]) >= 3


def test_processes_agree_on_the_first_signalled_process_at_each_step(coordinator):
    """Both processes call agree_stop at each step boundary; a signal pending on process 1 only stops both after
    the same step, with process 1's signal; with none pending both go on. One process alone decides by itself."""
    assert liveness.agree_stop(5, None) is None and liveness.agree_stop(5, 15) == (0, 15)  # no watchdog: one process
    out = {}

    def process(p, pending):  # a thread standing for process p, with its own watchdog
        wd = liveness.Watchdog(p, 2, timeout_s=5)
        out[p] = [liveness.agree_stop(step, local, wd) for step, local in enumerate(pending)]

    threads = [threading.Thread(target=process, args=(0, [None, None, 2, None])),
               threading.Thread(target=process, args=(1, [None, 15, 15, None]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out[0] == out[1] == [None, (1, 15), (0, 2), None]


def test_a_barrier_that_times_out_raises(coordinator):
    """Process 1 never reaches the step's barrier: process 0's agree_stop fails after the timeout (the watchdog
    names the lost process) instead of waiting forever."""
    with pytest.raises(RuntimeError, match="barrier"):
        liveness.agree_stop(1, None, liveness.Watchdog(0, 2, timeout_s=0.2))
