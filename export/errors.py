"""The export's error types and their exit codes (2: bad input, 1: the bundle does not compute what the
checkpoint computes, or could not be built)."""

from __future__ import annotations


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
