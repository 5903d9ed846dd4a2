"""The Python API: ``LM`` (generate, stream, complete, score, tokenize, detokenize) over any backend.

A backend implements the small protocol of :mod:`serve.backends.base` (``new_sequence()``, then ``prefill``
and ``decode`` on the sequence); everything else — tokenizing, sampling (:mod:`serve.sampling`),
incremental detokenizing (:mod:`serve.detok`), stop strings (:mod:`serve.stops`) — lives here, in numpy.

Conventions (docs/design.md "Serving"):

* every prompt is encoded as ``<|endoftext|>`` + prompt; prompts are text or lists of token ids;
* ``prompt_tokens`` counts the positions the prompt occupies, the leading ``<|endoftext|>`` included, so
  ``prompt_tokens + completion_tokens <= max_position_embeddings`` always;
* the prompt is prefilled once, then each new token is one cached ``decode`` step (the last token is never
  fed back: it would only compute logits nobody reads);
* ``logprobs`` are under the model's unmodified distribution (log-softmax of the raw logits);
* ``completion_tokens`` counts the tokens in the output (end-of-text and tokens cut by a stop string are
  not part of it).
"""

from __future__ import annotations

import math
import threading
import time
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serve.bundle import TOKENIZER, backend_files, eot_id, parse_quantize, verify_files
from serve.checks import check_token_ids, new_token_budget
from serve.detok import StreamDecoder, TokenTable
from serve.engine import (
    DEFAULT_MAX_BATCH,
    DEFAULT_TOKEN_BUDGET,
    Submission,
    TokenEvent,
    check_engine_limits,
    make_engine,
)
from serve.errors import RequestError
from serve.sampling import SamplingParams, log_softmax, top_logprobs
from serve.stops import StopMatcher

DEFAULT_MAX_NEW_TOKENS = 64
MAX_CHOICES = 1024  # n per prompt in one call: each choice is a Generation object, created up front
MAX_TOP_LOGPROBS = 1000  # alternatives per token (rust_runtime.Engine's own limit)
PREFILL_BLOCK = 256  # positions per prefill call when every position's logits are needed (memory bound)
BACKENDS = ("onnx", "rust")
Prompt = str | Sequence[int]


@dataclass
class TokenLogprobs:
    """Tokens with their log-probs (nats), e.g. an echoed prompt.

    ``top_logprobs[i]`` maps display strings of the N most likely tokens at position i to their log-probs
    (None when no alternatives were asked for); ``text_offset[i]`` is the character offset of token i in
    ``text``.
    """

    text: str
    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


@dataclass
class Completion:
    """One generated continuation.

    text: the output (stop string and end-of-text excluded); token_ids / tokens (display strings) /
    logprobs (nats, raw distribution) / text_offset (char offset in ``text``): one entry per output token;
    top_logprobs: per token a dict of the N most likely alternatives, or None; prompt_tokens: positions
    used by the prompt incl. the leading ``<|endoftext|>``; completion_tokens: ``len(token_ids)``;
    finish_reason: ``"stop"`` (end-of-text or stop string) or ``"length"`` (``"cancelled"`` only after
    :meth:`Generation.cancel`); prompt: the prompt's own
    :class:`TokenLogprobs` when ``echo=True`` was asked (else None).
    """

    text: str
    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text_offset: list[int] = field(default_factory=list)
    prompt: TokenLogprobs | None = None


@dataclass
class Score:
    """Negative log-likelihood of a text under the model.

    token_nll: nats, one per token of ``token_ids`` (the first predicted from ``<|endoftext|>``);
    nll_sum / nll_mean: their sum / mean (nats); chars: NFC code points of the text; bits_per_char:
    ``nll_sum / ln 2 / chars``.
    """

    text: str
    token_ids: list[int]
    token_nll: list[float]
    nll_sum: float
    nll_mean: float
    chars: int
    bits_per_char: float


