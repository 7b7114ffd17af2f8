"""Where a test's time goes: a pytest plugin that splits each test's wall time into JAX tracing, lowering to
MLIR, getting executables (XLA compiles and persistent-cache reads) and the rest (running programs, orbax, data,
child processes), per test, from JAX's own duration events (`jax.monitoring`).

    JAXLONG_TEST_TIMING=/tmp/timing python -m pytest [...]     # tests/conftest.py loads this plugin then
    python tests/timing.py /tmp/timing [10] [fast|slow]    # the tables: per file and the 10 slowest tests

Each pytest-xdist worker writes `<dir>/<worker>.csv`. Time spent in child processes (trainer runs, the
multi-process launches) counts as "rest" of the test that waits for them. `cpu s` is the CPU time (user and
system) of the worker's threads and of the child processes it waited for during the test: on a machine where
the workers keep every core busy, the tier's time falls only with it. Measured tables: docs/testing.md.
"""

from __future__ import annotations

import csv
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
FIELDS = ("test", "wall_s", "trace_s", "lower_s", "compile_s", "compiles", "cache_hits", "tier", "cpu_s")
NUMBERS = (*FIELDS[1:-2], "cpu_s")
_now: dict = defaultdict(float)


def _listen(event: str, duration: float, **_) -> None:
    if event in EVENTS:
        _now[EVENTS[event]] += duration
        if event == "/jax/core/compile/backend_compile_duration":
            _now["compiles"] += 1
    elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
        _now["cache_hits"] += 1


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process's threads and its waited-for children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config):
    out = os.environ.get("JAXLONG_TEST_TIMING")
    if not out:
        return
    import jax  # noqa: PLC0415 (after conftest has set XLA_FLAGS)

    jax.monitoring.register_event_duration_secs_listener(_listen)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(out).mkdir(parents=True, exist_ok=True)
    config._timing_file = open(Path(out) / f"{worker}.csv", "a", newline="")  # noqa: SIM115
    config._timing = csv.writer(config._timing_file)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    writer = getattr(item.config, "_timing", None)
    _now.clear()
    start, cpu = time.perf_counter(), _cpu_s()
    yield
    if writer is not None:
        writer.writerow([item.nodeid, round(time.perf_counter() - start, 3),
                         *(round(_now[k], 3) for k in ("trace_s", "lower_s", "compile_s")),
                         int(_now["compiles"]), int(_now["cache_hits"]),
                         "slow" if item.get_closest_marker("slow") else "fast", round(_cpu_s() - cpu, 3)])
        item.config._timing_file.flush()


def table(directory: str, top: int = 10, tier: str | None = None) -> str:
    """Markdown tables of the CSVs in `directory` (of one `tier`, "fast" or "slow", if given): seconds per file
    (wall, and its tracing, lowering, compiles) and the `top` slowest tests."""
    rows = []
    for f in Path(directory).glob("*.csv"):
        rows += [dict(zip(FIELDS, r)) for r in csv.reader(open(f))]
    rows = [r for r in rows if tier is None or r.get("tier") == tier]
    for r in rows:
        for k in NUMBERS:
            r[k] = float(r.get(k) or 0)  # files written before `cpu_s` have none
    per = defaultdict(lambda: defaultdict(float))
    for r in rows:
        p = per[r["test"].split("::")[0]]
        for k in NUMBERS:
            p[k] += r[k]
        p["tests"] += 1
    total = {k: sum(r[k] for r in rows) for k in NUMBERS}
    out = [f"{len(rows)} tests, {total['wall_s']:.0f} s of worker time: tracing {total['trace_s']:.0f} s, lowering "
           f"{total['lower_s']:.0f} s, getting executables (compiles and cache reads) {total['compile_s']:.0f} s "
           f"({total['compiles']:.0f}, {total['cache_hits']:.0f} from the cache), the rest "
           f"{total['wall_s'] - total['trace_s'] - total['lower_s'] - total['compile_s']:.0f} s; CPU "
           f"{total['cpu_s']:.0f} s", "", "| file | tests | wall s | trace s | lower s | compile s | rest s | cpu s |",
           "|---|---|---|---|---|---|---|---|"]
    for name, p in sorted(per.items(), key=lambda kv: -kv[1]["wall_s"]):
        rest = p["wall_s"] - p["trace_s"] - p["lower_s"] - p["compile_s"]
        out.append(f"| {name} | {p['tests']:.0f} | {p['wall_s']:.0f} | {p['trace_s']:.0f} | {p['lower_s']:.0f} | "
                   f"{p['compile_s']:.0f} | {rest:.0f} | {p['cpu_s']:.0f} |")
    out += ["", "| test | wall s | trace s | lower s | compile s | rest s | cpu s |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["wall_s"])[:top]:
        rest = r["wall_s"] - r["trace_s"] - r["lower_s"] - r["compile_s"]
        out.append(f"| `{r['test']}` | {r['wall_s']:.0f} | {r['trace_s']:.0f} | {r['lower_s']:.0f} | "
                   f"{r['compile_s']:.0f} | {rest:.0f} | {r['cpu_s']:.0f} |")
    return "\n".join(out)


if __name__ == "__main__":  # python tests/timing.py DIR [TOP] [fast|slow]
    print(table(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10, sys.argv[3] if len(sys.argv) > 3 else None))
