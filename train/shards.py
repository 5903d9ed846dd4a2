"""Token shard files: a 256-byte header, then token ids as little-endian uint16 or uint32.

Header layout (all little-endian)::

    offset  size  field
    0       8     magic  b"SHLKTOK1"
    8       4     header version (1)
    12      4     bytes per token: 2 (uint16) or 4 (uint32)
    16      8     number of tokens
    24      8     vocabulary size the ids were written for
    32      224   zero

The dtype is recorded in the header, never guessed by the reader (a uint16 cast wraps id 65536 to 0 silently:
huggingface/datatrove#118). :func:`dtype_for_vocab` picks uint16 when every id fits (vocab ≤ 65,536), else
uint32. The format is close to llm.c's ``.bin`` shards, with the dtype and vocabulary added.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"SHLKTOK1"
HEADER_BYTES = 256
HEADER_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")


class ShardError(ValueError):
    """A shard file that is missing, truncated or not a Shalik shard."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id < vocab_size fits in 16 bits (vocab_size ≤ 65,536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size: expected a positive integer, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Append token ids to a shard file; :meth:`close` writes the final header.

    Ids are checked against ``vocab_size`` (a ValueError names the first id out of range) so a wrong dtype can
    never truncate them. Write to a temporary path and rename it yourself for atomicity.
    """

    def __init__(self, path: str | Path, vocab_size: int):
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.tokens = 0
        self._f = open(self.path, "wb")
        self._f.write(b"\0" * HEADER_BYTES)

    def write(self, ids) -> None:
        """Append ``ids`` (any integer sequence or array)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside [0, {self.vocab_size}) for shard {self.path}")
        self._f.write(arr.astype(self.dtype.newbyteorder("<")).tobytes())
        self.tokens += int(arr.size)

    def close(self) -> None:
        """Write the header and fsync."""
        self._f.seek(0)
        self._f.write(_HEADER.pack(MAGIC, HEADER_VERSION, self.dtype.itemsize, self.tokens, self.vocab_size))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def write_shard(path: str | Path, ids, vocab_size: int) -> int:
    """Write one shard holding ``ids``; returns the token count."""
    with ShardWriter(path, vocab_size) as w:
        w.write(ids)
    return w.tokens


def read_header(path: str | Path) -> dict:
    """``{dtype, tokens, vocab_size}`` from a shard's header. Raises ShardError for a file that is not a
    complete Shalik shard."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"shard {p}: cannot be read ({e})") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"shard {p}: truncated header ({len(raw)} of {HEADER_BYTES} bytes)")
    magic, version, width, tokens, vocab = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ShardError(f"shard {p}: not a Shalik token shard (magic {magic!r}, expected {MAGIC!r})")
    if version != HEADER_VERSION or width not in (2, 4):
        raise ShardError(f"shard {p}: unsupported header (version {version}, {width} bytes per token)")
    expected = HEADER_BYTES + tokens * width
    size = p.stat().st_size
    if size != expected:
        raise ShardError(f"shard {p}: {size} bytes, expected {expected} for {tokens} tokens of {width} bytes")
    return {"dtype": np.dtype("<u2") if width == 2 else np.dtype("<u4"), "tokens": tokens, "vocab_size": vocab}


def open_shard(path: str | Path) -> np.ndarray:
    """Memory-map a shard's tokens read-only (a 1-D uint16 or uint32 array, dtype from the header)."""
    h = read_header(path)
    if h["tokens"] == 0:
        return np.zeros(0, dtype=h["dtype"])
    return np.memmap(path, dtype=h["dtype"], mode="r", offset=HEADER_BYTES, shape=(h["tokens"],))
