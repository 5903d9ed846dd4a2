"""Generation slots: at most ``SHALIK_MAX_CONCURRENCY`` requests run, at most ``SHALIK_MAX_QUEUE`` wait for a slot,
and one more is refused at once (429 with Retry-After) instead of waiting into a timeout (504).

* :class:`Admission`: the slots and the bounded queue (created inside the running event loop; ``release`` from
  any thread), reported to the ``shalik_queue_depth`` / ``shalik_in_flight`` gauges;
* :func:`refuse_early` (429 before any work is spent), :func:`admit` (take a slot before the deadline) and
  :func:`in_slot_thread` (run blocking work in a thread that gives the slot back when it ends) — what a route
  calls. Running the admitted work is :mod:`serve.http.runs`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from serve.http.errors import HTTPError, timeout_error
from serve.http.metrics import Metrics


class Overloaded(Exception):
    """Every slot is busy and the queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int = 1):
        super().__init__(f"the server is at capacity (all generation slots busy and the queue full); "
                         f"retry after {retry_after} s")
        self.retry_after = retry_after


class Admission:
    """A semaphore of ``max_concurrency`` slots with at most ``max_queue`` waiters. Create it inside the
    running event loop. ``release`` may be called from any thread."""

    def __init__(self, max_concurrency: int, max_queue: int, metrics: Metrics | None = None):
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting = 0
        self.running = 0
        self._sem = asyncio.Semaphore(max_concurrency)
        self._loop = asyncio.get_running_loop()

    def check(self) -> None:
        """Raise Overloaded now if a request arriving now would find every slot busy and the queue full
        (lets a request be refused before any work is spent on it)."""
        if self._sem.locked() and self.waiting >= self.max_queue:
            raise Overloaded()

    async def acquire(self, timeout: float) -> None:
        """Take a slot, waiting at most ``timeout`` seconds. Raises Overloaded when the queue is full and
        TimeoutError when the wait runs out."""
        self.check()
        self.waiting += 1
        self._gauges()
        try:
            await asyncio.wait_for(self._sem.acquire(), timeout=max(timeout, 0.0))
        finally:
            self.waiting -= 1
            self._gauges()
        self.running += 1
        self._gauges()

    def release(self) -> None:
        """Give a slot back (thread-safe)."""
        def _release() -> None:
            self.running -= 1
            self._sem.release()
            self._gauges()

        try:
            self._loop.call_soon_threadsafe(_release)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.waiting)
            self.metrics.in_flight.set(self.running)


def overloaded(e: Overloaded) -> HTTPError:
    """429 with Retry-After."""
    return HTTPError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)})


def refuse_early(slots: Admission) -> None:
    """429 before any work (tokenizing, validating ids) when the server is already full."""
    try:
        slots.check()
    except Overloaded as e:
        raise overloaded(e) from None


async def admit(slots: Admission, deadline: float, timeout_s: float) -> None:
    """Take a generation slot: 429 when slots and queue are full, 504 (naming the request timeout ``timeout_s``)
    when the wait outlasts the deadline (``time.perf_counter()`` seconds)."""
    try:
        await slots.acquire(deadline - time.perf_counter())
    except Overloaded as e:
        raise overloaded(e) from None
    except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
        raise timeout_error(timeout_s) from None


def in_slot_thread(slots: Admission, fn: Callable, *args) -> asyncio.Future:
    """Run ``fn(*args)`` in a worker thread that holds the caller's generation slot and gives it back when
    ``fn`` returns — even if the caller stopped waiting (timeout, disconnect)."""
    def work():
        try:
            return fn(*args)
        finally:
            slots.release()

    try:
        return asyncio.get_running_loop().run_in_executor(None, work)
    except BaseException:
        slots.release()
        raise
