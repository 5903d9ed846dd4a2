"""The backend interface that every serving backend implements (numpy in, numpy out; no torch).

A backend holds the weights; a :class:`Sequence` holds one sequence's KV cache. `serve` drives
generation one token at a time through this interface, so a backend needs only:

* ``backend.vocab_size`` (int), ``backend.max_position_embeddings`` (int, the context length),
  ``backend.name`` (``"onnx"`` or ``"rust"``);
* ``backend.new_sequence() -> Sequence``: an empty KV cache (position 0);
* ``seq.prefill(ids, all_logits=False)``: append ``ids`` (a non-empty list of ints) to the cache and
  return float32 logits: shape ``[len(ids), vocab_size]`` when ``all_logits`` else ``[vocab_size]``
  (the last position's);
* ``seq.decode(token_id) -> float32 [vocab_size]``: one cached step;
* ``seq.position`` (int): how many tokens the cache holds.

Errors: a position past ``max_position_embeddings`` or an id outside ``[0, vocab_size)`` raises
:class:`BackendError` (a ``ValueError``) naming the number and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import numpy as np

from contract.quant import Scheme
from serve.checks import check_fits, check_token_ids


class BackendError(ValueError):
    """A request the backend cannot compute (id out of range, position past the context, ...)."""


class Sequence(Protocol):
    """One sequence's KV cache inside a backend."""

    position: int

    def prefill(self, ids: Seq[int], all_logits: bool = False) -> np.ndarray:
        """Append ``ids`` to the cache; float32 logits ``[len(ids), V]`` or ``[V]``."""
        ...

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; float32 logits ``[V]`` for the next position."""
        ...


class Backend(Protocol):
    """Weights plus a factory of KV caches."""

    name: str
    vocab_size: int
    max_position_embeddings: int

    def new_sequence(self) -> Sequence:
        """An empty KV cache at position 0."""
        ...


def check_scheme(quantize: object) -> Scheme | None:
    """A backend's ``quantize``: a :class:`contract.quant.Scheme` parsed at the boundary (``serve.load``, the
    server's settings) or None (float32). TypeError for anything else, a name included: a backend never parses
    one (``contract.quant.parse`` does)."""
    if quantize is None or isinstance(quantize, Scheme):
        return quantize
    raise TypeError(f"quantize is {quantize!r}; expected a contract.quant.Scheme or None (contract.quant.parse "
                    "reads a name)")


def check_ids(ids: Seq[int], vocab_size: int, position: int, context: int) -> list[int]:
    """Validate a list of token ids about to enter a cache at ``position`` (:mod:`serve.checks`).

    Returns the ids as a list of Python ints. Raises :class:`BackendError` when the list is empty,
    an id is not an int or lies outside ``[0, vocab_size)``, or ``position + len(ids)`` exceeds ``context``.
    """
    out = check_token_ids(ids, vocab_size, error=BackendError)
    check_fits(position, len(out), context, error=BackendError)
    return out
