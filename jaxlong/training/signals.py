"""SIGTERM and SIGINT while training: a signal stops the run between steps, after the last finished step is saved
(docs/reliability.md)."""

from __future__ import annotations

import signal
import threading

from tqdm import tqdm

__all__ = ["Preempted", "Signals"]


class Preempted(KeyboardInterrupt):
    """The run stopped on SIGTERM or SIGINT (`signum`) after saving its last finished step."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Signals:
    """SIGTERM/SIGINT while training: before the train state exists a signal stops the run at once (nothing is
    lost); once the loop runs (`deferred`), the handler only records the signal, and the loop stops between
    steps, when the state of the last finished step is bound, and saves it. Installed only in the main thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.deferred = False
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if not self.deferred:
            raise Preempted(signum)
        if self.received is None:
            tqdm.write(f"received {signal.Signals(signum).name}: stopping after the current step, then saving it")
        self.received = self.received or signum  # the first signal names the stop
