"""The tokenizer's training sample: train-split text balanced by language, chosen in one streaming pass.

Which documents: per language, the train documents with the lowest split hashes (``contract.text.split_value``),
up to the language's quota of characters (:func:`sample_quotas`), taken in reading order. The train documents are
the model's own training side when the cleaning stage's codes are given (``codes``: the validation split of whole
works, duplicates and contaminated documents excluded, :mod:`train.clean.decide`), so the tokenizer never sees
the text its model is validated on; else those whose split hash is at least ``val_fraction``. One pass over the corpus, parsed in parallel (``train.parallel``), with bounded memory: a
:class:`SampleSelector` keeps, per language, only the lowest-hash documents that can still be in the sample
(their characters are bounded by the largest possible quota), and tells the workers the hash above which a
document can no longer get in, so they send back ever fewer texts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from contract.text import split_value
from train.clean.decide import TRAIN
from train.corpus import Chunk, DataError, ReadReport, Skip, check_languages_present, iter_chunks, parse_chunk
from train.parallel import ordered_map


def sample_quotas(available: dict[str, int], weights: dict[str, float], sample_chars: int) -> dict[str, int]:
    """Characters to take per language: ``sample_chars`` split by ``weights``, scaled down uniformly when a
    language has fewer characters than its share so the ratio between languages holds.

    >>> sample_quotas({"bn": 7_000_000, "en": 9_000_000}, {"bn": 0.6, "en": 0.4}, 20_000_000)
    {'bn': 7000000, 'en': 4666666}
    """
    want = _wanted(list(available), weights, sample_chars)
    scale = min([1.0] + [available[lang] / want[lang] for lang in available if want[lang] > 0])
    return {lang: int(want[lang] * scale) for lang in available}


def _wanted(languages: list[str], weights: dict[str, float], sample_chars: int) -> dict[str, float]:
    total_w = sum(weights.get(lang, 0.0) for lang in languages)
    if total_w <= 0:
        return {lang: 0.0 for lang in languages}
    return {lang: sample_chars * weights.get(lang, 0.0) / total_w for lang in languages}


@dataclass
class _Kept:
    want: float
    chars: int = 0
    heap: list = field(default_factory=list)  # -key of every kept group (a max-heap)
    groups: dict = field(default_factory=dict)  # key → [(seq, text)] (equal texts share a key)

    def threshold(self) -> float:
        """Documents with a higher split hash can no longer be in the sample."""
        return -self.heap[0] if self.heap and self.chars >= self.want else float("inf")

    def add(self, key: float, seq: int, text: str) -> None:
        if key > self.threshold():
            return
        if key not in self.groups:
            self.groups[key] = []
            heapq.heappush(self.heap, -key)
        self.groups[key].append((seq, text))
        self.chars += len(text)
        while self.heap:  # drop the highest group while the lower ones alone cover the largest quota
            top = -self.heap[0]
            top_chars = sum(len(t) for _, t in self.groups[top])
            if self.chars - top_chars < self.want:
                break
            heapq.heappop(self.heap)
            del self.groups[top]
            self.chars -= top_chars


class SampleSelector:
    """Streams documents in and keeps what can still be in the sample (see the module doc)."""

    def __init__(self, languages: list[str], weights: dict[str, float], sample_chars: int,
                 codes: np.ndarray | None = None):
        self.weights, self.sample_chars = weights, sample_chars
        self.kept = {lang: _Kept(w) for lang, w in _wanted(languages, weights, sample_chars).items()}
        self.seen = {lang: 0 for lang in languages}
        self.available = {lang: 0 for lang in languages}
        self.codes = codes
        self._seq = 0
        self.documents = 0  # documents of the configured languages taken in so far (the index into ``codes``)

    def thresholds(self) -> dict[str, float]:
        """Per language, the split hash above which a train document cannot get into the sample any more."""
        return {lang: k.threshold() for lang, k in self.kept.items()}

    def add(self, part: _SampledChunk) -> None:
        """Take in one chunk's documents and candidates (chunks in reading order). Raises DataError when the
        chunk holds more documents than ``codes`` has (the corpus changed after the codes were decided)."""
        n = len(part.langs)
        if self.codes is not None and self.documents + n > len(self.codes):
            raise DataError(f"the corpus holds more documents than the cleaning stage decided on ({len(self.codes)}):"
                            " it changed while being read; run the command again")
        train = [not hashed_val if self.codes is None else self.codes[self.documents + j] == TRAIN
                 for j, hashed_val in enumerate(part.hashed_val)]
        for j, lang in enumerate(part.langs):
            self.seen[lang] += 1
            if train[j]:
                self.available[lang] += part.chars[j]
        for j, key, text in part.candidates:
            if train[j]:
                self.kept[part.langs[j]].add(key, self._seq, text)
                self._seq += 1
        self.documents += n

    def result(self) -> tuple[list[str], dict]:
        """``(texts in reading order, {lang: {"available", "sampled", "docs"}})``: per language the lowest-hash
        documents until the quota is reached (the one that crosses it included), and all documents of the last
        hash taken."""
        quotas = sample_quotas(self.available, self.weights, self.sample_chars)
        chosen: list[tuple[int, str]] = []
        stats = {}
        for lang, k in self.kept.items():
            taken = docs = 0
            thr = -1.0
            for key, n in sorted((key, len(t)) for key, group in k.groups.items() for _, t in group):
                if taken >= quotas[lang]:
                    break
                taken += n
                docs += 1
                thr = key
            chosen += [st for key, group in k.groups.items() if key <= thr for st in group]
            stats[lang] = {"available": self.available[lang], "sampled": taken, "docs": docs}
        return [t for _, t in sorted(chosen)], stats


@dataclass
class _SampledChunk:
    file_index: int
    nbytes: int
    warnings: list[str]
    langs: list[str]  # every document of the configured languages, in reading order
    chars: list[int]  # its characters
    hashed_val: list[bool]  # its split hash is below val_fraction
    candidates: list[tuple[int, float, str]]  # (index in langs, split hash, text) of documents under the threshold


_WORKER: dict = {}


def _init_worker(languages: list[str], val_fraction: float) -> None:
    _WORKER.update(languages=set(languages), val_fraction=val_fraction)


def _sample_chunk(task: tuple[Chunk | Skip, dict[str, float]]) -> _SampledChunk | Skip:
    chunk, thresholds = task
    if isinstance(chunk, Skip):
        return chunk
    docs, warnings = parse_chunk(chunk)
    part = _SampledChunk(chunk.file_index, chunk.nbytes, warnings, [], [], [], [])
    for d in docs:
        if d.lang not in _WORKER["languages"]:
            continue
        key = split_value(d.text)
        if key <= thresholds[d.lang]:
            part.candidates.append((len(part.langs), key, d.text))
        part.langs.append(d.lang)
        part.chars.append(len(d.text))
        part.hashed_val.append(key < _WORKER["val_fraction"])
    return part


def choose_sample(files: list[str], languages: list[str], weights: dict[str, float], sample_chars: int,
                  val_fraction: float, strict: bool = False, workers: int = 1,
                  unreadable: dict[str, str | None] | None = None,
                  report: ReadReport | None = None, codes: np.ndarray | None = None) -> tuple[list[str], dict]:
    """Read ``files`` once with ``workers`` processes and return ``(sample texts, stats)`` — see the module doc;
    ``stats`` = ``{lang: {"available": train chars, "sampled": chars, "docs": n}}``. ``codes``: the cleaning
    stage's code per document of ``languages`` in reading order (``train.clean.split.document_codes``); when given,
    the train documents are those coded ``TRAIN`` and ``val_fraction`` is not used.

    Raises DataError for a configured language without documents (naming what was skipped, and why), when the
    documents read are not the ones ``codes`` was decided on, or, in strict mode, for the first bad input.
    """
    report = report if report is not None else ReadReport()
    selector = SampleSelector(languages, weights, sample_chars, codes)
    tasks = ((c, selector.thresholds()) for c in iter_chunks(files, unreadable))  # thresholds as of submission
    bar = tqdm(desc="sampling for the tokenizer", unit="B", unit_scale=True, dynamic_ncols=True, mininterval=0.5,
               leave=False)
    with bar:
        for part in ordered_map(_sample_chunk, tasks, workers, _init_worker, (list(languages), val_fraction)):
            if isinstance(part, Skip):
                report.warn(part.message, strict)
                continue
            for w in part.warnings:
                report.warn(w, strict)
            selector.add(part)
            bar.update(part.nbytes)
    if codes is not None and selector.documents != len(codes):
        raise DataError(f"the corpus holds {selector.documents} documents, the cleaning stage decided on {len(codes)}: "
                        "it changed while being read; run the command again")
    check_languages_present(selector.seen, files, report.skipped)
    return selector.result()


def sample_texts(files: list[str], languages: list[str], weights: dict[str, float], sample_chars: int,
                 val_fraction: float, strict: bool = False,
                 workers: int = 1) -> tuple[Callable[[], Iterator[str]], dict]:
    """:func:`choose_sample` as ``(make_iterator, stats)``: ``make_iterator()`` streams the chosen texts."""
    texts, stats = choose_sample(files, languages, weights, sample_chars, val_fraction, strict, workers)
    return (lambda: iter(texts)), stats
