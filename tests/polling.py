"""Waiting for state another thread settles: the engines publish their counters (running, waiting) once per pass of
the scheduler, after the events of that pass are sent, so a caller that has just read a final event may still see
its sequence counted until the next pass."""

from __future__ import annotations

import time


def wait_until(pred, limit_s: float = 60.0) -> bool:
    """Poll ``pred`` until it holds (True) or ``limit_s`` passes (False). The limit is for a broken engine only, not a
    pace a loaded machine must keep (issue 29)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()
