"""The suite's pytest-xdist scheduler (`tests/crash_retry.py`) when a worker dies: the run ends, the crashed test
runs once more, and a test that crashes every time fails the run.

The first tests (slow tier) run pytest on a small generated suite in a child process (no jax), with a time limit:
pytest-xdist 3.8's own `--dist loadfile` scheduler hangs on the first case. The last ones (fast tier) drive the scheduler directly with
stand-in workers, for orders of events a real run cannot be made to produce reliably."""
import collections
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from crash_retry import CrashTolerantLoadFileScheduling, pytest_handlecrashitem

TESTS = os.path.dirname(os.path.abspath(__file__))


def _run_suite(tmp_path, files, workers, *options):
    """Run `pytest -n workers --dist loadfile -p crash_retry` on `files` (name -> source) in `tmp_path`; returns
    (exit code, output)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, source in files.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_", "JAX_"))}
    env["PYTHONPATH"] = TESTS
    env["CRASH_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadfile", "-p", "crash_retry",
         "-p", "no:cacheprovider", "-p", "no:benchmark", *options],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


# Tests of a generated suite that log their node id when they finish; `crash_once(key)` aborts the worker the first
# time it is called with `key`.
LOGGING = """
import os, pathlib
D = pathlib.Path(os.environ["CRASH_DIR"])
def log(name):
    with open(D / "log.txt", "a") as f:
        f.write(name + "\\n")
def crash_once(key):
    marker = D / ("crashed-" + key)
    if not marker.exists():
        marker.touch()
        os.abort()
"""


PASSING = {
    "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    "test_b.py": "def test_b1(): pass\ndef test_b2(): pass\ndef test_b3(): pass\n",
}


@pytest.mark.slow  # a child pytest run each
def test_a_test_that_crashes_once_is_rerun_and_the_run_passes(tmp_path):
    """One worker: it finishes two files, then dies in the last file's only test. pytest-xdist 3.8 requeues the
    finished files as empty work units and hangs; here the test reruns on the replacement worker and passes."""
    crash_once = LOGGING + "def test_crash_once():\n    crash_once('x')\n"
    code, out = _run_suite(tmp_path, {**PASSING, "test_c.py": crash_once}, workers=1)
    assert code == 0, out
    assert "crashed while running 'test_c.py::test_crash_once'" in out, out
    assert "7 passed, 1 rerun" in out, out


@pytest.mark.slow  # a child pytest run each
def test_a_test_that_always_crashes_fails_and_the_rest_still_run(tmp_path):
    """Two workers: a test that aborts its worker every time is rerun once, then reported failed; the test after
    it in the same file and every other file still run."""
    crash_always = "import os\ndef test_crash_always(): os.abort()\ndef test_after(): pass\n"
    code, out = _run_suite(tmp_path, {**PASSING, "test_c.py": crash_always}, workers=2)
    assert code == 1, out
    assert "FAILED test_c.py::test_crash_always" in out, out
    assert "1 failed, 7 passed, 1 rerun" in out, out


def _logged(tmp_path):
    return collections.Counter((tmp_path / "log.txt").read_text().split())


@pytest.mark.slow  # a child pytest run each
def test_a_worker_that_dies_holding_the_next_file_is_replaced_by_one_that_runs_both(tmp_path):
    """One worker dies in the last test of its file while it already holds the next file: the replacement gets
    both (with only the crashed test it would wait for a next test forever), and every test runs once."""
    files = {
        "test_a.py": LOGGING + "".join(f"def test_a{i}(): log('a{i}')\n" for i in range(5))
        + "def test_x():\n    crash_once('x'); log('x')\n",
        "test_b.py": LOGGING + "".join(f"def test_b{i}(): log('b{i}')\n" for i in range(3)),
        "test_c.py": LOGGING + "".join(f"def test_c{i}(): log('c{i}')\n" for i in range(2)),
    }
    code, out = _run_suite(tmp_path, files, 1)
    assert code == 0 and "11 passed, 1 rerun" in out, out
    assert set(_logged(tmp_path).values()) == {1} and len(_logged(tmp_path)) == 11, _logged(tmp_path)


@pytest.mark.slow  # a child pytest run each
def test_a_crash_that_uses_up_the_worker_restarts_fails_the_run(tmp_path):
    """With `--max-worker-restart=1` the second crash leaves no worker to rerun anything: it is reported failed
    (not `rerun`), and the run fails although no test crashed twice."""
    files = {"test_b.py": LOGGING + "".join(f"def test_c{i}():\n    crash_once('c{i}')\n" for i in range(3))
             + "def test_after(): pass\n"}
    code, out = _run_suite(tmp_path, files, 1, "--max-worker-restart=1")
    assert code == 1, out
    assert "FAILED test_b.py::test_c1" in out and "1 rerun" in out, out


class _Worker:
    """A stand-in for pytest-xdist's `WorkerController`: records the test indices it is sent and its shutdown."""

    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent += indices

    def shutdown(self):
        self.shutting_down = True


