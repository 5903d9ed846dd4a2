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
from train.clean.text import NgramHashes, ngram_hashes, word_spans, words_hash
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
    grams: list[np.ndarray] = []
    shingles: list[np.ndarray] = []
    if s.enabled:
        for i, d in enumerate(docs):
            wh, wl, _ = word_spans(d.text)
            ng = NgramHashes(wh, DECONTAM_N)
            fails[i] = quality.failure_mask(quality.features(d.text, wh, wl, s.rules, d.lang, ng), s.rules, d.lang)
            th[i] = words_hash(wh)
            shingles.append(ng.get(s.ngram))
            g = ng.get(DECONTAM_N) if len(wh) >= DECONTAM_N else np.zeros(0, np.uint64)
            grams.append(g)
            counts[i] = len(g)
            for k, table in s.eval_grams.items():
                if len(wh) >= k and len(table):
                    h = ng.get(k)
                    h = h[s.eval_filter[h & _MASK]]  # a bitmap of the table's low bits first: few get past it
                    if len(h):
                        at = np.minimum(np.searchsorted(table, h), len(table) - 1)
                        if (table[at] == h).any():
                            hit[i] = True
                            break
        sigs = minhash.signatures(shingles, s.a)
        bands = minhash.band_keys(sigs, s.bands, s.rows)
    return CleanPart(works, heads, fails, th, bands, sigs,
                     np.concatenate(grams) if grams else np.zeros(0, np.uint64), counts, hit,
                     time.perf_counter() - t0)


_MASK = np.uint64((1 << 20) - 1)  # a 1 MB bitmap (cache-sized) of the evaluation n-grams: a prefilter only


def _bitmap(tables: dict) -> np.ndarray:
    bits = np.zeros(int(_MASK) + 1, dtype=bool)
    for t in tables.values():
        bits[(t & _MASK).astype(np.int64)] = True
    return bits


def eval_ngrams(texts: list[str]) -> dict[int, np.ndarray]:
    """``{n: sorted distinct uint64}`` of evaluation texts: the 13-grams of each, and of a text of 8 to 12 words
    its first 8 words (a document holding the text holds them)."""
    out: dict[int, list[np.ndarray]] = {}
    for t in texts:
        wh = word_spans(t)[0]
        if len(wh) >= DECONTAM_N:
            out.setdefault(DECONTAM_N, []).append(ngram_hashes(wh, DECONTAM_N))
        elif len(wh) >= EVAL_MIN_WORDS:
            out.setdefault(EVAL_MIN_WORDS, []).append(ngram_hashes(wh[:EVAL_MIN_WORDS], EVAL_MIN_WORDS))
    return {k: np.unique(np.concatenate(v)) for k, v in sorted(out.items())}
