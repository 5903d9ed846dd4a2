"""A running generation: the engine's token events of one choice turned into released text.

* :class:`ChoiceGroup`: the ``n`` choices of one prompt, submitted to the LM's engine together (one prefill) on
  first use, with per-choice cancellation — also of choices cancelled before the submission existed;
* :class:`Generation`: one choice; iterating it detokenises (:mod:`serve.detok`), applies the stop strings
  (:mod:`serve.stops`) and yields :class:`serve.results.Chunk` s; ``cancel()`` from any thread ends it in the
  engine before its next step.

Built by :meth:`serve.lm.LM.start_choices`; the model-facing parts (the engine, the echoed prompt's log-probs)
are the LM's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from serve.detok import StreamDecoder, TokenTable
from serve.engine import Submission, TokenEvent
from serve.results import Chunk, TokenLogprobs
from serve.sampling import SamplingParams
from serve.stops import StopMatcher


class GenerationLM(Protocol):
    """What a generation uses of the model it runs on (:class:`serve.lm.LM`, which imports this module): the
    engine (``engine`` starts one when none runs; ``_engine`` is the running one or None), the end-of-text id, the
    token table, and for an echoed prompt the backend and its log-probabilities."""

    eot_id: int
    table: TokenTable
    backend: Any
    _engine: Any

    @property
    def engine(self) -> Any: ...

    def prefill_logprobs(self, seq: Any, inputs: list[int], targets: list[int], top_n: int | None,
                         skip: int = 0) -> Any: ...

    def describe(self, ids: list[int], logprobs: list[float], tops: list | None) -> TokenLogprobs: ...


class ChoiceGroup:
    """The ``n`` choices of one prompt: submitted to the LM's engine together (one prefill) on first use, so a
    request can be validated and queued before any work is spent on it. Thread-safe."""

    def __init__(self, lm: GenerationLM, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 top_n: int | None, ignore_eos: bool, n: int, first_index: int = 0,
                 end_ids: frozenset[int] = frozenset()):
        self.lm, self.prompt_ids, self.max_new_tokens, self.params = lm, prompt_ids, max_new_tokens, params
        self.top_n, self.ignore_eos, self.n, self.first_index = top_n, ignore_eos, n, first_index
        #: ids besides the engine's end-of-text that end a choice like it (a chat turn's <|im_end|>): the engine
        #: takes one end id, so the choice is cancelled there before the engine's next step
        self.end_ids = end_ids
        self._lock = threading.Lock()
        self._submission: Submission | None = None
        self._cancelled: set[int] = set()

    def submission(self) -> Submission:
        """The engine's :class:`serve.engine.Submission` (submitted now if it was not yet)."""
        with self._lock:
            if self._submission is None:
                engine = self.lm.engine
                while True:
                    try:
                        self._submission = self._submit(engine)
                        break
                    except Exception:
                        if self.lm._engine is engine and not getattr(engine, "closed", False):
                            raise  # a refusal by the running engine
                    # The engine stopped between reading lm.engine and submitting (lm.close(), its own close(),
                    # or its scheduler thread died): queue in its replacement, which lm.engine starts. Never
                    # "the engine is closed" (docs/design.md); each pass needs one more engine to have stopped.
                    engine = self.lm.engine
                if self._cancelled:  # choices cancelled before the submission existed
                    self._forward_cancels(self._submission, sorted(self._cancelled))
            return self._submission

    def _submit(self, engine: Any) -> Submission:
        return engine.submit([self.lm.eot_id, *self.prompt_ids], self.max_new_tokens, self.params, n=self.n,
                             top_logprobs=self.top_n or 0, ignore_eos=self.ignore_eos,
                             first_index=self.first_index)

    def cancel(self, index: int) -> None:
        """End choice ``index`` in the engine (the whole request once every choice is cancelled)."""
        with self._lock:
            self._cancelled.add(index)
            if self._submission is not None:
                self._forward_cancels(self._submission, [index])

    def _forward_cancels(self, sub: Submission, indices: list[int]) -> None:
        """Tell the engine: the whole request once every choice is cancelled, else each of ``indices``."""
        if len(self._cancelled) == self.n:
            sub.cancel()
        else:
            for i in indices:
                sub.cancel_choice(i)


