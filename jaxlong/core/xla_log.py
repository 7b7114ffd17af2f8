"""XLA's own log lines around a compile: captured, and those that do not mean failure summarized.

XLA's C++ logging writes straight to file descriptor 2. While compiling a step far over its memory budget (the
planner's lower ladder rungs) its rematerialization pass warns that it cannot reduce memory to its own estimate of
the device's free memory; the SPMD partitioner warns when it replicates an array to reshard it. Neither is a
failure: the plan reports what was compiled. `collecting()` captures fd 2 around the compiles of `compile_logged`
inside it; afterwards `XlaLog.summary()` gives one line per kind of known message (with a count), and every line
it does not know is written back to stderr unchanged, so real problems still show.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field


def _gib(n: str) -> str:
    return f"{int(n) / 2**30:.1f} GiB"


# kind -> (pattern, what it means: a function of the count and the last match's groups). A line matching a pattern
# is summarized, not shown.
KNOWN = {
    "remat": (re.compile(r"Can't reduce memory use below (?P<below>\S+) .*only reduced to (?P<to>\S+) "
                         r".*down from (?P<orig>\S+) (?:\(\d+ bytes\) )?originally"),
              lambda n, g: f"XLA's rematerialization could not bring {n} compiled step(s) under its own estimate of "
                           f"free device memory ({g['below']}; the last went from {g['orig']} to {g['to']}): the plan "
                           f"shows what was compiled and whether it fits"),
    "schedule": (re.compile(r"byte size of input/output arguments \((?P<args>\d+)\) exceeds the base limit "
                            r"\((?P<limit>\d+)\)"),
                 lambda n, g: f"XLA's GPU scheduler found {n} step(s) whose arguments alone exceed its memory limit "
                              f"(the last: {_gib(g['args'])} against {_gib(g['limit'])}; XLA calls this \"an error in "
                              f"the calculation\"): such a step does not fit, as the plan says"),
    "spmd": (re.compile(r"Involuntary full rematerialization"),
             lambda n, g: f"XLA's SPMD partitioner replicated {n} array(s) to reshard them (\"involuntary full "
                          f"rematerialization\"): slower, not wrong"),
}


@dataclass
class XlaLog:
    """Known XLA messages seen by `capture` (per kind, the regex groups of each) and the lines written back."""

    seen: dict[str, list[dict]] = field(default_factory=dict)

    @contextlib.contextmanager
    def capture(self):
        """Redirect fd 2 into a temporary file for the block; then sort its lines into known messages (kept) and
        the rest (written back to stderr)."""
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield self
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                self.add(tmp.read().decode(errors="replace"))

    def add(self, text: str) -> None:
        """Sort the lines of `text`: known messages are kept, the others written to stderr."""
        other = []
        for line in text.splitlines():
            for kind, (pattern, _) in KNOWN.items():
                m = pattern.search(line)
                if m:
                    self.seen.setdefault(kind, []).append(m.groupdict())
                    break
            else:
                other.append(line)
        if other:
            print("\n".join(other), file=sys.stderr, flush=True)

    def summary(self) -> list[str]:
        """One line per kind of known message seen, e.g. `note: XLA's rematerialization could not bring 3 ...`."""
        return ["note: " + KNOWN[kind][1](len(hits), hits[-1]) for kind, hits in self.seen.items()]


_ACTIVE: list[XlaLog] = []


@contextlib.contextmanager
def collecting():
    """Collect the XLA messages of every `compile_logged` call inside the block into the yielded `XlaLog`."""
    log = XlaLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.pop()


def compile_logged(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` (a compile), with XLA's log captured into the innermost `collecting()` block if any;
    outside one, XLA logs as it always does."""
    if not _ACTIVE:
        return fn(*args, **kwargs)
    with _ACTIVE[-1].capture():
        return fn(*args, **kwargs)
