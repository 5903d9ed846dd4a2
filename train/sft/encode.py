"""A conversation as token ids with its loss mask, and padded windows of conversations.

Ids are ``[<|endoftext|>] + encode(render(messages))`` (:mod:`contract.chat_format`: the ids the server and every
other runtime give the same conversation). The loss mask comes from the tokenizer's character offsets of that
whole rendered text: a token carries loss when it starts inside an assistant span (the reply and the
``<|im_end|>`` that closes it, :func:`contract.chat_format.assistant_spans`). Pieces are never encoded separately,
so the ids are exactly those a runtime sees. (A tokenizer without the chat tokens gets them from
``train.tokenizer.add_chat_tokens``.)
"""

from __future__ import annotations

import numpy as np

from contract.chat_format import assistant_spans
from train import windows as W


def encode_conversation(tok, messages: list[dict], eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 ``[n]``, loss mask bool ``[n]``) of a conversation (see the module doc). Raises
    ChatFormatError for messages that cannot be rendered."""
    return encode_conversations(tok, [messages], eot_id)[0]


def encode_conversations(tok, conversations: list[list[dict]], eot_id: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`encode_conversation` of many, the texts encoded in one ``encode_batch`` (the tokenizer's threads)."""
    rendered = [assistant_spans(m) for m in conversations]
    encs = tok.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    return [_with_mask(enc, spans, eot_id) for enc, (_, spans) in zip(encs, rendered, strict=True)]


def _with_mask(enc, spans: list[tuple[int, int]], eot_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray([eot_id, *enc.ids], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return ids, np.concatenate([[False], mask])


def to_window(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A :mod:`train.windows` window: ``ids`` where ``mask``, context-only marks elsewhere."""
    return np.where(mask, ids, W.context_only(ids))


def pad_windows(rows: list[np.ndarray], pad_id: int, multiple: int = 8, limit: int | None = None) -> np.ndarray:
    """Right-pad windows of different lengths with context-only ``pad_id`` to one length: the longest, rounded
    up to ``multiple`` (at most ``limit``). A right pad changes nothing before it under causal attention, so no
    attention mask is needed; it adds no loss."""
    n = max(len(r) for r in rows)
    n = -(-n // multiple) * multiple
    if limit is not None:
        n = min(n, limit)
    out = np.full((len(rows), n), W.context_only(np.int64(pad_id)), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
