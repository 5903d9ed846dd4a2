"""Errors raised by ``serve`` (no torch, no web framework).

* :class:`RequestError` (a ``ValueError``): the request itself is wrong — a parameter out of range, an empty
  prompt, a token id outside the vocabulary, a prompt plus ``max_new_tokens`` beyond the context. The HTTP
  server answers it with 400 and OpenAI's error body; ``param`` names the offending field when there is one.
* :class:`ContextLengthError`: the :class:`RequestError` for "too long for the context"; its message carries
  both numbers (tokens requested and the context length).
* :class:`ModelOutputError` (a ``RuntimeError``): the model produced logits that cannot be sampled (all
  ``-inf`` or NaN). That is a fault of the model, not of the request (HTTP 500).
* :class:`Cancelled`: work abandoned by its caller (a timeout, a client gone) stopped before its end.

:func:`shown` is how a message quotes a value it refuses (a huge integer by its number of digits).
"""

from __future__ import annotations

import sys

#: integers at least this large (in absolute value) are quoted by their number of digits
_SHOWN_LIMIT = 10**24


def shown(value: object) -> str:
    """``repr(value)`` for a message, except an integer of more than 24 digits: ``a 4300-digit number`` (Python
    refuses to format one of more than ``sys.get_int_max_str_digits()`` digits, and a message quoting it whole
    would be kilobytes long). Never raises."""
    if isinstance(value, int) and not isinstance(value, bool) and not -_SHOWN_LIMIT < value < _SHOWN_LIMIT:
        try:
            return f"a {len(str(abs(value)))}-digit number"
        except ValueError:  # more digits than Python formats
            return f"a number of more than {sys.get_int_max_str_digits()} digits"
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not replace the message
        return f"a {type(value).__name__}"


class RequestError(ValueError):
    """A request that cannot be served as given (HTTP 400).

    ``param`` is the name of the offending request field (``"temperature"``, ``"prompt"``, ...) or None;
    ``code`` is a short machine-readable reason (``"context_length_exceeded"``, ...) or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthError(RequestError):
    """Prompt plus requested new tokens exceed the model's context length (both numbers in the message)."""

    def __init__(self, message: str, param: str | None = "max_tokens"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelOutputError(RuntimeError):
    """The model returned logits that cannot be sampled: all ``-inf``, or NaN somewhere."""


class Cancelled(Exception):
    """Work stopped before its end because its caller abandoned it (:meth:`serve.lm.LM.score`'s ``cancel``)."""
