"""Words, normalised text and n-gram hashes: what deduplication and decontamination compare.

Normalisation (the "normalised text" of exact deduplication, the words of MinHash, decontamination and the
Gopher rules): ZWJ/ZWNJ (U+200C/D) are removed (র‍্য and র্য compare equal), every code point is lowercased
(``str.lower`` where it gives one code point), and a word is a maximal run of word code points — ``str.isalnum``,
``_`` and the whole Bengali block U+0980–U+09FF, so vowel signs, virama and nukta stay inside their word.
Punctuation (``।``, ``॥``, quotes, dashes), whitespace and symbols are boundaries and never make two texts differ.

Everything runs on the text's code points in numpy, with no Python string per word. Hashes are 64-bit and fixed
across processes and runs (no ``hash()``): a word's is the polynomial ``Σ c_j·P^j mod 2⁶⁴`` of its code points
(from prefix sums: ``(S[end] − S[start])·P^(−start)``, P odd so invertible mod 2⁶⁴) finished by the splitmix64
mixer (Steele et al. 2014) with its length; an n-gram's is a polynomial of its words' hashes, mixed the same way.
Exact deduplication's key is the BLAKE2b of a document's word hashes.
"""

from __future__ import annotations

import hashlib

import numpy as np

_P = np.uint64(0x100000001B3)  # FNV's 64-bit prime: odd, so it has an inverse modulo 2⁶⁴
_P_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_NG = np.uint64(0x9E3779B97F4A7C15)
_TABLES: dict = {}


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """(word code point: bool [0x110000], lowercase: uint32 [0x110000]); built once per process (~0.5 s), before
    the data workers fork (they inherit them)."""
    if not _TABLES:
        chars = list(map(chr, range(0x110000)))
        word = np.fromiter(map(str.isalnum, chars), dtype=bool, count=0x110000)
        word[ord("_")] = True
        word[0x0980:0x0A00] = True
        low = np.arange(0x110000, dtype=np.uint32)
        for i, ch in enumerate(chars):
            lo = ch.lower()
            if lo != ch and len(lo) == 1:
                low[i] = ord(lo)
        _TABLES.update(word=word, low=low)
    return _TABLES["word"], _TABLES["low"]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    have = _TABLES.get("pow")
    if have is None or len(have[0]) < n + 1:
        m = max(n + 1, 1 << 16, 2 * len(have[0]) if have is not None else 0)
        with np.errstate(over="ignore"):
            p = np.cumprod(np.full(m, _P, dtype=np.uint64))
            q = np.cumprod(np.full(m, _P_INV, dtype=np.uint64))
        p = np.concatenate([[np.uint64(1)], p[:-1]])
        q = np.concatenate([[np.uint64(1)], q[:-1]])
        _TABLES["pow"] = have = (p, q)
    return have


def prepare_tables(n: int = 1 << 16) -> None:
    """Build the lookup tables now, the powers for texts of ``n`` code points (in the parent, so forked workers
    share them)."""
    _tables()
    _powers(n)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014) on uint64 arrays, elementwise, wrapping."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def word_spans(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(hashes uint64, lengths int64, code points uint32)`` of the normalised words of ``text``: one hash and
    one length (in code points) per word, in order; the normalised code points (lowercased, joiners removed)."""
    word, low = _tables()
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    if "\u200c" in text or "\u200d" in text:
        cps = cps[(cps != 0x200C) & (cps != 0x200D)]
    cps = low[cps]
    h, lengths, _ = _hash_words(cps, word[cps])
    return h, lengths, cps


def word_spans_many(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`word_spans` of many texts in one pass: ``(hashes uint64, lengths int64, offsets int64
    [len(texts) + 1])``, text ``i``'s words being ``[offsets[i]:offsets[i + 1]]`` — the same values as one text
    at a time (a word's hash does not depend on its place; the texts are joined by a line break, never part of a
    word)."""
    word, low = _tables()
    joined = "\n".join(texts)
    cps = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    seps = np.cumsum(np.fromiter((len(t) + 1 for t in texts[:-1]), dtype=np.int64, count=max(len(texts) - 1, 0))) - 1
    if "\u200c" in joined or "\u200d" in joined:
        keep = (cps != 0x200C) & (cps != 0x200D)
        seps = np.cumsum(keep)[seps] - 1  # each separator's place once the joiners are gone
        cps = cps[keep]
    cps = low[cps]
    h, lengths, starts = _hash_words(cps, word[cps])
    offsets = np.concatenate(([0], np.searchsorted(starts, seps), [len(h)])).astype(np.int64)
    return h, lengths, offsets[:len(texts) + 1] if texts else np.zeros(1, np.int64)


