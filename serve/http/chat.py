"""OpenAI's chat completions ↔ the Python API, as functions of their inputs (no I/O, no event loop).

A chat request is translated into the generation request completions make (:func:`start_chat_generations`:
the conversation rendered with the chat template into prompt ids, ``LM.start_chat``), so both backends and the
Rust engine run it unchanged; :class:`ChatFormat` turns the chunks into ``chat.completion`` bodies and
``chat.completion.chunk`` events (a first delta with the role, content deltas, a final delta with the
finish_reason), with log-probs in the chat form (``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from serve.errors import RequestError
from serve.generation import Generation
from serve.http.schemas import ChatCompletionRequest
from serve.http.translate import ResponseFormat, sampling_options, usage_dict
from serve.lm import LM
from serve.results import Chunk

_BYTES_DISPLAY = re.compile(r"\\x([0-9a-f]{2})")


def chat_options(req: ChatCompletionRequest, default_max_tokens: int) -> dict[str, Any]:
    """The keyword arguments of :meth:`serve.lm.LM.start_chat` for a request (OpenAI's defaults for absent
    fields; ``top_logprobs`` counts only with ``logprobs``)."""
    return dict(**sampling_options(req), top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                default_max_new_tokens=default_max_tokens)


def start_chat_generations(lm: LM, req: ChatCompletionRequest, default_max_tokens: int) -> list[Generation]:
    """The ``n`` generations of a chat request (one prefill of the rendered conversation). Raises RequestError
    before anything runs: a conversation the template refuses, one longer than the context, a model without
    chat tokens."""
    options = chat_options(req, default_max_tokens)
    messages = [m.model_dump(exclude={"name"}) for m in req.messages]
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    try:
        return lm.start_chat(messages, req.n, getattr(req, field), **options)
    except RequestError as e:  # the budget's errors name the field this request used
        if e.param == "max_tokens" and field != "max_tokens":
            e.param, e.message = field, e.message.replace("(max_tokens over HTTP)", f"({field} over HTTP)")
            e.args = (e.message,)
        raise


def token_bytes(display: str) -> list[int]:
    """The bytes of a token from its display string (``serve.detok.display_token``: text, or ``bytes:\\xe0..``)."""
    if display.startswith("bytes:"):
        return [int(h, 16) for h in _BYTES_DISPLAY.findall(display)]
    return list(display.encode("utf-8"))


def logprob_content(lm: LM, chunk: Chunk) -> list[dict]:
    """The chat form of a chunk's tokens: ``[{"token", "logprob", "bytes", "top_logprobs": [...]}]``."""
    out = []
    tops = chunk.top_logprobs or [{} for _ in chunk.token_ids]
    for token, lp, top in zip(lm.token_strings(chunk.token_ids), chunk.logprobs, tops, strict=True):
        alts = [{"token": t, "logprob": p, "bytes": token_bytes(t)} for t, p in (top or {}).items()]
        out.append({"token": token, "logprob": lp, "bytes": token_bytes(token), "top_logprobs": alts})
    return out


def finish(reason: str | None) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (null for anything else, e.g. a cancelled choice)."""
    return reason if reason in ("stop", "length") else None


class ChatFormat(ResponseFormat):
    """OpenAI's chat completions: ``chat.completion`` bodies and ``chat.completion.chunk`` events (``meta``: id,
    created, model)."""

    def __init__(self, lm: LM, req: ChatCompletionRequest, gens: Sequence[Generation], meta: dict):
        self.lm, self.req, self.gens, self.meta = lm, req, gens, meta
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def _usage(self) -> dict:
        prompt = self.gens[0].prompt_tokens if self.gens else 0
        return usage_dict(prompt, sum(g.completion_tokens for g in self.gens))

    def body(self, chunks: Mapping[int, Sequence[Chunk]]) -> dict:
        choices = []
        for i, gen in enumerate(self.gens):
            comp = LM.collect(gen, chunks.get(i, []))
            lp = None
            if self.req.logprobs:
                lp = {"content": [e for c in chunks.get(i, []) for e in logprob_content(self.lm, c)], "refusal": None}
            choices.append({"index": i, "message": {"role": "assistant", "content": comp.text, "refusal": None},
                            "logprobs": lp, "finish_reason": finish(comp.finish_reason)})
        return {**self.meta, "object": "chat.completion", "choices": choices, "usage": self._usage()}

    def _event(self, index: int, delta: dict, logprobs: dict | None = None, reason: str | None = None) -> dict:
        usage = {"usage": None} if self.include_usage else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self.meta, "object": "chat.completion.chunk", "choices": [choice], **usage}

    def opening(self, index: int) -> list[dict]:
        return [self._event(index, {"role": "assistant", "content": ""})]

    def piece(self, index: int, chunk: Chunk) -> dict:
        lp = {"content": logprob_content(self.lm, chunk), "refusal": None} if self.req.logprobs else None
        return self._event(index, {"content": chunk.text}, lp)

    def closing(self, index: int) -> dict:
        return self._event(index, {}, None, finish(self.gens[index].finish_reason))

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        return {**self.meta, "object": "chat.completion.chunk", "choices": [], "usage": self._usage()}
