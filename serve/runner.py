"""Running generations off the event loop, with bounded concurrency and a bounded queue.

* :class:`Admission`: at most ``max_concurrency`` generations run; at most ``max_queue`` requests wait for a
  slot; one more is refused at once (:class:`Overloaded`, HTTP 429) instead of waiting into a timeout.
* :class:`ThreadedRun`: one request's generations, all queued in the LM's engine at once (so its prompts and
  choices are stepped together with every other request's; :mod:`serve.engine`), read in a thread of its own;
  chunks come back to the event loop through an ``asyncio.Queue``. ``cancel()`` (client gone, timeout) takes
  them out of the engine before its next step; the slot is released when the thread ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from serve.lm import Chunk, Generation
from serve.metrics import Metrics


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


@dataclass
class Event:
    """What a run reports: ``kind`` "chunk" (``chunk`` set), "done" (choice ``index`` finished) or "error"."""

    kind: str
    index: int = 0
    chunk: Chunk | None = None
    error: BaseException | None = None


class ThreadedRun:
    """Iterate ``generations`` in a new thread; ``events()`` yields :class:`Event` s on the event loop.

    ``on_end`` runs (in the worker thread) when the thread finishes, whatever happened — release the slot
    there. ``metrics`` (optional) gets completion tokens counted as they are made, and each finished
    generation's time to first token (from ``arrived_at``, a ``time.perf_counter()`` stamp) and decode speed.
    """

    def __init__(self, generations: Sequence[Generation], on_end: Callable[[], None],
                 metrics: Metrics | None = None, arrived_at: float | None = None):
        self.generations = list(generations)
        self.arrived_at = time.perf_counter() if arrived_at is None else arrived_at
        self._on_end = on_end
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._work, name="shalik-generation", daemon=True)

    def start(self) -> ThreadedRun:
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop every generation of this run before its next model step (thread-safe, idempotent)."""
        self._cancelled.set()
        for g in self.generations:
            g.cancel()

    def _post(self, ev: Event | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)
        except RuntimeError:  # loop closed: nobody is listening any more
            self.cancel()

    def _work(self) -> None:
        try:
            for gen in self.generations:  # queue them all in the engine first: they run in the same steps
                gen.submit()
            for i, gen in enumerate(self.generations):
                if self._cancelled.is_set():
                    break
                counted = 0
                for chunk in gen:
                    counted = self._count(gen, counted)
                    self._post(Event("chunk", i, chunk=chunk))
                self._count(gen, counted)
                if self._metrics is not None:
                    self._metrics.observe_generation(self.arrived_at, gen.first_token_at, gen.finished_at,
                                                     gen.tokens_generated)
                self._post(Event("done", i))
        except Exception as e:  # reported to the client by the event loop side
            self._post(Event("error", error=e))
        finally:
            self._on_end()
            self._post(None)

    def _count(self, gen: Generation, counted: int) -> int:
        if self._metrics is not None and gen.tokens_generated > counted:
            self._metrics.completion_tokens.inc(gen.tokens_generated - counted)
        return gen.tokens_generated

    async def events(self) -> AsyncIterator[Event]:
        """The run's events in order, ending when the thread ends. An "error" event is raised instead."""
        while True:
            ev = await self._queue.get()
            if ev is None:
                return
            if ev.kind == "error":
                raise ev.error  # type: ignore[misc]
            yield ev
