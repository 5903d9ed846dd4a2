"""Token ids back to text, whole or incrementally, without a round trip through the tokenizer library.

A byte-level BPE vocabulary spells each token's bytes with GPT-2's printable alphabet
(:func:`bytes_to_unicode`: byte 0x20 is ``Ġ``, 0x0A is ``Ċ``, ...). :class:`TokenTable` maps every id to its
raw bytes (special tokens to their UTF-8 content), so

* ``decode(ids)`` is ``b"".join(bytes).decode("utf-8", "replace")``;
* :class:`StreamDecoder` feeds the same bytes one token at a time into a ``codecs`` incremental UTF-8
  decoder: a piece never ends inside a character, never holds a U+FFFD that the whole decode lacks, and the
  pieces plus :meth:`StreamDecoder.flush` concatenate to ``decode(ids)`` (case S6). An incomplete tail is held
  until completed; a truly invalid sequence comes out as U+FFFD (at the latest when flushed at the end).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterable, Mapping

from contract.byte_level import bytes_to_unicode  # the byte-level alphabet of our tokenizer


@functools.lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def display_token(raw: bytes) -> str:
    """How a token is shown in ``tokens`` / ``top_logprobs``: its text when its bytes are valid UTF-8 on
    their own, else OpenAI's ``bytes:\\xe0\\xa6`` spelling (so distinct tokens never share a string)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenTable:
    """id → raw bytes for a whole vocabulary.

    ``vocab`` maps token strings (byte-level alphabet) to ids; ``specials`` are token strings taken
    literally (their UTF-8 content), e.g. ``<|endoftext|>``. A token string with a character outside the
    byte-level alphabet is also taken literally. Ids without an entry decode to nothing.
    """

    def __init__(self, vocab: Mapping[str, int], specials: Iterable[str] = ()):
        specials = set(specials)
        u2b = unicode_to_bytes()
        size = max(vocab.values(), default=-1) + 1
        self._bytes: list[bytes] = [b""] * size
        for s, i in vocab.items():
            if s not in specials and all(c in u2b for c in s):
                self._bytes[i] = bytes(u2b[c] for c in s)
            else:
                self._bytes[i] = s.encode("utf-8")
        self._display: list[str] = [display_token(b) for b in self._bytes]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenTable:
        """Build from a ``tokenizers.Tokenizer`` (its vocabulary with added tokens; specials literal)."""
        added = tokenizer.get_added_tokens_decoder()
        return cls(tokenizer.get_vocab(with_added_tokens=True), [t.content for t in added.values()])

    def __len__(self) -> int:
        return len(self._bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one id (b"" for an id without an entry or out of range)."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def display(self, token_id: int) -> str:
        """The display string of one id (see :func:`display_token`)."""
        return self._display[token_id] if 0 <= token_id < len(self._display) else ""

    def decode(self, ids: Iterable[int]) -> str:
        """All ids to text: bytes joined, then decoded as UTF-8 with U+FFFD for invalid sequences."""
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", "replace")


class StreamDecoder:
    """Incremental detokenizer: ``push(id) -> str`` returns only complete characters; ``flush() -> str``
    ends the stream (an incomplete tail becomes U+FFFD). ``text`` is everything returned so far."""

    def __init__(self, table: TokenTable):
        self._table = table
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        """Feed one token; the newly completed characters (possibly "")."""
        return self._emit(self._dec.decode(self._table.token_bytes(int(token_id)), final=False))

    def flush(self) -> str:
        """End of stream: whatever the decoder still holds (U+FFFD for an incomplete sequence)."""
        return self._emit(self._dec.decode(b"", final=True))

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece
