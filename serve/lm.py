"""The Python API: ``LM`` (generate, stream, complete, chat, score, tokenize, detokenize) over any backend.

A backend implements the small protocol of :mod:`serve.backends.base` (``new_sequence()``, then ``prefill``
and ``decode`` on the sequence); every generation runs through the LM's engine (:mod:`serve.engine`), and the
rest — tokenizing, request checks, scoring — lives here, in numpy. A running generation is
:mod:`serve.generation` (detokenizing, stop strings), its results are :mod:`serve.results`, and loading a bundle
is :mod:`serve.loader`.

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
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from contract.bundle import eot_id
from serve.chat import missing_tokens, start_chat
from serve.checks import check_token_ids, new_token_budget
from serve.detok import StreamDecoder, TokenTable
from serve.engine import make_engine
from serve.errors import Cancelled, RequestError, shown
from serve.generation import ChoiceGroup, Generation
from serve.policy import DEFAULT_MAX_BATCH, DEFAULT_TOKEN_BUDGET, check_engine_limits
from serve.results import Chunk, Completion, Score, TokenLogprobs
from serve.sampling import SamplingParams, log_softmax, top_logprobs

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "LM", "MAX_CHOICES", "MAX_TOP_LOGPROBS", "PREFILL_BLOCK", "Chunk", "Completion",
           "Generation", "Prompt", "Score", "TokenLogprobs", "is_prompt_list", "normalize_stop"]

DEFAULT_MAX_NEW_TOKENS = 64
MAX_CHOICES = 1024  # n per prompt in one call: each choice is a Generation object, created up front
MAX_TOP_LOGPROBS = 1000  # alternatives per token (rust_runtime.Engine's own limit)
PREFILL_BLOCK = 256  # positions per prefill call when every position's logits are needed (memory bound)
Prompt = str | Sequence[int]


class LM:
    """A language model ready to serve: a backend (serve.backends.base protocol) plus its tokenizer.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (byte-level BPE with ``<|endoftext|>``). ``name`` is a label
    (the bundle's run name). Generations go through one engine (:mod:`serve.engine`, started on first use):
    up to ``max_batch`` sequences are stepped together, ``token_budget`` tokens per step. ``chat_model``: whether
    :meth:`chat` may run (:func:`serve.load` passes the bundle's verdict, ``contract.bundle.has_chat_template``;
    None: whenever the tokenizer has the chat tokens). Thread-safe.
    """

    def __init__(self, backend: Any, tokenizer: Any, name: str = "model", path: Path | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 chat_model: bool | None = None):
        check_engine_limits(max_batch, token_budget)
        self.backend = backend
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.chat_model = not missing_tokens(tokenizer) if chat_model is None else bool(chat_model)
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
        _only_one(options, "this call makes one generation; for n choices use start_choices(prompt, n, ...) or "
                           "complete_batch([prompt], n=n)")
        return self.start_choices(prompt, 1, max_new_tokens, **options)[0]

    def start_choices(self, prompt: Prompt, n: int = 1, max_new_tokens: int | None = None, *,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, presence_penalty: float = 0.0,
                      frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
                      stop: str | Sequence[str] | None = None, top_logprobs: int | None = None, echo: bool = False,
                      ignore_eos: bool = False, default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                      end_ids: frozenset[int] = frozenset()) -> list[Generation]:
        """Validate a request for ``n`` choices of one prompt and return their :class:`Generation` s (lazy). The
        prompt is prefilled once for every ``max_batch`` of them; each choice draws from a random stream of its
        own derived from ``seed`` (choice 0 equals the ``n = 1`` generation).

        prompt: text or token ids (``<|endoftext|>`` is prepended); n: an int in [1, :data:`MAX_CHOICES`]; max_new_tokens:
        int >= 0, or None for ``default_max_new_tokens`` capped by the context; sampling parameters: see
        :class:`serve.sampling.SamplingParams`; stop: a string or list of non-empty strings; top_logprobs:
        N alternatives per token, an int in [0, :data:`MAX_TOP_LOGPROBS`] (None = none); echo: also score the prompt (``Generation.prompt``); ignore_eos:
        keep going past ``<|endoftext|>`` (its text then appears; for benchmarks that need fixed lengths); end_ids:
        ids that also end a choice (finish_reason "stop", not part of the output): a chat turn's ``<|im_end|>``.

        Raises RequestError (ContextLengthError when prompt + max_new_tokens exceed the context).
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty, seed=seed)
        stops = normalize_stop(stop)
        top_logprobs = check_top_logprobs(top_logprobs, "logprobs")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise RequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {shown(n)}", param="n")
        ids = self.encode_prompt(prompt)
        budget = self.new_token_budget(len(ids) + 1, max_new_tokens, default_max_new_tokens)
        gens = []
        for first in range(0, n, self.max_batch):  # a group's choices must fit in one batch
            size = min(self.max_batch, n - first)
            group = ChoiceGroup(self, ids, budget, params, top_logprobs, bool(ignore_eos), size, first, end_ids)
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

    # ---- chat

    def start_chat(self, messages: Sequence[dict], n: int = 1, max_new_tokens: int | None = None,
                   **options: Any) -> list[Generation]:
        """``n`` lazy generations of the assistant's reply to ``messages`` (OpenAI / Hugging Face form: dicts with
        ``role`` system / user / assistant and ``content`` a string or text parts), rendered with the chat
        template (``contract.chat_format``) and ending at ``<|im_end|>``; options as :meth:`start_choices`. Raises
        RequestError (param ``messages``) for a bad conversation, one that leaves no room for a reply, or a model
        whose tokenizer has no chat tokens (:mod:`serve.chat`)."""
        return start_chat(self, messages, n, max_new_tokens, **options)

    def chat(self, messages: Sequence[dict], max_new_tokens: int | None = None, **options: Any) -> Completion:
        """The assistant's reply to ``messages`` as a :class:`Completion` (``text`` without ``<|im_end|>``;
        finish_reason "stop" when the turn ended, "length" when the budget did). Options as
        :meth:`start_choices` (``n`` only 1: several replies come from :meth:`start_chat`); errors as
        :meth:`start_chat`."""
        _only_one(options, "chat() makes one reply; for n replies use start_chat(messages, n)")
        return self.collect(self.start_chat(messages, 1, max_new_tokens, **options)[0])

    def chat_stream(self, messages: Sequence[dict], max_new_tokens: int | None = None,
                    **options: Any) -> Iterator[str]:
        """Yield the reply to ``messages`` in text pieces as they are produced (same options as :meth:`chat`);
        they concatenate to ``chat(...).text`` for the same options and seed."""
        _only_one(options, "chat_stream() streams one reply")
        for chunk in self.start_chat(messages, 1, max_new_tokens, **options)[0]:
            yield chunk.text

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

    def score(self, text: Prompt, top_logprobs: int | None = None, cancel: threading.Event | None = None) -> Score:
        """Per-token negative log-likelihood (nats) of ``text`` (a string or token ids).

        The first token is predicted from ``<|endoftext|>``. A text longer than the context is scored with a
        sliding window (stride half the context): every token after the first window is predicted from at
        least half a context of the tokens before it. ``top_logprobs``: N alternatives per token, an int in
        [0, :data:`MAX_TOP_LOGPROBS`] or None. ``cancel``: once set (by another thread: a caller that stopped
        waiting), the scoring stops before its next block of :data:`PREFILL_BLOCK` positions and raises
        :class:`serve.errors.Cancelled`. Raises RequestError for an empty text or a bad ``top_logprobs``.
        """
        top_logprobs = check_top_logprobs(top_logprobs, "top_logprobs")
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
                                                full[begin + 1:end + 1], top_logprobs, skip, cancel)
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

    def prefill_logprobs(self, seq, inputs: list[int], targets: list[int], top_n: int | None, skip: int = 0,
                         cancel: threading.Event | None = None
                         ) -> tuple[list[float], list[dict[str, float] | None], np.ndarray]:
        """Prefill ``inputs`` into ``seq`` in blocks of :data:`PREFILL_BLOCK` (bounded memory) and return the
        log-probs of ``targets[i]`` (predicted after ``inputs[:i + 1]``) for ``i >= skip``, their top-N
        dicts, and the logits row after the last input (float32 ``[V]``). Raises :class:`serve.errors.Cancelled`
        before a block once ``cancel`` is set.

        Part of the package-internal interface that :class:`Generation` (and a batching runner) drive: with
        :meth:`describe` and :meth:`top_alternatives` it is everything a generation loop needs of the model
        besides ``backend`` and ``table``."""
        logprobs: list[float] = []
        tops: list[dict[str, float] | None] = []
        row = None
        for b in range(0, len(inputs), PREFILL_BLOCK):
            if cancel is not None and cancel.is_set():
                raise Cancelled("scoring stopped: its caller stopped waiting")
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


