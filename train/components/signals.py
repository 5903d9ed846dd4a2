"""SIGTERM / SIGINT as a request to stop: in the training loop the run finishes its step, saves a checkpoint and exits
128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM, the shell's convention), so a ``train.run &&
export.onnx`` line stops there instead of exporting a half-trained model (a second signal does not wait for
the step: :class:`StopRequest`); anywhere else (data preparation, preflight, the final evaluation)
:func:`interrupts` turns the signal into :class:`Interrupted`, and the command exits with the same code, its
newest checkpoint kept."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator


class Interrupted(BaseException):
    """SIGTERM or SIGINT outside the training loop (``signum``): raised in the main thread where it was, so the
    command stops at once and exits 128 + ``signum``. A BaseException, so ``except Exception`` (a preflight check's
    own failure) does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """For the ``with`` block, SIGTERM and SIGINT raise :class:`Interrupted` (Python's default turns SIGINT into a
    KeyboardInterrupt traceback and SIGTERM into a silent death); :meth:`StopRequest.installed` takes them over
    inside the loop. Outside the main thread nothing is installed."""
    def handler(signum, _frame):
        raise Interrupted(signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


class StopRequest:
    """``requested`` turns true when SIGTERM or SIGINT arrives while :meth:`installed` is active (the loop reads
    it between steps; under torchrun every rank agrees through the step's all-reduce: :meth:`agree`). A second
    signal does not wait for the step: it raises :class:`Interrupted` where the loop is, so a second Ctrl-C stops at
    once, without this step's checkpoint (the newest one stays; a checkpoint being written is discarded whole)."""

    def __init__(self, log: Callable[[str], None]):
        self.requested = False
        self.signalled = False  # this process received a signal (``requested`` may also come from another rank)
        self.signum: int | None = None
        self._log = log

    def _handler(self, signum, _frame) -> None:
        if self.signalled:
            raise Interrupted(signum)
        self.signalled = self.requested = True
        self.signum = signum
        self._log(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting "
                  f"(a second signal stops at once, without it)")

    def agree(self) -> None:
        """Another rank was asked to stop: this one stops too (and saves with it), as if sent SIGTERM."""
        if not self.requested:
            self.requested, self.signum = True, signal.SIGTERM

    @property
    def exit_code(self) -> int:
        """The process's exit code after the stop: 128 + the signal's number (0 when no stop was requested)."""
        return 128 + int(self.signum) if self.requested and self.signum is not None else 0

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
