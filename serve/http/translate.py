"""OpenAI's completions ↔ the Python API, as functions of their inputs (no I/O, no event loop).

* request → generation: :func:`split_prompts`, :func:`generation_options`, :func:`start_generations`;
* results → response: :func:`echo_part`, :func:`logprob_lists`, :func:`end_of_text_lists`, :func:`merge_lists`,
  :func:`choice_dict`, :func:`usage_dict`, :func:`completion_body`, :func:`score_body`;
* :class:`ResponseFormat`: what a run's body and stream events say; :class:`CompletionFormat` is OpenAI's
  completions form (``serve.http.chat`` has the chat form);
* :func:`sse`: one server-sent event.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from contract.bundle import EOT
from serve.errors import RequestError
from serve.generation import Generation
from serve.http.schemas import CompletionRequest, ScoreResponse
from serve.lm import LM
from serve.results import Chunk, Completion, Score

MAX_CHOICES = 128  # prompts × n in one request: they all run in one concurrency slot
EMPTY_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms → a list of prompts (text or token ids). RequestError for empty lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if isinstance(prompt[0], list) and any(not p for p in prompt):
        raise RequestError("prompt holds an empty list of token ids", param="prompt")
    return list(prompt)


def sampling_options(req) -> dict[str, Any]:
    """The sampling keyword arguments that completions and chat requests share (OpenAI's defaults for absent
    fields): temperature, top_p, top_k, the three penalties, seed and stop."""
    return dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed, stop=req.stop)


def generation_options(req: CompletionRequest, default_max_tokens: int) -> dict[str, Any]:
    """The keyword arguments of :meth:`serve.lm.LM.start` for a request (OpenAI's defaults for absent fields)."""
    return dict(
        **sampling_options(req), top_logprobs=req.logprobs,
        echo=req.echo and req.logprobs is not None, ignore_eos=req.ignore_eos,
        default_max_new_tokens=default_max_tokens)


def start_generations(lm: LM, req: CompletionRequest, default_max_tokens: int) -> list[Generation]:
    """One :class:`Generation` per (prompt, choice), prompt-major (OpenAI's choice order); the choices of a prompt
    share its prefill (:meth:`LM.start_choices`). Raises RequestError before anything runs."""
    options = generation_options(req, default_max_tokens)
    prompts = split_prompts(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise RequestError(f"{len(prompts)} prompts × n = {req.n} asks for {len(prompts) * req.n} completions in one "
                           f"request; at most {MAX_CHOICES} are allowed (they share one concurrency slot)", param="n",
                           code="too_many_completions")
    return [g for p in prompts for g in lm.start_choices(p, req.n, req.max_tokens, **options)]


def prompt_usage(gens: Sequence[Generation], n: int) -> int:
    """Prompt tokens of a request: each prompt once, whatever ``n``."""
    return sum(g.prompt_tokens for g in gens[::n])


def empty_lists() -> dict[str, list]:
    """OpenAI's logprobs object with no tokens."""
    return {k: [] for k in EMPTY_LISTS}


def echo_part(lm: LM, gen: Generation, with_logprobs: bool) -> tuple[str, dict[str, list] | None]:
    """The echoed prompt: its text, and (with logprobs) its tokens' OpenAI logprobs lists (the first token's
    log-prob and alternatives null, as OpenAI and vLLM return them)."""
    if gen.prompt is None:
        return lm.detokenize(gen.prompt_ids), (empty_lists() if with_logprobs else None)
    p = gen.prompt
    if not with_logprobs:
        return p.text, None
    # OpenAI and vLLM: the first prompt token has no log-prob (null), the rest are scored after what precedes them
    # (here the first is scored after the internal <|endoftext|>; LM.score and /v1/score keep that number)
    logprobs: list[float | None] = [None, *p.logprobs[1:]] if p.logprobs else []
    tops: list[dict | None] = [None, *(p.top_logprobs or [{} for _ in p.tokens])[1:]] if p.tokens else []
    return p.text, {"tokens": p.tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": p.text_offset}


def logprob_lists(lm: LM, chunk: Chunk, offset: int) -> dict[str, list]:
    """OpenAI logprobs lists for a chunk's tokens; ``text_offset`` shifted by ``offset`` characters."""
    return {"tokens": lm.token_strings(chunk.token_ids), "token_logprobs": chunk.logprobs,
            "top_logprobs": chunk.top_logprobs or [{} for _ in chunk.token_ids],
            "text_offset": [o + offset for o in chunk.text_offset]}


def end_of_text_lists(gen: Generation, offset: int) -> dict[str, list] | None:
    """The end-of-text a choice stopped at, as one more logprobs entry (no text; at character ``offset``), as
    vLLM reports it: lm-evaluation-harness reads ``token_logprobs[ctxlen:-1]`` of an echo with ``max_tokens: 1``
    and so needs the generated step even when it is the end of the text. None when it did not stop there."""
    if gen.end_of_text is None:
        return None
    logprob, top = gen.end_of_text
    return {"tokens": [EOT], "token_logprobs": [logprob], "top_logprobs": [top or {}], "text_offset": [offset]}


def merge_lists(parts: Iterable[dict[str, list] | None]) -> dict[str, list] | None:
    """Concatenate logprobs objects (None parts skipped; None when all are)."""
    out: dict[str, list] | None = None
    for p in parts:
        if p is None:
            continue
        out = out or {k: [] for k in p}
        for k, v in p.items():
            out[k].extend(v)
    return out


def choice_dict(index: int, text: str, logprobs: dict[str, list] | None, finish_reason: str | None) -> dict:
    """One entry of ``choices`` (``finish_reason`` null unless "stop" or "length")."""
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason if finish_reason in ("stop", "length") else None}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(lm: LM, req: CompletionRequest, gens: Sequence[Generation],
                    chunks: Mapping[int, Sequence[Chunk]], meta: dict) -> dict:
    """The non-streamed response body of a finished run (``chunks[i]``: the chunks choice ``i`` produced)."""
    with_lp = req.logprobs is not None
    choices, completion_tokens = [], 0
    for i, gen in enumerate(gens):
        comp: Completion = LM.collect(gen, chunks.get(i, []))
        completion_tokens += comp.completion_tokens
        text, lists = echo_part(lm, gen, with_lp) if req.echo else ("", None)
        own = merge_lists(logprob_lists(lm, c, len(text)) for c in chunks.get(i, [])) if with_lp else None
        if with_lp and own is None:
            own = empty_lists()
        end = end_of_text_lists(gen, len(text) + len(comp.text)) if with_lp else None
        choices.append(choice_dict(i, text + comp.text, merge_lists([lists, own, end]), comp.finish_reason))
    return {**meta, "choices": choices, "usage": usage_dict(prompt_usage(gens, req.n), completion_tokens)}


class ResponseFormat:
    """An endpoint's response to one run of ``gens`` (one per choice, in choice order): the whole body, or the
    stream's events (JSON objects) — the opening ones of a choice, one per chunk, the closing one with the
    finish_reason, and the usage chunk (None when not asked). :func:`serve.http.runs.stream` calls them in
    order from one task."""

    def body(self, chunks: Mapping[int, Sequence[Chunk]]) -> dict:
        raise NotImplementedError

    def opening(self, index: int) -> list[dict]:
        return []

    def piece(self, index: int, chunk: Chunk) -> dict:
        raise NotImplementedError

    def closing(self, index: int) -> dict:
        raise NotImplementedError

    def usage_chunk(self) -> dict | None:
        return None


class CompletionFormat(ResponseFormat):
    """OpenAI's completions: ``text_completion`` bodies and chunks (``meta``: id, object, created, model)."""

    def __init__(self, lm: LM, req: CompletionRequest, gens: Sequence[Generation], meta: dict):
        self.lm, self.req, self.gens, self.meta = lm, req, gens, meta
        self.with_lp = req.logprobs is not None
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.offsets: dict[int, int] = {}  # choice → length of its echoed prompt text
        self.released: dict[int, int] = defaultdict(int)  # choice → characters of completion text sent

    def _event(self, index: int, text: str, lists: dict | None, finish: str | None = None) -> dict:
        usage = {"usage": None} if self.include_usage else {}
        return {**self.meta, "choices": [choice_dict(index, text, lists, finish)], **usage}

    def body(self, chunks: Mapping[int, Sequence[Chunk]]) -> dict:
        return completion_body(self.lm, self.req, self.gens, chunks, self.meta)

    def opening(self, index: int) -> list[dict]:
        self.offsets[index] = 0
        if not self.req.echo:
            return []
        text, lists = echo_part(self.lm, self.gens[index], self.with_lp)
        self.offsets[index] = len(text)
        return [self._event(index, text, lists)]

    def piece(self, index: int, chunk: Chunk) -> dict:  # chunk offsets count from the start of the completion
        self.released[index] += len(chunk.text)
        lists = logprob_lists(self.lm, chunk, self.offsets[index]) if self.with_lp else None
        return self._event(index, chunk.text, lists)

    def closing(self, index: int) -> dict:
        gen = self.gens[index]
        end = end_of_text_lists(gen, self.offsets[index] + self.released[index]) if self.with_lp else None
        return self._event(index, "", end, gen.finish_reason)

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        completion = sum(g.completion_tokens for g in self.gens)
        return {**self.meta, "choices": [], "usage": usage_dict(prompt_usage(self.gens, self.req.n), completion)}


def score_body(lm: LM, name: str, s: Score) -> ScoreResponse:
    """The /v1/score response of a :class:`serve.lm.Score`."""
    return ScoreResponse(model=name, text=s.text, token_ids=s.token_ids, tokens=lm.token_strings(s.token_ids),
                         token_nll=s.token_nll, nll_sum=s.nll_sum, nll_mean=s.nll_mean, chars=s.chars,
                         bits_per_char=s.bits_per_char)


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (UTF-8, no ASCII escaping)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n".encode()
