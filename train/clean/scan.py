"""The per-document half of the cleaning stage, run in the data workers: features, hashes and n-grams.

:func:`scan_documents` turns one chunk's documents into a :class:`CleanPart`: per document its work key, the
bit mask of the quality rules it fails (all of them: the report says what each rule would drop), the hash of its
normalised text, its MinHash signature and LSH band keys, its distinct 13-gram hashes (for the validation side of
decontamination, decided after the pass) and whether it shares an n-gram with an evaluation item (known before
the pass: :class:`Settings` carries those n-grams). Nothing here depends on other chunks, so any number of
workers computes the same parts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from train.clean import minhash, quality
from train.clean.text import ChunkNgrams, splitmix64, word_spans_many, words_hash
from train.clean.works import work_key
from train.corpus import Document

# Near deduplication: MinHash of word NEAR_NGRAM-grams, NUM_PERM hashes in BANDS bands of ROWS, and a candidate
# pair kept when its estimated Jaccard similarity reaches NEAR_THRESHOLD. FineWeb uses 5-grams in 14 bands of 8,
# which misses copies with words edited here and there (a single edit changes five 5-grams); the choice below was
# measured against FineWeb's by benchmarks/clean_planted.py (benchmarks/results/cleaning.md).
NEAR_NGRAM = 3
NUM_PERM = 112
BANDS, ROWS = 37, 3
NEAR_THRESHOLD = 0.4
DECONTAM_N = 13  # GPT-3 / lm-eval's contamination n-gram
EVAL_MIN_WORDS = 8  # an evaluation text shorter than DECONTAM_N words is matched whole when it has at least this many
HEAD_CHARS = 80
STEPS = ("exact_dup", "near_dup", "decontam")  # the rules besides the quality rules, switched off by the same key


@dataclass
class Settings:
    """What a worker needs: ``enabled`` (data.clean), the quality :class:`~train.clean.quality.Rules`, the
    steps switched off, and the evaluation n-grams ``{n: sorted uint64}``."""

    enabled: bool
    rules: quality.Rules
    off: tuple[str, ...] = ()
    eval_grams: dict = field(default_factory=dict)
    ngram: int = NEAR_NGRAM
    num_perm: int = NUM_PERM
    bands: int = BANDS
    rows: int = ROWS
    threshold: float = NEAR_THRESHOLD

    def __post_init__(self) -> None:
        self.a = minhash.permutations(self.num_perm)
        self.eval_filter = _bitmap(self.eval_grams)

    def near_params(self) -> dict:
        """The near-deduplication parameters (fingerprint and report)."""
        return {"ngram": self.ngram, "num_perm": self.num_perm, "bands": self.bands, "rows": self.rows,
                "threshold": self.threshold}


@dataclass
class CleanPart:
    """One chunk's documents (those of the configured languages, in reading order)."""

    works: list[str]
    heads: list[str]
    fails: np.ndarray  # uint32 [docs]
    text_hash: np.ndarray  # uint64 [docs]
    bands: np.ndarray  # uint64 [docs, bands]
    sigs: np.ndarray  # uint32 [docs, num_perm]
    grams: np.ndarray  # uint64: each document's distinct 13-grams, back to back
    gram_counts: np.ndarray  # int64 [docs]
    eval_hit: np.ndarray  # bool [docs]
    seconds: float


def scan_documents(docs: list[Document], s: Settings) -> CleanPart:
    """The :class:`CleanPart` of ``docs`` (all arrays empty but ``works``/``heads`` when cleaning is off)."""
    t0 = time.perf_counter()
    n = len(docs)
    works = [work_key(d.text, d.source, d.title, d.author, d.work) for d in docs]
    heads = [d.text[:HEAD_CHARS] for d in docs]
    fails = np.zeros(n, dtype=np.uint32)
    th = np.zeros(n, dtype=np.uint64)
    bands = np.zeros((n, s.bands), dtype=np.uint64)
    sigs = np.zeros((n, s.num_perm), dtype=np.uint32)
    counts = np.zeros(n, dtype=np.int64)
    hit = np.zeros(n, dtype=bool)
    grams = np.zeros(0, np.uint64)
    if s.enabled:
        wh_all, wl_all, off = word_spans_many([d.text for d in docs])
        chunk = ChunkNgrams(wh_all, off, DECONTAM_N, premix=(s.ngram,))
        shares = quality.ngram_chars(chunk, wl_all)
        shingles = []
        for i, d in enumerate(docs):
            a, b = off[i], off[i + 1]
            wh = wh_all[a:b]
            mine = {k: int(v[i]) for k, v in shares.items()}
            fails[i] = quality.failure_mask(quality.features(d.text, wh, wl_all[a:b], s.rules, d.lang, mine), s.rules,
                                            d.lang)
            th[i] = words_hash(wh)
            shingles.append(chunk.doc(i).get(s.ngram))
        grams, gram_doc = chunk.windows(DECONTAM_N)
        counts = np.bincount(gram_doc, minlength=n).astype(np.int64)
        for k, table in s.eval_grams.items():
            if not len(table):
                continue
            h, hd = chunk.windows(k) if k != DECONTAM_N else (grams, gram_doc)
            cand = np.flatnonzero(s.eval_filter[h & _MASK])  # a bitmap of the table's low bits first: few get past
            at = np.minimum(np.searchsorted(table, h[cand]), len(table) - 1)
            hit[hd[cand[table[at] == h[cand]]]] = True
        sigs = minhash.signatures(shingles, s.a)
        bands = minhash.band_keys(sigs, s.bands, s.rows)
    return CleanPart(works, heads, fails, th, bands, sigs, grams, counts, hit, time.perf_counter() - t0)


_MASK = np.uint64((1 << 20) - 1)  # a 1 MB bitmap (cache-sized) of the evaluation n-grams: a prefilter only


def _bitmap(tables: dict) -> np.ndarray:
    bits = np.zeros(int(_MASK) + 1, dtype=bool)
    for t in tables.values():
        bits[(t & _MASK).astype(np.int64)] = True
    return bits


def eval_ngrams(texts: list[str]) -> dict[int, np.ndarray]:
    """``{n: sorted distinct uint64}`` of evaluation texts: the 13-grams of each, and of a text of 8 to 12 words
    its first 8 words (a document holding the text holds them)."""
    wh, _, off = word_spans_many(texts)
    chunk = ChunkNgrams(wh, off, DECONTAM_N)
    out = {}
    g, _ = chunk.windows(DECONTAM_N)
    if len(g):
        out[DECONTAM_N] = np.unique(g)
    counts = np.diff(off)
    short = off[:-1][(counts >= EVAL_MIN_WORDS) & (counts < DECONTAM_N)]
    if len(short):
        out[EVAL_MIN_WORDS] = np.unique(splitmix64(chunk.all.keys(EVAL_MIN_WORDS)[short]))
    return dict(sorted(out.items()))
