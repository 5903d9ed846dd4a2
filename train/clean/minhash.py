"""MinHash signatures and LSH band keys over word n-grams, in numpy (Broder 1997; Leskovec et al., "Mining of
Massive Datasets", ch. 3).

Each of ``num_perm`` hash functions is multiply-shift (Dietzfelbinger et al. 1997): ``h_j(x) = (a_j·x mod 2⁶⁴)
>> 32`` with odd ``a_j`` drawn from a fixed seed; a document's signature is the minimum of each over its n-gram
hashes (:mod:`train.clean.text`), uint32 (the minimum of the 64-bit products shifted: the same value, one pass
fewer). The signature is split into ``bands`` bands of
``rows`` values; a band's key is a 64-bit hash of its values and its index. Two documents whose Jaccard
similarity is ``s`` share at least one band key with probability ``1 − (1 − s^rows)^bands``. The same text gives
the same signature in any process, run or machine (no ``hash()``, no randomness outside the seed).
"""

from __future__ import annotations

import numpy as np

from train.clean.text import splitmix64

SEED = 20240601
_BLOCK = 4096  # n-grams per block of the (n-grams × permutations) product: bounded memory for long documents


def permutations(num_perm: int, seed: int = SEED) -> np.ndarray:
    """uint64 array of ``num_perm`` odd multipliers."""
    rng = np.random.Generator(np.random.PCG64(seed))
    with np.errstate(over="ignore"):
        return rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def signature(shingles: np.ndarray, a: np.ndarray) -> np.ndarray:
    """uint32 ``[num_perm]`` MinHash of a set of uint64 n-gram hashes (all 0xFFFFFFFF for an empty set);
    repeated hashes do not change it."""
    sig = np.full(len(a), np.iinfo(np.uint64).max, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, len(shingles), _BLOCK):
            np.minimum(sig, (shingles[i:i + _BLOCK, None] * a[None, :]).min(axis=0), out=sig)
    return (sig >> np.uint64(32)).astype(np.uint32)


def signatures(shingles: list[np.ndarray], a: np.ndarray, block: int = 8192) -> np.ndarray:
    """uint32 ``[documents, num_perm]``: :func:`signature` of each document's n-gram hashes, computed for many
    documents at once: the n-grams of all documents back to back, ``block`` at a time, multiplied into one
    reused ``[num_perm, block]`` buffer (each row one multiplier times contiguous n-grams, so each document's
    minimum is a reduction along contiguous memory), reduced per document and folded into the result."""
    n, p = len(shingles), len(a)
    out = np.full((p, n), np.iinfo(np.uint64).max, dtype=np.uint64)
    lens = np.fromiter((len(s) for s in shingles), dtype=np.int64, count=n)
    if lens.sum():
        flat = np.concatenate(shingles).astype(np.uint64, copy=False)
        doc = np.repeat(np.arange(n, dtype=np.int64), lens)
        buf = np.empty((p, min(block, len(flat))), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(0, len(flat), block):
                x, d = flat[i:i + block], doc[i:i + block]
                prod = buf[:, :len(x)]
                np.multiply(a[:, None], x[None, :], out=prod)
                starts = np.flatnonzero(np.concatenate(([True], d[1:] != d[:-1])))
                ids = d[starts]  # distinct: a document's n-grams are consecutive
                out[:, ids] = np.minimum(out[:, ids], np.minimum.reduceat(prod, starts, axis=1))
    return np.ascontiguousarray((out >> np.uint64(32)).astype(np.uint32).T)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 ``[..., bands]``: one key per band of ``rows`` signature values of ``sig`` (``[..., num_perm]``),
    the band's index mixed in (a polynomial of the values, then splitmix64)."""
    raw = sig[..., :bands * rows].astype(np.uint64).reshape(*sig.shape[:-1], bands, rows)
    with np.errstate(over="ignore"):
        h = np.arange(bands, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
        for r in range(rows):
            h = h * np.uint64(0x100000001B3) + raw[..., r]
        return splitmix64(h)



def estimated_jaccard(s1: np.ndarray, s2: np.ndarray) -> float:
    """The share of equal signature values: an unbiased estimate of the Jaccard similarity of the two sets."""
    return float(np.mean(s1 == s2))
