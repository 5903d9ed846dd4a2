"""Running a request's work off the event loop within its limits: a generation slot (429 when the server is
full), the request deadline (504), the client going away (499, or the stream simply ends), and the run's
events turned into a response body or into server-sent events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from serve.http.errors import HTTPError, error_body, stream_error
from serve.http.lifecycle import ServerState
from serve.http.translate import (
    choice_dict,
    completion_body,
    echo_part,
    end_of_text_lists,
    logprob_lists,
    prompt_usage,
    sse,
    usage_dict,
)
from serve.lm import LM, Chunk, Generation
from serve.runner import Overloaded, ThreadedRun
from serve.schemas import CompletionRequest

log = logging.getLogger("shalik.serve")
DISCONNECT_POLL_S = 0.05


def overloaded(e: Overloaded) -> HTTPError:
    """429 with Retry-After."""
    return HTTPError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)})


def timeout_error(request_timeout_s: float) -> HTTPError:
    """504 naming the setting."""
    return HTTPError(504, f"the request took longer than {request_timeout_s:g} s (SHALIK_REQUEST_TIMEOUT_S)",
                     code="timeout")


def refuse_early(state: ServerState) -> None:
    """429 before any work (tokenizing, validating ids) when the server is already full."""
    try:
        state.admission.check()
    except Overloaded as e:
        raise overloaded(e) from None


async def admit(state: ServerState, deadline: float) -> None:
    """Take a generation slot: 429 when slots and queue are full, 504 when the wait outlasts the deadline."""
    try:
        await state.admission.acquire(deadline - time.perf_counter())
    except Overloaded as e:
        raise overloaded(e) from None
    except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
        raise timeout_error(state.settings.request_timeout_s) from None


def in_slot_thread(state: ServerState, fn: Callable, *args) -> asyncio.Future:
    """Run ``fn(*args)`` in a worker thread that holds the caller's generation slot and gives it back when
    ``fn`` returns — even if the caller stopped waiting (timeout, disconnect)."""
    def work():
        try:
            return fn(*args)
        finally:
            state.admission.release()

    try:
        return asyncio.get_running_loop().run_in_executor(None, work)
    except BaseException:
        state.admission.release()
        raise


async def wait(task: asyncio.Future, request: Request, deadline: float, on_abandon: Callable[[], None]) -> Any:
    """Await ``task`` until ``deadline``; call ``on_abandon`` and raise 504 on timeout, or 499 when the
    client disconnects first."""
    try:
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                on_abandon()
                raise timeout_error(request.app.state.shalik.settings.request_timeout_s)
            done, _ = await asyncio.wait({task}, timeout=min(DISCONNECT_POLL_S, remaining))
            if task in done:
                return task.result()
            if await request.is_disconnected():
                on_abandon()
                raise HTTPError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


async def complete(lm: LM, req: CompletionRequest, gens: list[Generation], run: ThreadedRun, meta: dict,
                   request: Request, deadline: float) -> dict:
    """Collect a whole run into OpenAI's response body."""
    chunks: dict[int, list[Chunk]] = defaultdict(list)

    async def consume() -> None:
        async for ev in run.events():
            if ev.kind == "chunk":
                chunks[ev.index].append(ev.chunk)

    try:
        await wait(asyncio.ensure_future(consume()), request, deadline, on_abandon=run.cancel)
    finally:
        run.cancel()
    return completion_body(lm, req, gens, chunks, meta)


async def stream(lm: LM, req: CompletionRequest, gens: list[Generation], run: ThreadedRun, meta: dict,
                 deadline: float, request_timeout_s: float) -> AsyncIterator[bytes]:
    """Server-sent events of a run: ``data: <chunk json>`` per piece, a final chunk per choice with its
    finish_reason, the usage chunk when asked, then ``data: [DONE]``. Cancels the run when the client
    goes away (this generator is then cancelled) or the deadline passes."""
    with_lp = req.logprobs is not None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage_field = {"usage": None} if include_usage else {}
    offsets: dict[int, int] = {}  # choice → length of its echoed prompt text
    released: dict[int, int] = defaultdict(int)  # choice → characters of completion text sent

    def event(index: int, text: str, lists: dict | None, finish: str | None = None) -> bytes:
        return sse({**meta, "choices": [choice_dict(index, text, lists, finish)], **usage_field})

    events = run.events()
    try:
        while True:
            remaining = deadline - time.perf_counter()
            try:
                ev = await asyncio.wait_for(anext(events), timeout=max(remaining, 0.0))
            except StopAsyncIteration:
                break
            i, gen = ev.index, gens[ev.index]
            if i not in offsets:
                offsets[i] = 0
                if req.echo:
                    text, lists = echo_part(lm, gen, with_lp)
                    offsets[i] = len(text)
                    yield event(i, text, lists)
            if ev.kind == "chunk":  # chunk offsets count from the start of the completion text
                released[i] += len(ev.chunk.text)
                yield event(i, ev.chunk.text, logprob_lists(lm, ev.chunk, offsets[i]) if with_lp else None)
            else:
                end = end_of_text_lists(gen, offsets[i] + released[i]) if with_lp else None
                yield event(i, "", end, gen.finish_reason)
        if include_usage:
            completion = sum(g.completion_tokens for g in gens)
            yield sse({**meta, "choices": [], "usage": usage_dict(prompt_usage(gens, req.n), completion)})
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