def _scheduler(workers, collection):
    options = SimpleNamespace(loadscopereorder=False)
    dsession = SimpleNamespace(_max_worker_restart=None, _failed_nodes_count=0)
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=options,
                             pluginmanager=SimpleNamespace(getplugin=lambda name: dsession))
    sched = CrashTolerantLoadFileScheduling(config)
    nodes = [_Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes


def _crash_report():
    return SimpleNamespace(outcome="failed")


def test_a_crashed_test_taken_at_once_by_another_worker_is_still_reported_as_a_rerun():
    """The crashed file can leave the queue before pytest-xdist reports the crash (another worker short of work
    takes it): the crash is still a `rerun`, as the scheduler remembers it rather than looking on the queue."""
    collection = ["test_f1.py::test_f1", "test_f2.py::test_f2", "test_f2.py::test_g2"]
    sched, (gw0, gw1) = _scheduler(2, collection)
    assert [collection[i] for i in gw1.sent] == ["test_f2.py::test_f2", "test_f2.py::test_g2"]
    crashitem = sched.remove_node(gw1)
    assert crashitem == "test_f2.py::test_f2" and list(sched.workqueue) == ["test_f2.py"]
    sched._assign_work_unit(gw0)  # gw0 takes the file before the crash is reported
    assert not sched.workqueue and collection.index(crashitem) in gw0.sent
    report = _crash_report()
    assert pytest_handlecrashitem(crashitem, report, sched) is True and report.outcome == "rerun"


def test_a_replacement_worker_still_collecting_is_given_no_work():
    """A worker added but not yet collected is skipped when a crash reschedules (pytest-xdist would index its
    missing collection); `schedule()` gives it the requeued file once its collection is in."""
    collection = ["test_a.py::test_a", "test_b.py::test_b", "test_b.py::test_b2", "test_c.py::test_c"]
    sched, (gw0,) = _scheduler(1, collection)
    replacement = _Worker("gw1")
    sched.add_node(replacement)
    crashitem = sched.remove_node(gw0)
    assert crashitem == "test_a.py::test_a" and replacement.sent == []
    sched.add_node_collection(replacement, collection)
    sched.schedule()
    # gw0's two unfinished files (test_c.py was never handed out); a worker holding over two tests gets no more
    assert [collection[i] for i in replacement.sent] == collection[:3] and list(sched.workqueue) == ["test_c.py"]


@pytest.mark.parametrize("second_crash", [False, True], ids=["first-crash", "second-crash"])
def test_a_test_is_put_back_after_its_first_crash_only(second_crash):
    """The first crash of a test requeues it (reported `rerun`); its second crash does not (reported failed)."""
    collection = ["test_a.py::test_a", "test_a.py::test_b"]
    sched, (gw0,) = _scheduler(1, collection)
    if second_crash:
        sched.retried.add("test_a.py::test_a")
    crashitem = sched.remove_node(gw0)
    report = _crash_report()
    pytest_handlecrashitem(crashitem, report, sched)
    unit = sched.workqueue["test_a.py"]
    assert unit == {"test_a.py::test_a": second_crash, "test_a.py::test_b": False}
    assert report.outcome == ("failed" if second_crash else "rerun")