def check_top_logprobs(top_logprobs: Any, param: str) -> int | None:
    """``top_logprobs`` (alternatives per token) as an int in [0, :data:`MAX_TOP_LOGPROBS`], or None; RequestError
    naming ``param`` (the HTTP field: ``logprobs`` of /v1/completions) for anything else."""
    if top_logprobs is None:
        return None
    if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int | np.integer)
            or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        where = " (logprobs in /v1/completions)" if param == "logprobs" else ""
        raise RequestError(f"top_logprobs{where} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got "
                           f"{shown(top_logprobs)}", param=param)
    return int(top_logprobs)


def _only_one(options: dict, why: str) -> None:
    """Pop ``n`` from ``options``; RequestError (param ``n``) unless it is absent or the int 1 (``why``: what the
    call makes instead)."""
    n = options.pop("n", 1)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n != 1:
        raise RequestError(f"n is {shown(n)}, but {why}", param="n")


def is_prompt_list(prompt: Any) -> bool:
    """True for a list (or tuple) of prompts — texts or token-id lists — rather than one prompt."""
    return (isinstance(prompt, list | tuple) and len(prompt) > 0
            and all(isinstance(p, str) or (isinstance(p, Sequence | np.ndarray) and not isinstance(p, bytes | bytearray))
                    for p in prompt))


def normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list of non-empty NFC strings (the output is NFC text: the tokenizer normalises every prompt,
    so a stop string spelled another way, a precomposed nukta letter say, would never match); RequestError
    (param "stop") for anything else."""
    if stop is None:
        return []
    if not isinstance(stop, Sequence) or isinstance(stop, bytes | bytearray):
        raise RequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}", param="stop")
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
    return [unicodedata.normalize("NFC", s) for s in stops]
