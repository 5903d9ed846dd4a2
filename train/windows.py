"""Token windows that carry their own loss mask: the one layout every training batch has.

A window is int64 ``[..., seq + 1]``: the inputs are its first ``seq`` tokens, the targets its last ``seq``
(next-token prediction). A position whose token is context only — seen as input, never a target (the prompt and
the turn headers of a fine-tuning conversation, its padding) — holds ``~id`` (= ``-id - 1``, always negative)
instead of ``id``. Pretraining windows hold no negative value, so for them this is the plain layout; one array
still travels through the loader, the micro-batch split, DDP ranks, preflight and evaluation unchanged, and
:func:`inputs` / :func:`labels` recover the model's arguments. Works on numpy arrays and torch tensors alike
(two's complement: ``w ^ (w >> 63)`` is ``~w`` for a negative ``w`` and ``w`` otherwise).
"""

from __future__ import annotations

IGNORE = -100  # the label of a position without loss (torch's cross_entropy ignore_index)


def context_only(ids):
    """``ids`` (non-negative int64, numpy or torch) marked as context only: ``~ids``."""
    return ~ids


def token_ids(w):
    """The token ids of windows ``w`` (every position, marks removed)."""
    return w ^ (w >> 63)


def inputs(w):
    """The model's input ids ``[..., seq]``: the first ``seq`` tokens of ``w``, marks removed."""
    return token_ids(w[..., :-1])


def labels(w):
    """The targets ``[..., seq]``: the last ``seq`` tokens of ``w``, :data:`IGNORE` where context only."""
    y = w[..., 1:]
    return y * (y >= 0) + IGNORE * (y < 0)


def target_count(w) -> int:
    """How many positions of ``w`` carry loss (targets not marked context only)."""
    return int((w[..., 1:] >= 0).sum())
