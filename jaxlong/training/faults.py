"""Fault injection, for testing that a kill anywhere in a step loses no checkpoint and no data.

`JAXLONG_FAULT="<point>@<step>:<SIGNAL>[,...]"`, e.g. `after_step@4:SIGTERM`, makes the trainer send SIGNAL to its
own process when it reaches the named point of the loop while computing `step` (1-based), once per entry. The loop
calls its one fault callback (`FaultInjector`, the default of `jaxlong.training.loop.run`) at each of
`FAULT_POINTS`; tests/training/test_faults.py kills the trainer at each of them.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_ENV", "FAULT_POINTS", "FaultInjector"]

FAULT_ENV = "JAXLONG_FAULT"
FAULT_POINTS = ("after_compile", "after_state", "before_batch", "before_put", "before_dispatch", "after_step",
                "after_bind", "before_metrics", "during_metrics", "during_log", "before_save", "during_save",
                "end_of_step", "after_loop", "during_final_save", "after_commit")


class FaultInjector:
    """`fault(point, step)`: sends this process the signal `JAXLONG_FAULT` plans at `point` of `step`, once.

    Raises:
      ValueError: `JAXLONG_FAULT` names a point not in `FAULT_POINTS` (when constructed).
    """

    def __init__(self, spec: str | None = None):
        self.plan: list[tuple[str, int, int]] = []
        for entry in filter(None, (os.environ.get(FAULT_ENV, "") if spec is None else spec).split(",")):
            where, sig = entry.strip().rsplit(":", 1)
            point, step = where.split("@")
            if point not in FAULT_POINTS:
                raise ValueError(f"{FAULT_ENV}: unknown point {point!r}; points: {', '.join(FAULT_POINTS)}")
            self.plan.append((point, int(step), int(getattr(signal, sig))))

    def __call__(self, point: str, step: int) -> None:
        for entry in [e for e in self.plan if e[:2] == (point, step)]:
            self.plan.remove(entry)
            os.kill(os.getpid(), entry[2])