def _hash_words(cps: np.ndarray, isw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hashes, lengths, start positions) of the runs of word code points of normalised ``cps``."""
    if not isw.any():
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(isw[1:] > isw[:-1]) + 1  # a word code point after a boundary
    ends = np.flatnonzero(isw[:-1] > isw[1:]) + 1
    if isw[0]:
        starts = np.concatenate(([0], starts))
    if isw[-1]:
        ends = np.concatenate((ends, [len(isw)]))
    p, q = _powers(len(cps))
    with np.errstate(over="ignore"):
        s = np.concatenate([[np.uint64(0)], np.cumsum(cps.astype(np.uint64) * p[:len(cps)], dtype=np.uint64)])
        h = (s[ends] - s[starts]) * q[starts]
        lengths = (ends - starts).astype(np.int64)
        return splitmix64(h + lengths.astype(np.uint64)), lengths, starts


def words(text: str) -> list[str]:
    """The normalised words of ``text`` as strings (for tests and reports; the pipeline uses :func:`word_spans`)."""
    word, low = _tables()
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    cps = low[cps[(cps != 0x200C) & (cps != 0x200D)]]
    s = cps.astype("<u4").tobytes().decode("utf-32-le")
    out, cur = [], []
    for ch, w in zip(s, word[cps].tolist()):
        if w:
            cur.append(ch)
        elif cur:
            out.append("".join(cur))
            cur = []
    if cur:
        out.append("".join(cur))
    return out


def words_hash(wh: np.ndarray) -> int:
    """64-bit key of a normalised text from its word hashes (exact deduplication), a Python int."""
    return int.from_bytes(hashlib.blake2b(wh.astype("<u8").tobytes(), digest_size=8).digest(), "little")


def text_hash(text: str) -> int:
    """:func:`words_hash` of ``text``'s words."""
    return words_hash(word_spans(text)[0])


class NgramHashes:
    """The n-gram hashes of one document for every n up to ``max_n``, built incrementally (an (n+1)-gram's
    polynomial is the n-gram's times the multiplier plus the next word): ``get(n)`` equals
    :func:`ngram_hashes` ``(wh, n)`` for n ≤ ``len(wh)``."""

    def __init__(self, wh: np.ndarray, max_n: int):
        self.wh = wh
        self.m = len(wh)
        self.raw: dict[int, np.ndarray] = {}
        self.done: dict[int, np.ndarray] = {}
        if self.m == 0:
            return
        h = wh.copy()
        self.raw[1] = h
        with np.errstate(over="ignore"):
            for k in range(2, min(max_n, self.m) + 1):
                h = h[:-1] * _NG + wh[k - 1:]
                self.raw[k] = h

    def get(self, n: int) -> np.ndarray:
        """The hashes of every run of ``n`` words (one of all words when the document is shorter)."""
        if self.m == 0:
            return np.zeros(0, dtype=np.uint64)
        n = min(n, self.m)
        if n not in self.done:
            self.done[n] = splitmix64(self.keys(n))
        return self.done[n]

    def keys(self, n: int) -> np.ndarray:
        """Values equal exactly where :meth:`get` ``(n)``'s are (the mixer is a bijection), without mixing:
        for counting repeats."""
        if self.m == 0:
            return np.zeros(0, dtype=np.uint64)
        n = min(n, self.m)
        if n not in self.raw:
            self.raw[n] = _poly(self.wh, n)
        return self.raw[n]


class ChunkNgrams:
    """The n-gram keys of many documents' words at once (``wh``: their word hashes back to back, ``offsets``:
    :func:`word_spans_many`'s), for every n up to ``max_n``; :meth:`doc` gives one document's n-grams as an
    :class:`NgramHashes` would (views into the chunk's arrays), and :meth:`windows` the n-grams that lie inside
    one document, for all documents."""

    def __init__(self, wh: np.ndarray, offsets: np.ndarray, max_n: int, premix: tuple[int, ...] = ()):
        self.all = NgramHashes(wh, max_n)
        self.offsets = offsets
        self.mixed = {n: splitmix64(self.all.keys(n)) for n in premix if n <= self.all.m}  # get(n), sliced

    def doc(self, i: int) -> NgramHashes:
        """Document ``i``'s :class:`NgramHashes` (the same values as built from its words alone)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        out = NgramHashes.__new__(NgramHashes)
        out.wh, out.m = self.all.wh[a:b], b - a
        out.raw = {k: v[a:b - k + 1] for k, v in self.all.raw.items() if k <= b - a}
        out.done = {k: v[a:b - k + 1] for k, v in self.mixed.items() if k <= b - a}
        return out

    def windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(mixed hashes uint64, document int64)`` of every run of ``n`` words inside one document, in order
        (a document shorter than ``n`` words has none)."""
        m = self.all.m
        if m < n:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        counts = np.diff(self.offsets)
        doc = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        inside = np.flatnonzero(doc[:m - n + 1] == doc[n - 1:])
        return splitmix64(self.all.keys(n)[inside]), doc[inside]


def _poly(wh: np.ndarray, n: int) -> np.ndarray:
    m = len(wh)
    with np.errstate(over="ignore"):
        h = wh[:m - n + 1].copy()
        for k in range(1, n):
            h = h * _NG + wh[k:m - n + 1 + k]
    return h


def ngram_hashes(wh: np.ndarray, n: int) -> np.ndarray:
    """uint64 hashes of every run of ``n`` consecutive words (``len(wh) - n + 1`` of them; a document shorter
    than ``n`` words gives one hash of all its words, none when it has no words). ``wh``: word hashes."""
    m = len(wh)
    if m == 0:
        return np.zeros(0, dtype=np.uint64)
    return splitmix64(_poly(wh, min(n, m)))
