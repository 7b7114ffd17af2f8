"""pytest-xdist's `--dist loadfile` scheduler, made to survive a worker that dies.

A worker process can die inside native code (XLA's CPU runtime has aborted a worker of this suite once, in an eager
op of a test that passes on every other run). pytest-xdist 3.8's `LoadFileScheduling` then hangs until CI's time
limit: it puts every file the dead worker had *completed* back on the queue as an empty work unit, which no worker
ever reports done (pytest-xdist issues #1323, #1327, #1378), and a replacement worker given one last test waits
forever for a next one. `CrashTolerantLoadFileScheduling` fixes both and retries a crashed test once:

- Only the dead worker's unfinished files go back on the queue, at its front, without the tests it finished.
- The test it died in runs once more on the replacement worker; the crash is reported as a `rerun` (with the
  "worker ... crashed while running ..." line). A second crash of the same test is reported as a failure, so a
  test that always crashes still fails the run.
- A worker is told to shut down once the queue is empty, so it runs its last test instead of waiting for a next.

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
        else:
            self.retried.add(crashitem)
        # The unfinished files run next, ahead of the files no worker has started.
        for scope in reversed(unfinished):
            self.workqueue[scope] = unfinished[scope]
            self.workqueue.move_to_end(scope, last=False)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node):
        """Give `node` the next file when it has at most two tests left; shut it down (it runs what it has, then
        exits) once no file is left to give."""
        if node.shutting_down:
            return
        if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
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
    """A test whose first crash put it back on the queue is reported as `rerun`, not failed."""
    if isinstance(sched, CrashTolerantLoadFileScheduling):
        unit = sched.workqueue.get(sched._split_scope(crashitem), {})
        if unit.get(crashitem) is False:
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
            terminalreporter.line(f"{report.longrepr}; run again on a new worker")