@dataclass
class Chunk:
    """A piece of a running generation: newly released text and the output tokens released with it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChoiceGroup:
    """The ``n`` choices of one prompt: submitted to the LM's engine together (one prefill) on first use, so a
    request can be validated and queued before any work is spent on it. Thread-safe."""

    def __init__(self, lm: LM, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 top_n: int | None, ignore_eos: bool, n: int, first_index: int = 0):
        self.lm, self.prompt_ids, self.max_new_tokens, self.params = lm, prompt_ids, max_new_tokens, params
        self.top_n, self.ignore_eos, self.n, self.first_index = top_n, ignore_eos, n, first_index
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
        #: (log-prob, top-N dict or None) of the end-of-text the generation stopped at, else None
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
            if ev.finish == "stop":  # end-of-text (not part of the output)
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
        final = self._chunk(tail, pending, stops.released)
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


class LM:
    """A language model ready to serve: a backend (serve.backends.base protocol) plus its tokenizer.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (byte-level BPE with ``<|endoftext|>``). ``name`` is a label
    (the bundle's run name). Generations go through one engine (:mod:`serve.engine`, started on first use):
    up to ``max_batch`` sequences are stepped together, ``token_budget`` tokens per step. Thread-safe.
    """

    def __init__(self, backend: Any, tokenizer: Any, name: str = "model", path: Path | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, token_budget: int = DEFAULT_TOKEN_BUDGET):
        check_engine_limits(max_batch, token_budget)
        self.backend = backend
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.table = TokenTable.from_tokenizer(tokenizer)
        self.eot_id = eot_id(tokenizer)
        self.vocab_size = int(backend.vocab_size)
        self.context_length = int(backend.max_position_embeddings)
        self.max_batch, self.token_budget = int(max_batch), int(token_budget)
        self._engine = None
        self._engine_lock = threading.Lock()

    @property
    def engine(self):
        """The engine every generation goes through (:func:`serve.engine.make_engine`; started on first use)."""
        with self._engine_lock:
            if self._engine is None or getattr(self._engine, "closed", False):  # none yet, or its thread died
                self._engine = make_engine(self.backend, self.eot_id, self.max_batch, self.token_budget)
            return self._engine

    def configure_engine(self, max_batch: int, token_budget: int | None = None) -> None:
        """Size the engine (before its first use; the HTTP server sets ``SHALIK_MAX_CONCURRENCY`` here). Raises
        ValueError for a limit < 1 and RuntimeError once the engine has started."""
        token_budget = self.token_budget if token_budget is None else token_budget
        check_engine_limits(max_batch, token_budget)
        with self._engine_lock:
            if self._engine is not None and (max_batch, token_budget) != (self.max_batch, self.token_budget):
                raise RuntimeError("the engine has started already; size it before the first generation")
            self.max_batch, self.token_budget = int(max_batch), int(token_budget)

    def close(self) -> None:
        """Stop the engine (running generations end with "cancelled"); a later generation starts a new one."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __repr__(self) -> str:
        return f"LM(name={self.name!r}, backend={getattr(self.backend, 'name', '?')!r}, " \
               f"vocab={self.vocab_size}, context={self.context_length})"

    # ---- tokens

    def tokenize(self, text: str, param: str = "text") -> list[int]:
        """Text → token ids (NFC-normalised by the tokenizer; no ``<|endoftext|>`` added).

        Raises RequestError (param ``param``) for a non-string and for a string that is not valid Unicode (a lone
        surrogate such as ``"\\ud800"``, which JSON can spell but UTF-8 cannot)."""
        if not isinstance(text, str):
            raise RequestError(f"{param} must be a string, got {type(text).__name__}", param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{param} holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}: "
                               "not valid Unicode text", param=param, code="invalid_unicode") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids → text (special tokens as their content; invalid UTF-8 as U+FFFD)."""
        return self.table.decode(self.check_ids(ids, param="tokens", allow_empty=True))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Display strings of ids (text, or ``bytes:\\x..`` for tokens that are not valid UTF-8 alone)."""
        return [self.table.display(int(i)) for i in ids]

    def check_ids(self, ids: Sequence[int], param: str = "prompt", allow_empty: bool = False) -> list[int]:
        """Validate token ids: ints in ``[0, vocab_size)`` (:func:`serve.checks.check_token_ids`); RequestError
        (param ``param``) otherwise."""
        return check_token_ids(ids, self.vocab_size, param=param, allow_empty=allow_empty)

    def encode_prompt(self, prompt: Prompt, param: str = "prompt") -> list[int]:
        """A prompt (text or token ids) → its ids, without the leading ``<|endoftext|>``. RequestError (param
        ``param``) for anything else — bytes included (not silently read as a list of byte values)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, param)
        if isinstance(prompt, Sequence | np.ndarray) and not isinstance(prompt, bytes | bytearray):
            return self.check_ids(list(prompt), param)
        raise RequestError(f"{param} must be a string or a list of token ids, got {type(prompt).__name__}",
                           param=param)

    def new_token_budget(self, prompt_tokens: int, max_new_tokens: int | None,
                         default: int = DEFAULT_MAX_NEW_TOKENS) -> int:
        """How many tokens a request may generate (:func:`serve.checks.new_token_budget` with this model's
        context): ``max_new_tokens=None`` means ``default`` capped by the context; ContextLengthError when an
        explicit value or the prompt does not fit."""
        return new_token_budget(prompt_tokens, max_new_tokens, self.context_length, default)

    # ---- generation

    def start(self, prompt: Prompt, max_new_tokens: int | None = None, **options: Any) -> Generation:
        """Validate a request and return a :class:`Generation` (lazy: nothing runs until it is iterated or
        :meth:`Generation.submit` is called). Options as :meth:`start_choices`; ``n`` may only be 1 here
        (RequestError otherwise: several choices come from :meth:`start_choices` / :meth:`complete_batch`)."""
        n = options.pop("n", 1)
        if n != 1 or isinstance(n, bool):
            raise RequestError(f"n is {n!r}, but this call makes one generation; for n choices use "
                               "start_choices(prompt, n, ...) or complete_batch([prompt], n=n)", param="n")
        return self.start_choices(prompt, 1, max_new_tokens, **options)[0]

    def start_choices(self, prompt: Prompt, n: int = 1, max_new_tokens: int | None = None, *,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, presence_penalty: float = 0.0,
                      frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
                      stop: str | Sequence[str] | None = None, top_logprobs: int | None = None, echo: bool = False,
                      ignore_eos: bool = False, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
                      ) -> list[Generation]:
        """Validate a request for ``n`` choices of one prompt and return their :class:`Generation` s (lazy). The
        prompt is prefilled once for every ``max_batch`` of them; each choice draws from a random stream of its
        own derived from ``seed`` (choice 0 equals the ``n = 1`` generation).

        prompt: text or token ids (``<|endoftext|>`` is prepended); n: an int in [1, :data:`MAX_CHOICES`]; max_new_tokens:
        int >= 0, or None for ``default_max_new_tokens`` capped by the context; sampling parameters: see
        :class:`serve.sampling.SamplingParams`; stop: a string or list of non-empty strings; top_logprobs:
        N alternatives per token, an int in [0, :data:`MAX_TOP_LOGPROBS`] (None = none); echo: also score the prompt (``Generation.prompt``); ignore_eos:
        keep going past ``<|endoftext|>`` (its text then appears; for benchmarks that need fixed lengths).

        Raises RequestError (ContextLengthError when prompt + max_new_tokens exceed the context).
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty, seed=seed)
        stops = normalize_stop(stop)
        if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                         or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}",
                               param="logprobs")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n")
        ids = self.encode_prompt(prompt)
        budget = self.new_token_budget(len(ids) + 1, max_new_tokens, default_max_new_tokens)
        gens = []
        for first in range(0, n, self.max_batch):  # a group's choices must fit in one batch
            size = min(self.max_batch, n - first)
            group = ChoiceGroup(self, ids, budget, params, top_logprobs, bool(ignore_eos), size, first)
            gens += [Generation(group, i, stops, bool(echo)) for i in range(size)]
        return gens

    def stream(self, prompt: Prompt, max_new_tokens: int | None = None, **options: Any) -> Iterator[str]:
        """Yield text pieces as they are produced (same options as :meth:`start_choices`).

        Pieces never split a character and concatenate to ``complete(...).text`` for the same options."""
        for chunk in self.start(prompt, max_new_tokens, **options):
            yield chunk.text

    def generate(self, prompt: Prompt | Sequence[Prompt], max_new_tokens: int | None = None,
                 **options: Any) -> str | list[str]:
        """The generated text (same options as :meth:`start_choices`). A list of prompts (texts, or lists of
        token ids) gives a list of texts, generated together in the engine's batches."""
        if is_prompt_list(prompt):
            return [c.text for c in self.complete_batch(prompt, max_new_tokens, **options)]
        return self.complete(prompt, max_new_tokens, **options).text

    def complete(self, prompt: Prompt, max_new_tokens: int | None = None, **options: Any) -> Completion:
        """Run a generation to the end and return a :class:`Completion` (same options as :meth:`start_choices`)."""
        return self.collect(self.start(prompt, max_new_tokens, **options))

    def complete_batch(self, prompts: Sequence[Prompt], max_new_tokens: int | None = None, n: int = 1,
                       **options: Any) -> list[Completion]:
        """Completions of several prompts (``n`` each, prompt-major), all submitted at once so that they share the
        engine's steps. Every prompt is validated before any runs (RequestError naming the first bad one:
        ``"prompt 2: ..."``, its type, param and code kept)."""
        gens: list[Generation] = []
        for i, p in enumerate(prompts):
            try:
                gens += self.start_choices(p, n, max_new_tokens, **options)
            except RequestError as e:
                if len(prompts) < 2 or e.param not in ("prompt", "max_tokens"):  # about this prompt
                    raise
                e.message = f"prompt {i}: {e.message}"  # same type (ContextLengthError stays one), param and code
                e.args = (e.message,)
                raise
        try:
            for g in gens:
                g.submit()
            return [self.collect(g) for g in gens]
        except BaseException:  # one failed (or the caller was interrupted): the others must not run on unread
            for g in gens:
                g.cancel()
            raise

    @staticmethod
    def collect(gen: Generation, chunks: Sequence[Chunk] | None = None) -> Completion:
        """Drain a :class:`Generation` into a :class:`Completion` (or assemble it from the ``chunks`` it
        already produced)."""
        chunks = list(gen) if chunks is None else list(chunks)
        tops = None if gen.top_n is None else [d for c in chunks for d in c.top_logprobs]
        ids = [t for c in chunks for t in c.token_ids]
        return Completion(
            text="".join(c.text for c in chunks), token_ids=ids, tokens=gen.lm.token_strings(ids),
            logprobs=[p for c in chunks for p in c.logprobs], top_logprobs=tops,
            prompt_tokens=gen.prompt_tokens, completion_tokens=len(ids), finish_reason=gen.finish_reason,
            text_offset=[o for c in chunks for o in c.text_offset], prompt=gen.prompt)

    # ---- scoring

    def score(self, text: Prompt, top_logprobs: int | None = None) -> Score:
        """Per-token negative log-likelihood (nats) of ``text`` (a string or token ids).

        The first token is predicted from ``<|endoftext|>``. A text longer than the context is scored with a
        sliding window (stride half the context): every token after the first window is predicted from at
        least half a context of the tokens before it. Raises RequestError for an empty text.
        """
        ids = self.encode_prompt(text, "text")
        if not ids:
            raise RequestError("nothing to score: the text is empty", param="text")
        full = [self.eot_id, *ids]
        ctx = self.context_length
        stride = max(1, ctx // 2)
        logprobs: list[float] = []
        tops: list[dict[str, float] | None] = []
        begin = 0
        while len(logprobs) < len(ids):
            end = min(begin + ctx, len(ids))  # inputs full[begin:end] predict full[begin + 1:end + 1]
            skip = len(logprobs) - begin  # targets already scored by the previous window
            lp, top, _ = self.prefill_logprobs(self.backend.new_sequence(), full[begin:end],
                                                full[begin + 1:end + 1], top_logprobs, skip)
            logprobs += lp
            tops += top
            begin += stride
        scored = self.describe(ids, logprobs, None if top_logprobs is None else tops)
        nll = [-p for p in scored.logprobs]
        s = text if isinstance(text, str) else scored.text
        chars = len(unicodedata.normalize("NFC", s))
        total = float(sum(nll))
        return Score(text=s, token_ids=ids, token_nll=nll, nll_sum=total, nll_mean=total / len(ids), chars=chars,
                     bits_per_char=total / math.log(2) / chars if chars else float("nan"))

    def prefill_logprobs(self, seq, inputs: list[int], targets: list[int], top_n: int | None, skip: int = 0
                          ) -> tuple[list[float], list[dict[str, float] | None], np.ndarray]:
        """Prefill ``inputs`` into ``seq`` in blocks of :data:`PREFILL_BLOCK` (bounded memory) and return the
        log-probs of ``targets[i]`` (predicted after ``inputs[:i + 1]``) for ``i >= skip``, their top-N
        dicts, and the logits row after the last input (float32 ``[V]``).

        Part of the package-internal interface that :class:`Generation` (and a batching runner) drive: with
        :meth:`describe` and :meth:`top_alternatives` it is everything a generation loop needs of the model
        besides ``backend`` and ``table``."""
        logprobs: list[float] = []
        tops: list[dict[str, float] | None] = []
        row = None
        for b in range(0, len(inputs), PREFILL_BLOCK):
            rows = np.asarray(seq.prefill(inputs[b:b + PREFILL_BLOCK], all_logits=True))
            rows = rows.reshape(-1, rows.shape[-1])
            row = rows[-1]
            lo, hi = max(skip, b), min(b + len(rows), len(targets))
            if lo >= hi:
                continue
            lp = log_softmax(rows[lo - b:hi - b])
            for i in range(lo, hi):
                logprobs.append(float(lp[i - lo, targets[i]]))
                tops.append(self.top_alternatives(lp[i - lo], top_n))
        return logprobs, tops, row

    def describe(self, ids: list[int], logprobs: list[float], tops: list | None) -> TokenLogprobs:
        """Tokens ``ids`` with their ``logprobs`` (nats), display strings, the decoded text and each token's
        character offset in it; ``tops`` are per-token top-N dicts or None."""
        detok = StreamDecoder(self.table)
        offsets = []
        for t in ids:
            offsets.append(len(detok.text))
            detok.push(t)
        detok.flush()
        return TokenLogprobs(text=detok.text, token_ids=list(ids), tokens=self.token_strings(ids),
                             logprobs=logprobs, top_logprobs=tops, text_offset=offsets)

    def top_alternatives(self, lp: np.ndarray, n: int | None) -> dict[str, float] | None:
        """The ``n`` most likely tokens of a log-prob row ``lp`` (float ``[V]``) as {display string: log-prob},
        largest first; None when ``n`` is None."""
        if n is None:
            return None
        return {self.table.display(i): p for i, p in top_logprobs(lp, n)}


def is_prompt_list(prompt: Any) -> bool:
    """True for a list (or tuple) of prompts — texts or token-id lists — rather than one prompt."""
    return (isinstance(prompt, list | tuple) and len(prompt) > 0
            and all(isinstance(p, str) or (isinstance(p, Sequence | np.ndarray) and not isinstance(p, bytes | bytearray))
                    for p in prompt))


def normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list of non-empty strings; RequestError (param "stop") otherwise."""
    if stop is None:
        return []
    if not isinstance(stop, Sequence) or isinstance(stop, bytes | bytearray):
        raise RequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}", param="stop")
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
    return stops


def bundle_files(backend: str, quantize: str | None) -> list[str]:
    """The files of a bundle that ``backend`` reads (what :func:`load` verifies against the manifest)."""
    return backend_files(backend, quantize)


def load(path: str | Path, backend: str = "onnx", quantize: str | None = None, threads: int | None = None,
         name: str | None = None, verify: bool = True, max_batch: int = DEFAULT_MAX_BATCH,
         token_budget: int = DEFAULT_TOKEN_BUDGET) -> LM:
    """Load a bundle directory (tokenizer.json, config.json, model.onnx / model.safetensors) for serving.

    backend: ``"onnx"`` (onnxruntime) or ``"rust"`` (the ``rust_runtime`` extension); quantize: None /
    ``"none"`` or ``"int8"``; threads: compute threads, an int >= 1 (None = all cores); name: the model's label
    (default: the bundle folder's parent name, e.g. ``small`` for ``runs/small/bundle``); verify: check the sha256
    of every file the backend reads against ``manifest.json`` first (:func:`serve.bundle.verify_files`; False for
    those who verify the bundle elsewhere); max_batch / token_budget: the engine's sequences per step and tokens
    per step (:mod:`serve.engine`).
    Raises BundleError (a ValueError) naming a corrupt or unlisted file, or a missing manifest; TypeError for an argument of the wrong type (path not a str or Path, threads not an int),
    FileNotFoundError for a missing folder or tokenizer, ValueError for an unknown backend or quantization or
    threads < 1, ImportError when the backend's runtime is not installed. Every argument is checked before
    anything is read.
    """
    from tokenizers import Tokenizer  # its Rust extension loads in ~50 ms; only load() needs it

    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a bundle folder (str or pathlib.Path), got {type(path).__name__}")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int | np.integer):
            raise TypeError(f"threads must be an int >= 1 or None (all cores), got {threads!r}")
        if threads < 1:
            raise ValueError(f"threads must be an int >= 1 or None (all cores), got {threads}")
    if backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}; expected one of {', '.join(BACKENDS)}")
    quantize = parse_quantize(quantize)
    check_engine_limits(max_batch, token_budget)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no model bundle at {path} (expected a folder with {TOKENIZER} and the model)")
    tok_file = path / TOKENIZER
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file} is missing: {path} is not a Shalik bundle")
    if verify:
        verify_files(path, bundle_files(backend, quantize))
    if backend == "onnx":
        from serve.backends.onnx import OnnxBackend  # onnxruntime loads only when this backend is asked for

        model = OnnxBackend(path, quantize=quantize, threads=threads)
    else:
        from serve.backends.rust import RustBackend  # the optional Rust extension, likewise

        model = RustBackend(path, quantize=quantize, threads=threads)
    label = name or path.resolve().parent.name or path.name
    return LM(model, Tokenizer.from_file(str(tok_file)), name=label, path=path, max_batch=max_batch,
              token_budget=token_budget)
