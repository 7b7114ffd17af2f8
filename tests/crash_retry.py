"""pytest-xdist's `--dist loadfile` scheduler, made to survive a worker that dies.

A worker process can die inside native code (XLA's CPU runtime has aborted a worker of this suite once, in an eager
op of a test that passes on every other run). pytest-xdist 3.8's `LoadFileScheduling` then hangs until CI's time
limit: it puts every file the dead worker had *completed* back on the queue as an empty work unit, which no worker
ever reports done (pytest-xdist issues #1323, #1327, #1378), and a replacement worker given one last test waits
forever for a next one. `CrashTolerantLoadFileScheduling` fixes both and retries a crashed test once:

- Only the dead worker's unfinished files go back on the queue, at its front, without the tests it finished.
- The test it died in runs once more (on the replacement worker, or on another one that is short of work); the
  crash is reported as a `rerun` (with the "worker ... crashed while running ..." line). A second crash of the
  same test is reported as a failure, so a test that always crashes still fails the run; so is a crash that uses
  up pytest-xdist's worker restarts (`--max-worker-restart`), after which nothing reruns.
- A worker is given files until it holds more than two tests, and is told to shut down once the queue is empty,
  so it never waits for a next test that will not come; a replacement worker gets work only once it has
  collected.

Used by `tests/conftest.py` through the `pytest_xdist_make_scheduler` hook; tested in `tests/test_crash_retry.py`.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
from xdist.scheduler import LoadFileScheduling


class CrashTolerantLoadFileScheduling(LoadFileScheduling):
    """`LoadFileScheduling` (whole test files per worker, in collection order) that recovers from a dead worker
    as the module docstring says."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.retried: set[str] = set()  # node ids of the tests that crashed once and were put back
        self.requeued_crash: str | None = None  # the test of the last crash, when it was put back for a rerun

    def remove_node(self, node):
        """Drop `node`; when it died with tests pending, requeue its unfinished files and return the test it died
        in (pytest-xdist reports it through `pytest_handlecrashitem`)."""
        workload = self.assigned_work.pop(node)
        unfinished = OrderedDict((scope, unit) for scope, unit in workload.items() if not all(unit.values()))
        if not unfinished:
            return None
        crashitem = next(nodeid for unit in unfinished.values() for nodeid, done in unit.items() if not done)
        if crashitem in self.retried:  # the second crash of this test: it is reported failed and not run again
            scope = self._split_scope(crashitem)
            unfinished[scope][crashitem] = True
            if all(unfinished[scope].values()):
                del unfinished[scope]
            self.requeued_crash = None
        else:
            self.retried.add(crashitem)
            self.requeued_crash = crashitem
        # The unfinished files run next, ahead of the files no worker has started.
        for scope in reversed(unfinished):
            self.workqueue[scope] = unfinished[scope]
            self.workqueue.move_to_end(scope, last=False)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node):
        """Give `node` files while it has at most two tests left (a worker runs a test only once it knows the
        next one, or is told to shut down); shut it down (it runs what it has, then exits) once no file is left.
        A replacement worker still collecting is left alone: `schedule()` reaches it when its collection is in."""
        if node.shutting_down or node not in self.registered_collections:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` uses `CrashTolerantLoadFileScheduling`; other modes keep pytest-xdist's own."""
    if config.getvalue("dist") == "loadfile":
        return CrashTolerantLoadFileScheduling(config, log)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A test whose first crash put it back on the queue is reported as `rerun`, not failed, unless this crash
    uses up pytest-xdist's worker restarts (`--max-worker-restart`): then no worker is left to rerun it, the run
    stops, and the crash is a failure."""
    if isinstance(sched, CrashTolerantLoadFileScheduling) and crashitem == sched.requeued_crash:
        dsession = sched.config.pluginmanager.getplugin("dsession")
        limit = dsession._max_worker_restart  # None: no limit
        if limit is None or dsession._failed_nodes_count + 1 <= limit:
            report.outcome = "rerun"
            return True
    return None


def pytest_report_teststatus(report):
    """Terminal status of a `rerun` report: "R", and "1 rerun" in the summary line."""
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    """A section naming each test that crashed its worker and was run again (a `rerun`)."""
    reruns = terminalreporter.stats.get("rerun", [])
    if reruns:
        terminalreporter.section("crashed workers", sep="=", yellow=True)
        for report in reruns:
            terminalreporter.line(f"{report.longrepr}; run again")
