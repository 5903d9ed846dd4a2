"""Every generation goes through an engine: one scheduler that steps all running sequences together.

An engine takes requests (``<|endoftext|>`` + prompt ids, a token budget, sampling parameters, ``n`` choices,
an optional timeout) and gives back, per choice, a stream of :class:`TokenEvent` s. Python
(:mod:`serve.generation`) keeps detokenising and stop strings. Two engines implement it, and both follow
:mod:`serve.policy` (the defaults, the request phases and the pure planning step of each step: retire, plan,
run, sample, post):

* :class:`RustEngine` wraps ``rust_runtime.Engine``: continuous batching in Rust, outside the GIL, with
  batch-invariant kernels and sampling in Rust (the rust backend);
* :class:`StepEngine` runs the policy in a Python thread over any backend of :mod:`serve.backends.base` (the
  onnx backend, the scripted test model): the decodes of a step go in one ``backend.decode_batch`` call when the
  backend has one and says batching pays at that batch size (``backend.batch_pays(b)``), else one sequence after
  another; each prompt chunk is one ``seq.prefill`` call; each sequence samples with
  :class:`serve.sampling.Sampler` and its own generator (``make_rng(seed, first_index + choice)``).

Both prefill a prompt once for its ``n`` choices (forking the cache; ``n`` may not exceed ``max_batch``), and end
a choice at end-of-text (unless ``ignore_eos``: reported as a ``"stop"`` event carrying that token), after
``max_new_tokens``, when cancelled (``"cancelled"``) or past its timeout (``"timeout"``) — the last two before
the next step.
"""

from __future__ import annotations

import atexit
import math
import numbers
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from serve.backends.base import BackendError
from serve.policy import (
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_TOKEN_BUDGET,
    Entry,
    Phase,
    Plan,
    check_engine_limits,
    plan_step,
)
from serve.sampling import Sampler, SamplingParams, log_softmax, make_rng, top_logprobs


@dataclass(frozen=True)
class TokenEvent:
    """One event of one choice.

    A token: ``token`` set, ``finish`` None. The end of the choice: ``finish`` is ``"stop"`` (then ``token`` is
    the end-of-text it stopped at — not part of the output — with its log-prob), ``"length"``, ``"cancelled"``,
    ``"timeout"`` or ``"error"`` (``token`` None; ``error`` the exception to raise). ``logprob``: nats under the
    model's raw distribution; ``top``: the ``top_logprobs`` most likely (id, log-prob), largest first.
    """

    token: int | None
    logprob: float = math.nan
    top: list[tuple[int, float]] = field(default_factory=list)
    finish: str | None = None
    error: BaseException | None = None


