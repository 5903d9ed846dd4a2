"""Each document's side (train, val, or removed and why) for readers other than the shards' build.

The compressor floor (``train.compression``) primes PPMd with the training side and measures the validation
side, and the tokenizer samples the training side (``train.data.ensure_tokenizer``); all must be the shards' own.
:func:`document_codes` returns the cleaning stage's code per document of the configured languages, in reading
order (:mod:`train.clean.decide`: ``TRAIN``, ``VAL`` or a removal reason), from
``<data.cache_dir>/clean/<fingerprint>.npy`` — written by ``prepare`` as it builds the shards, or computed here by
the same scan without tokenizing (and cached). :func:`iter_split` pairs the documents with their codes.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from contract.atomic import atomic_path
from train.clean import stage
from train.clean.decide import Cleaner
from train.clean.scan import Settings, scan_documents
from train.config import Config, resolve_path
from train.corpus import (
    Chunk,
    Document,
    ReadReport,
    Skip,
    check_languages_present,
    iter_chunks,
    iter_documents,
    parse_chunk,
)
from train.inputs import InputFile, scan_inputs
from train.parallel import ordered_map, resolve_workers


def codes_path(cfg: Config, inputs: list[InputFile], settings: Settings) -> Path:
    """Where the codes of these inputs and settings are cached."""
    key = {"inputs": sorted(i.sha256 for i in inputs), "languages": list(cfg.data.languages),
           "val_fraction": cfg.data.val_fraction, "clean": stage.fingerprint(settings)}
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return resolve_path(cfg.data.cache_dir) / "clean" / f"{fp}.npy"


def save_codes(path: Path, codes: np.ndarray) -> None:
    """Write the codes atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, codes.astype(np.int8))


_W: dict = {}


def _init(languages: list[str], settings: Settings) -> None:
    _W.update(languages=set(languages), settings=settings)


def _scan(chunk: Chunk | Skip):
    if isinstance(chunk, Skip):
        return chunk
    parsed, warnings = parse_chunk(chunk)
    docs = [d for d in parsed if d.lang in _W["languages"]]
    return chunk.file_index, [d.lang for d in docs], [d.source for d in docs], [len(d.text) for d in docs], \
        scan_documents(docs, _W["settings"]), warnings


def scan_and_decide(cfg: Config, files: list[str], settings: Settings | None = None,
                    workers: int | None = None) -> tuple[np.ndarray, dict, Cleaner]:
    """The cleaning stage on ``files`` without tokenizing: ``(codes, report, cleaner)`` (the cleaner keeps its
    clusters; its scratch folder is gone). Raises DataError, as the tokenizer's sampling does, for a configured
    language without a single document (naming what was skipped) or, in strict mode, for the first bad input."""
    settings = settings if settings is not None else stage.settings_from(cfg)
    inputs = scan_inputs(files, resolve_path(cfg.data.cache_dir), 1)
    with tempfile.TemporaryDirectory() as tmp:
        cleaner = Cleaner(settings, list(cfg.data.languages), cfg.data.val_fraction, Path(tmp))
        unreadable = {i.path: i.unreadable for i in inputs}
        n = resolve_workers(cfg.data.num_workers if workers is None else workers)
        read, seen = ReadReport(), dict.fromkeys(cfg.data.languages, 0)
        for part in ordered_map(_scan, iter_chunks(files, unreadable), n, _init, (list(cfg.data.languages), settings)):
            if isinstance(part, Skip):
                read.warn(part.message, cfg.data.strict)
                continue
            file_index, langs, sources, chars, clean, warnings = part
            for w in warnings:
                read.warn(w, cfg.data.strict)
            for lang in langs:
                seen[lang] += 1
            cleaner.add(clean, langs, sources, file_index, chars)
        check_languages_present(seen, files, read.skipped)
        codes, report = cleaner.decide()
    return codes, report, cleaner


def document_codes(cfg: Config, files: list[str], log=print) -> np.ndarray:
    """int8 code per document of ``cfg.data.languages`` in reading order (cached; see the module doc). Raises
    DataError when cleaning leaves a configured language without documents (:func:`stage.check_languages_left`)."""
    settings = stage.settings_from(cfg)
    inputs = scan_inputs(files, resolve_path(cfg.data.cache_dir), 1)
    path = codes_path(cfg, inputs, settings)
    if path.is_file():
        return np.load(path)
    log("cleaning: deciding the split and the removals (the shards' scan, without tokenizing; cached after)")
    codes, report, _ = scan_and_decide(cfg, files, settings)
    stage.check_languages_left(report, list(cfg.data.languages))
    save_codes(path, codes)
    return codes


def iter_split(cfg: Config, files: list[str], log=print) -> Iterator[tuple[Document, int]]:
    """``(document, code)`` for every document of the configured languages, in reading order."""
    codes = document_codes(cfg, files, log)
    languages = set(cfg.data.languages)
    i = 0
    for d in iter_documents(files, strict=cfg.data.strict, report=ReadReport()):
        if d.lang in languages:
            yield d, int(codes[i])
            i += 1