class Generation:
    """A running generation: iterate it for :class:`Chunk` s (only non-empty ones); afterwards
    ``finish_reason`` is set. Built by :meth:`LM.start` / :meth:`LM.start_choices`; its tokens come from the
    LM's engine (:mod:`serve.engine`, which steps every running generation together); detokenising, stop
    strings and chunking happen in whichever thread iterates it.

    Live attributes (readable from another thread): ``tokens_generated`` (model steps that produced a
    token, end-of-text included), ``completion_tokens`` (output tokens released in chunks so far),
    ``first_token_at`` / ``finished_at`` (``time.perf_counter()`` stamps, or None). ``cancel()``
    (thread-safe) ends the generation in the engine before its next step, with finish_reason ``"cancelled"``
    — as does closing the iterator before the end (``close()`` / leaving a ``for`` loop over it).
    """

    def __init__(self, group: ChoiceGroup, index: int, stop: Sequence[str], echo: bool):
        self.lm = group.lm
        self.group = group
        self.index = index
        self.prompt_ids = group.prompt_ids
        self.prompt_tokens = len(group.prompt_ids) + 1
        self.max_new_tokens = group.max_new_tokens
        self.params = group.params
        self.top_n = group.top_n
        self.echo = echo
        self.ignore_eos = group.ignore_eos
        self._stops = StopMatcher(stop)
        self._cancel = threading.Event()
        self.finish_reason: str | None = None
        self.prompt: TokenLogprobs | None = None
        #: (log-prob, top-N dict or None) of the end-of-text (or other end id) the generation stopped at, else None
        self.end_of_text: tuple[float, dict[str, float] | None] | None = None
        self.tokens_generated = 0
        self.completion_tokens = 0
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._settled = False  # the engine's events have ended (finish_reason is final)
        self._iter = self._run()

    def __iter__(self) -> Iterator[Chunk]:
        return self._iter

    def __next__(self) -> Chunk:
        return next(self._iter)

    def submit(self) -> None:
        """Queue this generation's request in the engine now (iterating does it otherwise), so that the
        generations of one HTTP request or one batch run in the same steps. No-op when there is nothing to
        generate or it was cancelled."""
        if self.max_new_tokens > 0 and not self._cancel.is_set():
            self.group.submission()

    def cancel(self) -> None:
        """End the generation before its next model step (thread-safe)."""
        self._cancel.set()
        self.group.cancel(self.index)

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancel.is_set()

    def _run(self) -> Iterator[Chunk]:
        lm = self.lm
        self.started_at = time.perf_counter()
        ended = False
        try:
            if self._cancel.is_set():
                self.finish_reason = "cancelled"
                return
            if self.echo:  # the prompt's own log-probs, the first predicted from <|endoftext|>
                full = [lm.eot_id, *self.prompt_ids]
                lp, tops, _ = lm.prefill_logprobs(lm.backend.new_sequence(), full, self.prompt_ids, self.top_n)
                self.prompt = lm.describe(self.prompt_ids, lp, None if self.top_n is None else tops)
            if self.max_new_tokens == 0:
                self.finish_reason = "length"
                ended = True
                return
            yield from self._decode_loop(self.group.submission().events(self.index))
            ended = True
        except GeneratorExit:  # the consumer closed it before the engine ended it: it did not reach "length"
            if not self._settled:
                self.finish_reason = "cancelled"
            raise
        finally:
            if not ended:  # closed early (the consumer stopped iterating) or failed: free its engine slot
                self.group.cancel(self.index)
            self.finished_at = time.perf_counter()

    def _decode_loop(self, events: Iterator[TokenEvent]) -> Iterator[Chunk]:
        lm, stops = self.lm, self._stops
        detok = StreamDecoder(lm.table)
        pending: list[tuple[int, float, dict[str, float] | None, int]] = []  # (id, logprob, top, offset)
        self.finish_reason = "length"
        tail = ""
        for ev in events:
            if ev.token is None:  # the end: length, cancelled, timeout, or an error to raise
                if ev.error is not None:
                    raise ev.error
                self.finish_reason = ev.finish
                break
            if self._cancel.is_set():
                self.finish_reason = "cancelled"
                break
            self.tokens_generated += 1
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            top = self._top(ev.top)
            ends_turn = ev.token in self.group.end_ids and not self.ignore_eos
            if ends_turn:  # the engine would go on: end this choice there before its next step
                self.group.cancel(self.index)
            if ev.finish == "stop" or ends_turn:  # end-of-text (not part of the output)
                self.finish_reason = "stop"
                self.end_of_text = (ev.logprob, top)
                break
            offset = len(detok.text)
            pending.append((ev.token, ev.logprob, top, offset))
            released = stops.push(detok.push(ev.token))
            if stops.stop_at is not None:
                tail = released
                self.group.cancel(self.index)
                break
            if released:
                yield self._chunk(released, pending, stops.released)
        self._settled = True
        if stops.stop_at is None:
            tail = stops.push(detok.flush())
            tail += stops.finish()
        if stops.stop_at is not None:
            self.finish_reason = "stop"
        # without a stop string every token left is output, also one whose text is empty (an end-of-text kept by
        # ignore_eos, a byte that completes nothing): it is counted and returned with the last chunk
        final = self._chunk(tail, pending, stops.released if stops.stop_at is not None else len(detok.text) + 1)
        if final.text or final.token_ids:
            yield final

    def _top(self, top: list[tuple[int, float]]) -> dict[str, float] | None:
        if self.top_n is None:
            return None
        return {self.lm.table.display(i): p for i, p in top}

    def _chunk(self, text: str, pending: list, released_chars: int) -> Chunk:
        """Pop the pending tokens that start before ``released_chars`` into a chunk with ``text``."""
        n = 0
        while n < len(pending) and pending[n][3] < released_chars:
            n += 1
        out, pending[:] = pending[:n], pending[n:]
        self.completion_tokens += n
        return Chunk(text=text, token_ids=[t[0] for t in out], logprobs=[t[1] for t in out],
                     top_logprobs=None if self.top_n is None else [t[2] for t in out],
                     text_offset=[t[3] for t in out])
