"""The export's error types and their exit codes (2: bad input, 1: the bundle does not compute what the
checkpoint computes, or could not be built)."""

from __future__ import annotations

import sys
from collections.abc import Callable


class ExportError(Exception):
    """An export that cannot start or finish; the message names the bad input. ``exit_code`` is 2 unless
    given (1 for a model that no exporter could turn into a graph)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class ParityError(ExportError):
    """The parity gate failed (exit code 1); ``cases`` holds the table rows (dicts), ``table`` their text."""

    def __init__(self, message: str, cases: list[dict], table: str):
        super().__init__(message, exit_code=1)
        self.cases = cases
        self.table = table


class QualityGateError(ParityError):
    """A quantized form fails its quality gate (exit code 1, :mod:`export.gate`): it was not written."""


def run_cli(action: Callable[[], object], nothing_written: str) -> int:
    """Run a command line's ``action`` and return its exit code: 0 done, the ExportError's code (its message on
    stderr as ``error: …``), or 130 on Ctrl-C with ``interrupted: <nothing_written>`` (e.g. "no bundle was written")."""
    try:
        action()
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"interrupted: {nothing_written}", file=sys.stderr)
        return 130
    return 0