class Submission:
    """A submitted request: ``events(i)`` iterates choice i's events (ending after its finishing event);
    ``cancel()`` ends every choice, ``cancel_choice(i)`` one (both thread-safe, idempotent)."""

    n: int

    def events(self, index: int) -> Iterator[TokenEvent]:  # pragma: no cover - interface
        raise NotImplementedError

    def cancel(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def cancel_choice(self, index: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def engine_stats_keys() -> tuple[str, ...]:
    """The keys of ``engine.stats()`` (both engines): steps, running / waiting (sequences), last_step_tokens,
    prefill_tokens, decode_tokens (totals), queue_wait_s (seconds from submission to first step, summed over
    requests), admitted (requests that took part in a step)."""
    return ("steps", "running", "waiting", "last_step_tokens", "prefill_tokens", "decode_tokens", "queue_wait_s",
            "admitted")


# ---------------------------------------------------------------- Rust


class _RustSubmission(Submission):
    """A ``rust_runtime.RequestStream`` split per choice: whichever consumer pulls distributes the events."""

    def __init__(self, stream: Any, n: int):
        self.n = n
        self._stream = stream
        self._lock = threading.Lock()
        self._buffers: list[deque[TokenEvent]] = [deque() for _ in range(n)]

    def _pull(self, index: int) -> TokenEvent:
        with self._lock:
            while not self._buffers[index]:
                try:
                    i, tok, lp, top, finish = next(self._stream)
                except StopIteration:  # every choice ended already: nothing more can come for this one
                    return TokenEvent(None, finish="cancelled")
                except RuntimeError as e:  # the engine stopped
                    self._buffers[index].append(TokenEvent(None, finish="error", error=BackendError(str(e))))
                    break
                if finish is not None and finish.startswith("error"):
                    ev = TokenEvent(None, finish="error", error=BackendError(f"the rust engine failed: {finish}"))
                else:
                    ev = TokenEvent(tok, float(lp), [(int(a), float(b)) for a, b in top], finish)
                self._buffers[i].append(ev)
            return self._buffers[index].popleft()

    def events(self, index: int) -> Iterator[TokenEvent]:
        while True:
            ev = self._pull(index)
            yield ev
            if ev.finish is not None:
                return

    def cancel(self) -> None:
        self._stream.cancel()

    def cancel_choice(self, index: int) -> None:
        if self.n == 1:
            self._stream.cancel()
        else:
            self._stream.cancel_choice(index)


class RustEngine:
    """:class:`Submission` s from a ``rust_runtime.Engine`` (the rust backend's own, ``backend.engine``).
    ``on_close(engine)``, when given, closes the engine instead of ``engine.close()`` (the backend forgets it)."""

    def __init__(self, engine: Any, on_close: Any = None):
        self._engine = engine
        self._on_close = on_close
        self.max_batch: int = engine.max_batch
        self.token_budget: int = engine.token_budget

    def submit(self, ids: Sequence[int], max_new_tokens: int, params: SamplingParams, n: int = 1,
               top_logprobs: int = 0, ignore_eos: bool = False, first_index: int = 0,
               timeout_s: float | None = None) -> Submission:
        """Queue ``ids`` (``<|endoftext|>`` + prompt, checked ids); see the module docstring. ``first_index``
        is the request's index of this group's choice 0 (its choices beyond the first batch): the engine seeds
        choice i of the group with ``choice_seed(seed, first_index + i)``, the rule every choice follows.
        ``timeout_s``: seconds from now after which the choices still running end with ``"timeout"`` (None:
        never). ``params`` crosses into Rust as its fields (rust_runtime's sampling keyword arguments have the
        same names and rules). Raises BackendError for what the engine refuses (a prompt that does not fit,
        n > max_batch, a timeout <= 0)."""
        try:
            stream = self._engine.submit(list(ids), max_new_tokens, n=n, top_logprobs=top_logprobs,
                                         ignore_eos=ignore_eos, first_index=first_index, timeout=timeout_s,
                                         **asdict(params))
        except ValueError as e:
            raise BackendError(str(e)) from e
        return _RustSubmission(stream, n)

    def stats(self) -> dict[str, float]:
        """Counters (:func:`engine_stats_keys`)."""
        return dict(self._engine.stats())

    def close(self) -> None:
        """Stop the scheduler (running requests end with "cancelled")."""
        if self._on_close is not None:
            self._on_close(self._engine)
        else:
            self._engine.close()


# ---------------------------------------------------------------- Python


class _Request(Submission):
    """One submitted request. ``phase`` (:class:`serve.policy.Phase`): WAITING in the queue, PREFILLING in the
    batch (``seq`` holds its prompt's cache, ``prefilled`` tokens of it so far), then DECODING once it forked into
    its ``choices``, FINISHED when none of them runs. ``open``: the choices not yet ended; ``cancelled``: the
    choices asked to end (written only by the scheduler thread, through ``command``, and read at its next
    retire)."""

    def __init__(self, command: Callable[[Callable[[], None]], None], ids: list[int], max_new_tokens: int,
                 params: SamplingParams, n: int, top_logprobs: int, ignore_eos: bool, first_index: int = 0,
                 timeout_s: float | None = None):
        self.n, self.first_index = n, first_index
        self._command = command
        self.ids, self.max_new_tokens, self.params = ids, max_new_tokens, params
        self.prompt_ids = ids[1:]  # the sampler's penalties see the prompt without the leading <|endoftext|>
        self.top_n, self.ignore_eos, self.timeout_s = top_logprobs, ignore_eos, timeout_s
        self.queues: list[queue.SimpleQueue[TokenEvent]] = [queue.SimpleQueue() for _ in range(n)]
        self.phase = Phase.WAITING
        self.open = set(range(n))
        self.cancelled: set[int] = set()
        self.choices: list[_Choice] = []
        self.seq: Any = None
        self.prefilled = 0
        self.arrival = 0  # its place in the scheduler's order of arrival (serve.policy.Entry.arrival)
        self.submitted = 0.0
        self.deadline = math.inf
        self.on_end: Callable[[], None] | None = None  # the scheduler's count of running sequences

    def entry(self) -> Entry:
        """The planner's view (:class:`serve.policy.Entry`): one slot per open choice, the prompt left."""
        return Entry(len(self.open), len(self.ids) - self.prefilled, self.arrival)

    def finish_choice(self, index: int, ev: TokenEvent) -> None:
        """Post choice ``index``'s finishing event; the request is FINISHED when no choice is open."""
        if index not in self.open:
            return
        self.open.discard(index)
        self.queues[index].put(ev)
        for c in self.choices:
            if c.index == index:
                c.phase = Phase.FINISHED
        if self.phase is not Phase.WAITING and self.on_end is not None:
            self.on_end()
        if not self.open:
            self.phase = Phase.FINISHED

    def end(self, reason: str, error: BaseException | None = None) -> None:
        """End every open choice with ``reason``."""
        for i in sorted(self.open):
            self.finish_choice(i, TokenEvent(None, finish=reason, error=error))

    def events(self, index: int) -> Iterator[TokenEvent]:
        while True:
            ev = self.queues[index].get()
            yield ev
            if ev.finish is not None:
                return

    def cancel(self) -> None:
        self._command(lambda: self.cancelled.update(range(self.n)))

    def cancel_choice(self, index: int) -> None:
        self._command(lambda: self.cancelled.add(index))


class _Choice:
    """One choice of a request after the shared prefill: a DECODING sequence of its own (``last``: the token it
    is fed next step) until it is FINISHED."""

    def __init__(self, req: _Request, index: int, seq: Any):
        self.req, self.index, self.seq = req, index, seq
        rng = None if req.params.greedy else make_rng(req.params.seed, req.first_index + index)
        self.sampler = Sampler(req.params, req.prompt_ids, rng)
        self.produced = 0
        self.last = 0
        self.phase = Phase.DECODING

    def entry(self) -> Entry:
        return Entry(1, 0)


class _Scheduler:
    """The state of a :class:`StepEngine` and its steps, owned by one thread (a test may drive it directly):
    ``add(request, now)``, then ``tick(now)`` per step (:mod:`serve.policy`'s retire, plan, run, sample, post).
    ``waiting``: the queue (WAITING requests, arrival order); ``batch``: PREFILLING requests and DECODING choices,
    in admission order."""

    def __init__(self, backend: Any, eot_id: int, max_batch: int, token_budget: int, prefill_chunk: int):
        self.backend, self.eot_id = backend, eot_id
        self.max_batch, self.token_budget, self.prefill_chunk = max_batch, token_budget, prefill_chunk
        self.waiting: deque[_Request] = deque()
        self.batch: list[_Request | _Choice] = []
        self.stats: dict[str, float] = dict.fromkeys(engine_stats_keys(), 0)
        self.stats["queue_wait_s"] = 0.0
        self.running = 0  # sequences of admitted requests not yet ended (live: read by other threads)
        self.arrivals = 0  # requests queued so far: the next one's Entry.arrival

    def _one_ended(self) -> None:
        self.running -= 1

    def busy(self) -> bool:
        """Whether a request waits or runs."""
        return bool(self.waiting or self.batch)

    def _batch_requests(self) -> set[_Request]:
        return {e if isinstance(e, _Request) else e.req for e in self.batch}

    def requests(self) -> set[_Request]:
        """Every request that waits or runs."""
        return {*self.waiting, *self._batch_requests()}

    def add(self, req: _Request, at: float) -> None:
        """Queue ``req``, submitted at time ``at`` (its timeout counts from there); ``max_new_tokens`` 0 ends it
        at once with "length"."""
        req.submitted = at
        req.arrival, self.arrivals = self.arrivals, self.arrivals + 1
        if req.timeout_s is not None:
            req.deadline = at + req.timeout_s
        req.on_end = self._one_ended
        if req.max_new_tokens == 0:
            req.end("length")
        else:
            self.waiting.append(req)

    def tick(self, now: float) -> dict[_Request, int] | None:
        """One step at time ``now``: retire, plan, run, sample, post. Returns the tokens each request fed the
        model (prompt chunk or one per decoding choice), or None when nothing ran."""
        self._retire(now)
        plan = plan_step([r.entry() for r in self.waiting], [e.entry() for e in self.batch], self.max_batch,
                         self.token_budget, self.prefill_chunk)
        for _ in range(plan.admit):
            r = self.waiting.popleft()
            r.phase = Phase.PREFILLING
            self.running += len(r.open)
            self.batch.append(r)
        if not self.batch:
            return None
        try:
            rows, scheduled, decoded = self._run(plan, now)
            self._sample(rows)
        except Exception as e:  # a backend failure ends the requests of the step, not the engine
            for r in self._batch_requests():
                r.end("error", e)
            self._post()
            return {}
        self._post()
        s, total = self.stats, sum(scheduled.values())
        s["steps"] += 1
        s["last_step_tokens"] = total
        s["decode_tokens"] += decoded
        s["prefill_tokens"] += total - decoded
        return scheduled

    def end_all(self, reason: str, error: BaseException | None = None) -> None:
        """End every waiting and running request (the engine closes or dies)."""
        for r in self.requests():
            r.end(reason, error)
        self.waiting.clear()
        self.batch = []

    # ---- the phases of a step

    def _retire(self, now: float) -> None:
        """Cancelled choices and requests past their deadline leave, waiting or running, before the plan."""
        for r in self.requests():
            for i in sorted(r.cancelled & r.open):
                r.finish_choice(i, TokenEvent(None, finish="cancelled"))
            if now >= r.deadline:
                r.end("timeout")
        self.waiting = deque(r for r in self.waiting if r.phase is not Phase.FINISHED)
        self.batch = [e for e in self.batch if e.phase is not Phase.FINISHED]

    def _run(self, plan: Plan, now: float) -> tuple[list[tuple[_Request | _Choice, np.ndarray]], dict[_Request, int],
                                                    int]:
        """Feed the planned tokens to the backend: one token to each decoding choice, then each prompt chunk.
        Returns (entry, logits row) for every entry with a row to sample from (a prompt's only once its last chunk
        ran), the tokens fed per request and the number of decodes. A failing prefill ends its own request."""
        rows: list[tuple[_Request | _Choice, np.ndarray]] = []
        scheduled: dict[_Request, int] = {}
        decoding = [self.batch[i] for i in plan.decode]
        for c, row in zip(decoding, self._decode(decoding)):
            rows.append((c, row))
            scheduled[c.req] = scheduled.get(c.req, 0) + 1
        for i, take in plan.prefill:
            r = self.batch[i]
            if r.prefilled == 0:  # its first step: the wait in the queue ends
                self.stats["queue_wait_s"] += now - r.submitted
                self.stats["admitted"] += 1
            try:
                if r.seq is None:
                    r.seq = self.backend.new_sequence()
                row = np.asarray(r.seq.prefill(r.ids[r.prefilled:r.prefilled + take]))
            except Exception as e:
                r.end("error", e)
                continue
            r.prefilled += take
            scheduled[r] = scheduled.get(r, 0) + take
            if r.prefilled == len(r.ids):
                rows.append((r, row))
        return rows, scheduled, len(decoding)

    def _decode(self, decoding: list[_Choice]) -> list[np.ndarray]:
        if not decoding:
            return []
        b = self.backend
        toks = [c.last for c in decoding]
        batched = getattr(b, "decode_batch", None)
        pays = getattr(b, "batch_pays", None)
        if batched is not None and len(decoding) > 1 and (pays is None or pays(len(decoding))):
            return list(np.asarray(batched([c.seq for c in decoding], toks)))
        return [np.asarray(c.seq.decode(t)) for c, t in zip(decoding, toks)]

    def _sample(self, rows: list[tuple[_Request | _Choice, np.ndarray]]) -> None:
        """Sample every row; a request whose prompt is in forks into its open choices first."""
        for entry, row in rows:
            if isinstance(entry, _Choice):
                self._sample_choice(entry, row)
                continue
            try:
                forks = self._fork(entry, row)
            except Exception as e:
                entry.end("error", e)
                continue
            entry.choices = [c for c, _ in forks]
            entry.phase = Phase.DECODING
            for c, crow in forks:
                self._sample_choice(c, crow)

    def _fork(self, r: _Request, row: np.ndarray) -> list[tuple[_Choice, np.ndarray]]:
        """The open choices of ``r`` after its prefill: the first takes the prefilled sequence, the others a
        ``seq.fork()`` of it where the backend has one (else a sequence prefilled again)."""
        indices = sorted(r.open)
        out = [(_Choice(r, indices[0], r.seq), row)]
        fork = getattr(r.seq, "fork", None)
        for i in indices[1:]:
            if fork is not None:
                out.append((_Choice(r, i, fork()), row))
            else:
                seq = self.backend.new_sequence()
                out.append((_Choice(r, i, seq), np.asarray(seq.prefill(r.ids))))
        return out

    def _sample_choice(self, c: _Choice, logits: np.ndarray) -> None:
        r = c.req
        try:
            tok = c.sampler(logits)
            lp = log_softmax(logits)
        except Exception as e:  # ModelOutputError (NaN logits) and the like end this choice
            r.finish_choice(c.index, TokenEvent(None, finish="error", error=e))
            return
        top = top_logprobs(lp, r.top_n) if r.top_n else []
        if tok == self.eot_id and not r.ignore_eos:
            r.finish_choice(c.index, TokenEvent(tok, float(lp[tok]), top, "stop"))
            return
        c.produced += 1
        r.queues[c.index].put(TokenEvent(tok, float(lp[tok]), top))
        if c.produced >= r.max_new_tokens:
            r.finish_choice(c.index, TokenEvent(None, finish="length"))
        else:
            c.last = tok

    def _post(self) -> None:
        """Drop what ended from the batch and put each forked request's open choices in its place."""
        batch: list[_Request | _Choice] = []
        for e in self.batch:
            if isinstance(e, _Request) and e.phase is Phase.DECODING:
                batch += [c for c in e.choices if c.phase is Phase.DECODING]
            elif e.phase is not Phase.FINISHED:
                batch.append(e)
        self.batch = batch


_RUNNING: weakref.WeakSet[StepEngine] = weakref.WeakSet()  # engines whose scheduler thread has started


@atexit.register
def _close_at_exit() -> None:
    """Stop every scheduler thread still running when the interpreter exits. The thread is a daemon (an idle engine
    must not keep a process alive), and a daemon thread left inside an onnxruntime call while the interpreter
    finalizes aborts the process ("terminate called without an active exception", exit 134): a script that ends
    right after a reply stopped early (a stop string, a chat turn's ``<|im_end|>``) left the step after it running."""
    for engine in list(_RUNNING):
        engine.close()


class StepEngine:
    """The policy of :mod:`serve.policy` in a Python thread (started on the first submit; stopped by :meth:`close`
    or at interpreter exit) over a :mod:`serve.backends.base` backend.

    eot_id: the end-of-text id; max_batch: sequences stepped together; token_budget: tokens per step; prefill_chunk:
    at most this many prompt tokens in a step that also decodes, so arriving prompts do not stall the decoding
    streams (each an int >= 1, :func:`serve.policy.check_engine_limits`). Sequences fork with ``seq.fork()`` where
    the backend has it (else the prompt is prefilled again per choice).
    """

    def __init__(self, backend: Any, eot_id: int, max_batch: int = DEFAULT_MAX_BATCH,
                 token_budget: int = DEFAULT_TOKEN_BUDGET, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        check_engine_limits(max_batch, token_budget, prefill_chunk)
        self.backend, self.eot_id = backend, eot_id
        self.max_batch, self.token_budget, self.prefill_chunk = max_batch, token_budget, prefill_chunk
        self._core = _Scheduler(backend, eot_id, max_batch, token_budget, prefill_chunk)
        self._cond = threading.Condition()
        self._submitted: list[tuple[_Request, float]] = []  # (request, submission time), not yet in the scheduler
        self._commands: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- the caller's side

    def submit(self, ids: Sequence[int], max_new_tokens: int, params: SamplingParams, n: int = 1,
               top_logprobs: int = 0, ignore_eos: bool = False, first_index: int = 0,
               timeout_s: float | None = None) -> Submission:
        """Queue ``ids`` (``<|endoftext|>`` + prompt, checked ids); see the module docstring. Choice i draws
        from ``make_rng(seed, first_index + i)``; ``timeout_s``: seconds from now after which the choices still
        running end with ``"timeout"`` (None: never). Raises BackendError for n outside [1, max_batch], a timeout
        that is not a number > 0, or a closed engine."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= self.max_batch:
            raise BackendError(f"n is {n!r}; expected 1 <= n <= max_batch = {self.max_batch} (each choice is a "
                               "sequence of the batch)")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
                                      or not 0 < timeout_s < math.inf):
            raise BackendError(f"timeout is {timeout_s!r}; expected seconds > 0 or None")
        req = _Request(self._command, list(ids), max_new_tokens, params, n, top_logprobs, ignore_eos, first_index,
                       timeout_s)
        with self._cond:
            if self._closed:
                raise BackendError("the engine is closed")
            self._submitted.append((req, time.perf_counter()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shalik-engine", daemon=True)
                self._thread.start()
                _RUNNING.add(self)
            self._cond.notify()
        return req

    def _command(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the scheduler thread before its next step."""
        with self._cond:
            self._commands.append(fn)
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        """Counters (:func:`engine_stats_keys`); running counts the choices of admitted requests not yet ended
        (live, so a finished request is never counted after its last event), waiting the choices queued."""
        with self._cond:
            out = dict(self._core.stats)
            out["waiting"] = sum(r.n for r, _ in self._submitted) + sum(len(r.open) for r in list(self._core.waiting))
        out["running"] = self._core.running
        return out

    def close(self) -> None:
        """Stop the scheduler thread; running and waiting requests end with "cancelled"."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def closed(self) -> bool:
        """Whether the engine takes no more requests (closed, or its thread stopped on an error)."""
        return self._closed

    # ---- the scheduler thread

    def _loop(self) -> None:
        try:
            while self._next():
                pass
        except BaseException as e:  # not a backend Exception (those end their step): nothing may wait forever
            with self._cond:
                self._closed = True
                self._core.waiting.extend(r for r, _ in self._submitted)
                self._submitted = []
            self._core.end_all("error", BackendError(f"the engine stopped: {type(e).__name__}: {e}"))
            raise

    def _next(self) -> bool:
        """Wait for work, take the submissions and commands, then one step (:meth:`_Scheduler.tick`). False once
        the engine is closed (every request then ends "cancelled")."""
        with self._cond:
            while not (self._closed or self._submitted or self._commands or self._core.busy()):
                self._cond.wait()
            submitted, self._submitted = self._submitted, []
            commands, self._commands = self._commands, []
            closed = self._closed
        for r, at in submitted:
            self._core.add(r, at)
        for fn in commands:  # cancellations: applied here, in the one thread that reads them
            fn()
        if closed:
            self._core.end_all("cancelled")
            return False
        self._core.tick(time.perf_counter())
        return True


def make_engine(backend: Any, eot_id: int, max_batch: int = DEFAULT_MAX_BATCH,
                token_budget: int = DEFAULT_TOKEN_BUDGET) -> RustEngine | StepEngine:
    """The engine for ``backend``: the rust backend's own ``rust_runtime.Engine`` (sized ``max_batch`` /
    ``token_budget``), else a :class:`StepEngine`. Raises ValueError for limits outside
    :func:`serve.policy.check_engine_limits`."""
    check_engine_limits(max_batch, token_budget)
    start = getattr(backend, "start_engine", None)
    if start is not None:
        return RustEngine(start(max_batch, token_budget), getattr(backend, "close_engine", None))
    return StepEngine(backend, eot_id, max_batch, token_budget)
