"""The errors that stop a training run, each carrying the exit code of ``python -m train.run`` and
``python -m train.preflight``: 2 for a run that cannot start (bad input, a refused resume), 1 for a run that
started and failed (preflight, a non-finite streak)."""

from __future__ import annotations


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""

    exit_code = 2


class NonFiniteStop(TrainError):
    """Too many non-finite steps in a row."""

    exit_code = 1
