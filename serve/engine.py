"""Every generation goes through an engine: one scheduler that steps all running sequences together.

An engine takes requests (``<|endoftext|>`` + prompt ids, a token budget, sampling parameters, ``n`` choices)
and gives back, per choice, a stream of :class:`TokenEvent` s. Python (:mod:`serve.generation`) keeps detokenising and
stop strings. Two engines implement it:

* :class:`RustEngine` wraps ``rust_runtime.Engine``: continuous batching in Rust, outside the GIL, with
  batch-invariant kernels and sampling in Rust (the rust backend);
* :class:`StepEngine` is the same scheduling policy in a Python thread over any backend of
  :mod:`serve.backends.base` (the onnx backend, the scripted test model): each step feeds every decoding
  sequence one token — in one ``backend.decode_batch`` call when the backend has one and says batching pays
  at that batch size (``backend.batch_pays(b)``), else one sequence after another — plus chunks of pending
  prompts under ``token_budget`` tokens (at most ``prefill_chunk`` of them while sequences decode), and samples each sequence with :class:`serve.sampling.Sampler` and
  its own generator (``make_rng(seed, choice)``).

Both admit requests first come, first served while their choices fit in ``max_batch`` sequences (a request
larger than the batch waits for an empty one), prefill a prompt once for its ``n`` choices (forking the cache),
and end a choice at end-of-text (unless ``ignore_eos``: reported as a ``"stop"`` event carrying that token),
after ``max_new_tokens``, or when cancelled (``"cancelled"``, before the next step). The policy follows
llama.cpp's server (slots, n_batch) and vLLM (continuous batching, chunked prefill).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve.backends.base import BackendError
from serve.sampling import SEED_MODULUS, Sampler, SamplingParams, log_softmax, make_rng, top_logprobs

# sequences per step; benchmarks/serve_batching.py, f32 on `small`: 16 streams give 4.9x one stream's tokens/s, and 32
# add 11 % more at 1.6x the p99 inter-token latency
DEFAULT_MAX_BATCH = 16
DEFAULT_TOKEN_BUDGET = 256  # tokens per step (decode tokens + prefill chunks); llama.cpp's n_batch
# prompt tokens in a step that also decodes (Sarathi-Serve's stall-free batching), as rust_runtime.Engine's default
DEFAULT_PREFILL_CHUNK = 16
TOP_K_OFF = 2**31  # a top_k at least the vocabulary keeps every token: clamped before it reaches Rust's i64


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
               top_logprobs: int = 0, ignore_eos: bool = False, first_index: int = 0) -> Submission:
        """Queue ``ids`` (``<|endoftext|>`` + prompt, checked ids); see the module docstring. ``first_index``
        is the request's index of this group's choice 0 (its choices beyond the first batch): the engine seeds
        choice i of the group with ``choice_seed(seed, first_index + i)``, the rule every choice follows.
        Raises BackendError for what the engine refuses (a prompt that does not fit, n > max_batch)."""
        seed = None if params.seed is None else int(params.seed) % SEED_MODULUS
        try:
            stream = self._engine.submit(
                list(ids), max_new_tokens, temperature=params.temperature, top_k=min(int(params.top_k), TOP_K_OFF),
                top_p=params.top_p, presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
                seed=seed, n=n, top_logprobs=top_logprobs, ignore_eos=ignore_eos, first_index=first_index)
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


class _Choice:
    """One running sequence of a request (its own cache after the shared prefill)."""

    def __init__(self, req: _Request, index: int, seq: Any, logits: np.ndarray | None):
        self.req, self.index, self.seq = req, index, seq
        self.logits = logits  # the row to sample from this step (None: waiting for its decode)
        rng = None if req.params.greedy else make_rng(req.params.seed, req.first_index + index)
        self.sampler = Sampler(req.params, req.prompt_ids, rng)
        self.produced = 0
        self.next_token: int | None = None


class _Request(Submission):
    def __init__(self, engine: StepEngine, ids: list[int], max_new_tokens: int, params: SamplingParams, n: int,
                 top_logprobs: int, ignore_eos: bool, first_index: int = 0):
        self.n, self.first_index = n, first_index
        self.engine = engine
        self.ids, self.max_new_tokens, self.params = ids, max_new_tokens, params
        self.prompt_ids = ids[1:]  # the sampler's penalties see the prompt without the leading <|endoftext|>
        self.top_n, self.ignore_eos = top_logprobs, ignore_eos
        self.queues: list[queue.SimpleQueue[TokenEvent]] = [queue.SimpleQueue() for _ in range(n)]
        self.open = set(range(n))
        self.cancelled: set[int] = set()
        self.seq: Any = None
        self.prefilled = 0
        self.submitted = time.perf_counter()
        self.started = False

    def post(self, index: int, ev: TokenEvent) -> None:
        if ev.finish is not None:
            self.open.discard(index)
        self.queues[index].put(ev)

    def end(self, reason: str, error: BaseException | None = None) -> None:
        for i in sorted(self.open):
            self.post(i, TokenEvent(None, finish=reason, error=error))

    def events(self, index: int) -> Iterator[TokenEvent]:
        while True:
            ev = self.queues[index].get()
            yield ev
            if ev.finish is not None:
                return

    def cancel(self) -> None:
        self.engine._command(lambda: self.cancelled.update(range(self.n)))

    def cancel_choice(self, index: int) -> None:
        self.engine._command(lambda: self.cancelled.add(index))


class StepEngine:
    """The scheduler of the module docstring in a Python thread (started on the first submit).

    backend: a :mod:`serve.backends.base` backend; eot_id: the end-of-text id; max_batch: sequences stepped
    together (>= 1); token_budget: tokens per step (>= 1); prefill_chunk: at most this many prompt tokens in a
    step that also decodes, so arriving prompts do not stall the decoding streams (>= 1). Sequences fork with ``seq.fork()`` where the backend
    has it (else the prompt is prefilled again per choice).
    """

    def __init__(self, backend: Any, eot_id: int, max_batch: int = DEFAULT_MAX_BATCH,
                 token_budget: int = DEFAULT_TOKEN_BUDGET, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        check_engine_limits(max_batch, token_budget, prefill_chunk)
        self.backend, self.eot_id = backend, eot_id
        self.max_batch, self.token_budget, self.prefill_chunk = max_batch, token_budget, prefill_chunk
        self._cond = threading.Condition()
        self._commands: list = []
        self._waiting: deque[_Request] = deque()
        self._prefilling: list[_Request] = []
        self._running: list[_Choice] = []
        self._stats = dict.fromkeys(engine_stats_keys(), 0)
        self._stats["queue_wait_s"] = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- the caller's side

    def submit(self, ids: Sequence[int], max_new_tokens: int, params: SamplingParams, n: int = 1,
               top_logprobs: int = 0, ignore_eos: bool = False, first_index: int = 0) -> Submission:
        """Queue ``ids`` (``<|endoftext|>`` + prompt, checked ids); see the module docstring. Choice i draws
        from ``make_rng(seed, first_index + i)``. Raises BackendError when the engine is closed."""
        req = _Request(self, list(ids), max_new_tokens, params, n, top_logprobs, ignore_eos, first_index)
        if max_new_tokens == 0:
            req.end("length")
            return req
        with self._cond:
            if self._closed:
                raise BackendError("the engine is closed")
            self._waiting.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shalik-engine", daemon=True)
                self._thread.start()
            self._cond.notify()
        return req

    def _command(self, fn) -> None:
        with self._cond:
            self._commands.append(fn)
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        """Counters (:func:`engine_stats_keys`); running counts the choices not yet ended (live, so a
        finished request is never counted after its last event)."""
        with self._cond:
            out = dict(self._stats)
            out["waiting"] = sum(r.n for r in self._waiting)
        out["running"] = (sum(1 for c in list(self._running) if c.index in c.req.open)
                          + sum(len(r.open) for r in list(self._prefilling)))
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
            self._schedule()
        except BaseException as e:  # not a backend Exception (those end their step): nothing may wait forever
            with self._cond:
                self._closed = True
                reqs = {*self._waiting, *self._prefilling, *(c.req for c in self._running)}
            err = BackendError(f"the engine stopped: {type(e).__name__}: {e}")
            for r in reqs:
                r.end("error", err)
            raise

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._commands or self._waiting or self._prefilling or self._running):
                    self._cond.wait()
                for fn in self._commands:  # cancellations: applied here, in the one thread that reads them
                    fn()
                self._commands = []
                if self._closed:
                    for r in {*self._waiting, *self._prefilling, *(c.req for c in self._running)}:
                        r.end("cancelled")
                    return
                for r in [r for r in self._waiting if len(r.cancelled) >= r.n]:
                    self._waiting.remove(r)
                    r.end("cancelled")
                self._admit()
            self._drop_cancelled()
            if self._running or self._prefilling:
                try:
                    self._step()
                except Exception as e:  # a backend failure ends the requests of the step, not the engine
                    for r in {*self._prefilling, *(c.req for c in self._running)}:
                        r.end("error", e)
                    self._prefilling, self._running = [], []

    def _used(self) -> int:
        return len(self._running) + sum(r.n for r in self._prefilling)

    def _admit(self) -> None:
        used = self._used()
        while self._waiting:
            r = self._waiting[0]
            if used + r.n > self.max_batch and used > 0:
                break
            self._waiting.popleft()
            used += r.n
            self._prefilling.append(r)

    def _drop_cancelled(self) -> None:
        keep = []
        for c in self._running:
            if c.index in c.req.cancelled:
                c.req.post(c.index, TokenEvent(None, finish="cancelled"))
            else:
                keep.append(c)
        self._running = keep
        for r in [r for r in self._prefilling if len(r.cancelled) >= r.n]:
            self._prefilling.remove(r)
            r.end("cancelled")

    def _step(self) -> None:
        now = time.perf_counter()
        decoding = [c for c in self._running if c.next_token is not None]
        n_decode = len(decoding)
        if decoding:
            self._decode(decoding)
        budget = min(self.prefill_chunk, self.token_budget - n_decode) if n_decode else self.token_budget
        n_prefill = 0
        for r in list(self._prefilling):
            if budget <= 0:
                break
            if not r.started:
                r.started = True
                self._stats["queue_wait_s"] += now - r.submitted
                self._stats["admitted"] += 1
            take = min(len(r.ids) - r.prefilled, budget)
            try:
                if r.seq is None:
                    r.seq = self.backend.new_sequence()
                row = np.asarray(r.seq.prefill(r.ids[r.prefilled:r.prefilled + take]))
            except Exception as e:
                self._prefilling.remove(r)
                r.end("error", e)
                continue
            budget -= take
            n_prefill += take
            r.prefilled += take
            if r.prefilled == len(r.ids):
                try:
                    forks = self._fork(r, row)
                except Exception as e:  # the request is in neither list now: end it here, or its choices hang
                    self._prefilling.remove(r)
                    r.end("error", e)
                    continue
                self._prefilling.remove(r)
                self._running += forks
        for c in [c for c in self._running if c.logits is not None]:
            self._sample(c)
        self._running = [c for c in self._running if c.index in c.req.open]
        s = self._stats
        s["steps"] += 1
        s["last_step_tokens"] = n_prefill + n_decode
        s["prefill_tokens"] += n_prefill
        s["decode_tokens"] += n_decode

    def _fork(self, r: _Request, row: np.ndarray) -> list[_Choice]:
        choices = [_Choice(r, 0, r.seq, row)]
        for i in range(1, r.n):
            fork = getattr(r.seq, "fork", None)
            if fork is not None:
                seq = fork()
            else:
                seq = self.backend.new_sequence()
                row = np.asarray(seq.prefill(r.ids))
            choices.append(_Choice(r, i, seq, row))
        return choices

    def _decode(self, decoding: list[_Choice]) -> None:
        b = self.backend
        toks = [c.next_token for c in decoding]
        batched = getattr(b, "decode_batch", None)
        pays = getattr(b, "batch_pays", None)
        if batched is not None and len(decoding) > 1 and (pays is None or pays(len(decoding))):
            rows = np.asarray(batched([c.seq for c in decoding], toks))
        else:
            rows = [np.asarray(c.seq.decode(t)) for c, t in zip(decoding, toks)]
        for c, row in zip(decoding, rows):
            c.logits, c.next_token = row, None

    def _sample(self, c: _Choice) -> None:
        r, logits = c.req, c.logits
        c.logits = None
        try:
            tok = c.sampler(logits)
            lp = log_softmax(logits)
        except Exception as e:  # ModelOutputError (NaN logits) and the like end this choice
            r.post(c.index, TokenEvent(None, finish="error", error=e))
            return
        top = top_logprobs(lp, r.top_n) if r.top_n else []
        if tok == self.eot_id and not r.ignore_eos:
            r.post(c.index, TokenEvent(tok, float(lp[tok]), top, "stop"))
            return
        c.produced += 1
        r.post(c.index, TokenEvent(tok, float(lp[tok]), top))
        if c.produced >= r.max_new_tokens:
            r.post(c.index, TokenEvent(None, finish="length"))
        else:
            c.next_token = tok


def check_engine_limits(max_batch: int, token_budget: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
    """ValueError unless ``max_batch``, ``token_budget`` and ``prefill_chunk`` are ints >= 1."""
    for name, v in (("max_batch", max_batch), ("token_budget", token_budget), ("prefill_chunk", prefill_chunk)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def make_engine(backend: Any, eot_id: int, max_batch: int = DEFAULT_MAX_BATCH,
                token_budget: int = DEFAULT_TOKEN_BUDGET) -> RustEngine | StepEngine:
    """The engine for ``backend``: the rust backend's own ``rust_runtime.Engine`` (sized ``max_batch`` /
    ``token_budget``), else a :class:`StepEngine`. Raises ValueError for limits < 1."""
    check_engine_limits(max_batch, token_budget)
    start = getattr(backend, "start_engine", None)
    if start is not None:
        return RustEngine(start(max_batch, token_budget), getattr(backend, "close_engine", None))
    return StepEngine(backend, eot_id, max_batch, token_budget)
