"""The facts of Shalik's byte-level BPE that readers of its tokens need: GPT-2's byte ↔ printable-character table
that the vocabulary spells its tokens with, and the special tokens.

Part of ``contract/`` (standard library only) so that ``serve/`` can decode tokens without loading the corpus
reader or the BPE trainer; ``train.tokenizer`` builds tokenizers from these facts and ``contract.bundle`` re-exports the
special tokens as part of the bundle contract.
"""

from __future__ import annotations

import functools

EOT = "<|endoftext|>"  # id 0: before every training document and every prompt; generation stops at it
PAD = "<|pad|>"  # id 1
SPECIAL_TOKENS = (EOT, PAD)  # in id order


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (256 entries) that byte-level BPE vocabularies spell tokens with
    (Radford et al. 2019, encoder.py; Hugging Face's ByteLevel uses the same table)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}
