"""The token-id and context-length checks, written once for the Python API, the HTTP server and the backends.

* :func:`check_token_ids`: every id an int (not a bool, not a float) in ``[0, vocab_size)``;
* :func:`check_fits`: ``position + count`` tokens fit the context (``max_position_embeddings``);
* :func:`new_token_budget`: how many tokens a request may generate after its prompt.

Each takes the exception class to raise (``RequestError`` for a request, ``BackendError`` inside a backend), so
the message is the same wherever the check fires.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from contract.bundle import EOT
from serve.errors import ContextLengthError, RequestError, shown


def check_token_ids(ids: Iterable, vocab_size: int, *, param: str | None = "prompt", allow_empty: bool = False,
                    error: type[ValueError] = RequestError) -> list[int]:
    """``ids`` as a list of Python ints, each in ``[0, vocab_size)``.

    Raises ``error`` (with ``param`` when it is a RequestError) for a non-integer, an id out of range, or an
    empty list unless ``allow_empty``."""
    def fail(message: str, code: str | None = None) -> ValueError:
        return error(message, param=param, code=code) if issubclass(error, RequestError) else error(message)

    if isinstance(ids, str | bytes | bytearray) or not isinstance(ids, Iterable):
        raise fail(f"token ids must be a list of integers, got {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise fail(f"token ids must be integers, got {shown(i)}")
        if not 0 <= int(i) < vocab_size:
            raise fail(f"token id {shown(int(i))} is out of range: expected 0 <= id < vocab_size = {vocab_size}",
                       "invalid_token_id")
        out.append(int(i))
    if not out and not allow_empty:
        raise fail("expected at least one token id, got an empty list")
    return out


def check_fits(position: int, count: int, context: int, error: type[ValueError] = RequestError) -> None:
    """Raise ``error`` when ``position`` cached + ``count`` new tokens exceed ``context``."""
    if position + count > context:
        raise error(f"sequence too long: {position} cached + {count} new = {position + count} tokens exceeds the "
                    f"context length {context}")


def new_token_budget(prompt_tokens: int, max_new_tokens: int | None, context: int, default: int) -> int:
    """How many tokens a request may generate.

    ``prompt_tokens`` includes the leading ``<|endoftext|>``. ``max_new_tokens=None`` means ``default`` capped by
    what the context leaves. An explicit value that does not fit raises :class:`ContextLengthError` with both
    numbers; so does a prompt longer than the context; a ``max_new_tokens`` that is not an int >= 0 raises
    RequestError (param ``max_tokens``), a ``default`` that is not one RequestError (param
    ``default_max_new_tokens``). A huge value is quoted by its number of digits (:func:`serve.errors.shown`)."""
    if isinstance(default, bool) or not isinstance(default, int | np.integer) or default < 0:
        raise RequestError(f"default_max_new_tokens must be an integer >= 0, got {shown(default)}",
                           param="default_max_new_tokens")
    if prompt_tokens > context:
        raise ContextLengthError(
            f"the prompt is {prompt_tokens} tokens (including the leading {EOT}), more than the context "
            f"length {context}", param="prompt")
    if max_new_tokens is None:
        return max(0, min(int(default), context - prompt_tokens))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 0:
        raise RequestError(f"max_new_tokens (max_tokens over HTTP) must be an integer >= 0, got "
                           f"{shown(max_new_tokens)}", param="max_tokens")
    if max_new_tokens > context - prompt_tokens:
        raise ContextLengthError(
            f"the prompt is {prompt_tokens} tokens (including the leading {EOT}) and max_new_tokens (max_tokens over "
            f"HTTP) asks for {shown(int(max_new_tokens))} more: {shown(prompt_tokens + int(max_new_tokens))} tokens "
            f"exceed the context length {context}")
    return int(max_new_tokens)
