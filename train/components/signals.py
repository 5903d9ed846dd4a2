"""SIGTERM / SIGINT as a request to stop: the run finishes its step, saves a checkpoint and exits 0."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator


class StopRequest:
    """``requested`` turns true when SIGTERM or SIGINT arrives while :meth:`installed` is active (the loop reads
    it between steps; under torchrun every rank agrees through the step's all-reduce)."""

    def __init__(self, log: Callable[[str], None]):
        self.requested = False
        self._log = log

    def _handler(self, signum, _frame) -> None:
        self.requested = True
        self._log(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting")

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Install the handlers for the ``with`` block and restore the previous ones after it (outside the main
        thread, where Python refuses handlers, nothing is installed)."""
        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        try:
            yield self
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
