"""Running an admitted request: its generations in a worker thread, their chunks back on the event loop, collected
into one response body or streamed as server-sent events — within the request's deadline (504) and while the
client stays (a disconnect cancels the generations before their next step: 499, or the stream simply ends).

* :class:`ThreadedRun`: one request's generations, all queued in the LM's engine at once (so its prompts and
  choices are stepped together with every other request's; :mod:`serve.engine`), read in a thread of its own;
  chunks come back to the event loop through an ``asyncio.Queue``. ``cancel()`` (client gone, timeout) takes
  them out of the engine before its next step; the slot (:mod:`serve.http.admission`) is released when the
  thread ends.
* :func:`wait`, :func:`complete`, :func:`stream`: awaiting a run against the deadline and the client; what the
  bodies and events say is the endpoint's :class:`serve.http.translate.ResponseFormat` (completions or chat).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from serve.generation import Generation
from serve.http.errors import HTTPError, error_body, stream_error, timeout_error
from serve.http.metrics import Metrics
from serve.http.translate import ResponseFormat, sse
from serve.results import Chunk

log = logging.getLogger("shalik.serve")
DISCONNECT_POLL_S = 0.05


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


async def wait(task: asyncio.Future, request: Request, deadline: float, on_abandon: Callable[[], None]) -> Any:
    """Await ``task`` until ``deadline``: raise 504 on timeout, or 499 when the client disconnects first. Whenever
    it stops waiting before ``task`` is done (those two, or this coroutine cancelled), ``on_abandon()`` tells the
    work to stop (a worker thread cannot be cancelled from here) and ``task`` is cancelled."""
    try:
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise timeout_error(request.app.state.shalik.settings.request_timeout_s)
            done, _ = await asyncio.wait({task}, timeout=min(DISCONNECT_POLL_S, remaining))
            if task in done:
                return task.result()
            if await request.is_disconnected():
                raise HTTPError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            on_abandon()
            task.cancel()


async def complete(fmt: ResponseFormat, run: ThreadedRun, request: Request, deadline: float) -> dict:
    """Collect a whole run into the response body ``fmt`` builds."""
    chunks: dict[int, list[Chunk]] = defaultdict(list)

    async def consume() -> None:
        async for ev in run.events():
            if ev.kind == "chunk":
                chunks[ev.index].append(ev.chunk)

    try:
        await wait(asyncio.ensure_future(consume()), request, deadline, on_abandon=run.cancel)
    finally:
        run.cancel()
    return fmt.body(chunks)


async def stream(fmt: ResponseFormat, run: ThreadedRun, deadline: float, request_timeout_s: float
                 ) -> AsyncIterator[bytes]:
    """Server-sent events of a run: per choice ``fmt``'s opening events, one per piece and its final one with the
    finish_reason, then the usage chunk when asked, then ``data: [DONE]``. Cancels the run when the client
    goes away (this generator is then cancelled) or the deadline passes."""
    started: set[int] = set()
    events = run.events()
    try:
        while True:
            remaining = deadline - time.perf_counter()
            try:
                ev = await asyncio.wait_for(anext(events), timeout=max(remaining, 0.0))
            except StopAsyncIteration:
                break
            i = ev.index
            if i not in started:
                started.add(i)
                for data in fmt.opening(i):
                    yield sse(data)
            yield sse(fmt.piece(i, ev.chunk) if ev.kind == "chunk" else fmt.closing(i))
        usage = fmt.usage_chunk()
        if usage is not None:
            yield sse(usage)
        yield sse("[DONE]")
    except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
        yield sse(error_body(504, timeout_error(request_timeout_s).message, code="timeout"))
        yield sse("[DONE]")
    except Exception as e:  # the status line is sent already, so report it in the stream
        body = stream_error(e)
        if body["error"]["code"] == "internal_error":
            log.exception("generation failed mid-stream")
        yield sse(body)
        yield sse("[DONE]")
    finally:
        run.cancel()
