"""Corpus → tokenizer → token shards, cached by fingerprint (``python -m train.data prepare``).

``prepare(cfg)`` reads the inputs (``train.corpus``), trains or reuses the tokenizer (``train.tokenizer``) and
writes shards (``train.shards``) into ``cache/shards/<fingerprint>/``:

* ``train-00000.bin …`` — documents of the train split, each as ``<|endoftext|>`` + its tokens, resampled so
  the TOKEN mix of languages meets ``data.mix`` (a language short of its share is repeated, whole copies plus
  a hash-chosen fraction, up to ``MAX_REPEAT`` times; past that the others are subsampled), in a shuffled order;
* ``val-bn.bin``, ``val-en.bin`` — the val split per language, not resampled: whole works (``train.clean``);
* ``index.json`` — docs/design.md's fields, plus what was skipped, the Bangla letter share and the cleaning
  stage's report (``cleaning``; also as ``cleaning.md`` beside the shards).

The cleaning stage (``train.clean``, ``data.clean``) rides on the tokenizing pass: the workers compute each
document's quality features, hashes and n-grams beside its tokens; once every document is read the main process
decides the split of whole works, the removals (quality rules, exact and near duplicates, decontamination) and
keeps the rest. Its settings are part of the shards' fingerprint. ``python -m train.data report`` prints the
report.

A fingerprint is the sha256 of the input files' content hashes (sorted: path-independent), the ``[data]`` and
``[tokenizer]`` keys that change the result, the tokenizer's sha256 (for shards) and ``FORMAT_VERSION``. A hit
is reused and says so; a miss is built in a temporary folder and renamed into place. The context length is not
in the tokenizer's key: a tokenizer serves any ``max_position_embeddings``.

Scale: each input is hashed once (``train.inputs``, cached by path, size and mtime); the tokenizer's sample is
chosen in one streaming pass (``train.tokenizer.sample``); the shards are built by :class:`ShardBuild` in named
phases, its tokenizing pass spread over ``data.num_workers`` processes (``train.parallel``) with bounded memory:
chunks of the inputs go out, token ids (and the shuffle keys of each document's copies) come back in reading
order and stream into per-language raw files; the workers tokenize the NFC text with the tokenizer's own NFC
pass off (:func:`train.tokenizer.for_nfc_text`: same ids). Resampling is then one numpy sort in this process.
The shards are bit for bit the same whatever the number of processes.

The fertility trap guard prints the language mix as characters and as tokens beside the target, and warns
loudly when Bangla characters per token fall below 0.75 × English's (the report's 1.4 vs 3.9).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from contract.atomic import atomic_dir, atomic_write_json, atomic_write_text
from contract.cli import HelpFormatter
from contract.text import letter_kinds
from train.clean import stage as clean_stage
from train.clean.decide import TRAIN, VAL, Cleaner
from train.clean.scan import CleanPart, Settings, scan_documents
from train.clean.split import codes_path, document_codes, save_codes
from train.config import Config, ConfigError, add_config_args, config_from_args, resolve_path
from train.corpus import (
    Chunk,
    DataError,
    ReadReport,
    Skip,
    check_languages_present,
    iter_chunks,
    list_input_files,
    parse_chunk,
)
from train.inputs import InputFile, scan_inputs
from train.parallel import ordered_map, resolve_workers
from train.shards import ShardWriter, dtype_for_vocab, open_shard
from train.tokenizer import (
    EOT,
    PRETOKENIZER,
    for_nfc_text,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)
from train.tokenizer.sample import choose_sample

# 2: pre-tokens bounded to MAX_PRETOKEN_CHARS (the split pattern changed, so every tokenizer and shard key did)
# and the context length out of the tokenizer's key
# 3: the split is llama.cpp's deepseek-v3 (train.tokenizer.PRETOKENIZER): GGUF exports tokenize as trained
# 4: tokenizers reserve the chat turn tokens <|im_start|> / <|im_end|> as their last two ids (contract.chat_format)
# 5: the cleaning stage (train.clean) and the validation split of whole works
FORMAT_VERSION = 5
MAX_REPEAT = 4.0  # "Scaling Data-Constrained Language Models" (Muennighoff et al. 2023): ~4 epochs ≈ fresh data
COPY_HASHES = int(MAX_REPEAT) + 1  # a factor ≤ MAX_REPEAT takes at most int(MAX_REPEAT) + 1 copies of a document
SHARD_TOKENS = 1 << 28
FERTILITY_TRAP_RATIO = 0.75


@dataclass
class Prepared:
    """Where prepare put things: the shard folder, the tokenizer folder and the parsed index."""

    shard_dir: Path
    tokenizer_dir: Path
    index: dict


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


def tokenizer_fingerprint(cfg: Config, inputs: list[InputFile]) -> str:
    """Fingerprint of a tokenizer trained from these inputs with these settings (not the model's context); the
    cleaning stage's settings are part of it, as they decide which documents the sample may take."""
    t = cfg.tokenizer
    return _fingerprint({
        "format": FORMAT_VERSION, "kind": "tokenizer", "inputs": sorted(i.sha256 for i in inputs),
        "languages": sorted(cfg.data.languages), "val_fraction": cfg.data.val_fraction,
        "vocab_size": t.vocab_size, "sample_chars": t.sample_chars, "sample_weights": t.sample_weights,
        "min_frequency": t.min_frequency, "split": [PRETOKENIZER.name, *PRETOKENIZER.splits],
        "clean": clean_stage.fingerprint(clean_stage.settings_from(cfg)),
    })


def shards_fingerprint(cfg: Config, inputs: list[InputFile], tok_sha: str, clean: Settings | None = None) -> str:
    """Fingerprint of the shards for these inputs, [data] keys (the cleaning stage's settings included) and
    tokenizer."""
    d = cfg.data
    clean = clean if clean is not None else clean_stage.settings_from(cfg)
    return _fingerprint({
        "format": FORMAT_VERSION, "kind": "shards", "inputs": sorted(i.sha256 for i in inputs),
        "languages": sorted(d.languages), "mix": d.mix, "val_fraction": d.val_fraction, "tokenizer": tok_sha,
        "clean": clean_stage.fingerprint(clean),
    })


def ensure_tokenizer(cfg: Config, files: list[str], inputs: list[InputFile], log=print) -> Path:
    """The tokenizer folder: ``tokenizer.path`` if set, else the cached one for this fingerprint, trained on a
    miss on the model's own training side — the documents the cleaning stage keeps for training
    (``train.clean.split.document_codes``: not the validation works, not duplicates or contaminated documents),
    so the tokenizer never sees validation text — balanced by ``tokenizer.sample_weights`` and sampled in one pass
    by ``data.num_workers`` processes. Raises DataError when the inputs hold no documents to train on (saying
    what was skipped and why)."""
    if cfg.tokenizer.path:
        path = resolve_path(cfg.tokenizer.path)
        load_tokenizer(path)
        log(f"tokenizer: using {path} (tokenizer.path)")
        return path
    cache = resolve_path(cfg.data.cache_dir) / "tokenizers"
    path = cache / tokenizer_fingerprint(cfg, inputs)
    if (path / "tokenizer.json").is_file():
        log(f"tokenizer: cache hit, reusing {path}")
        return path
    t0 = time.time()
    codes = document_codes(cfg, files, log)
    texts, stats = choose_sample(files, cfg.data.languages, cfg.tokenizer.sample_weights, cfg.tokenizer.sample_chars,
                                 cfg.data.val_fraction, cfg.data.strict, resolve_workers(cfg.data.num_workers),
                                 {i.path: i.unreadable for i in inputs}, codes=codes)
    for lang, s in stats.items():
        log(f"tokenizer: sampling {s['sampled']:,} of {s['available']:,} train characters of {lang} "
            f"({s['docs']} documents)")
    if sum(s["sampled"] for s in stats.values()) == 0:
        raise DataError(f"no train documents in {cfg.data.languages} to train a tokenizer on in {cfg.data.paths}")
    tok = train_tokenizer(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
    del texts
    save_tokenizer(tok, path, None, overwrite=True)  # no model_max_length: checkpoints write the model's
    log(f"tokenizer: trained {tok.get_vocab_size():,} tokens in {time.time() - t0:.1f} s → {path}")
    return path


def repeat_factors(train_tokens: dict[str, int], mix: dict[str, float], max_repeat: float = MAX_REPEAT) -> dict:
    """Per-language resampling factors that make the token shares equal ``mix``.

    The factor is proportional to ``mix[lang] / train_tokens[lang]``, scaled so no language is dropped below
    1.0 unless that would repeat another more than ``max_repeat`` times (then the largest factor is
    ``max_repeat`` and the others fall below 1: subsampling). Languages without train tokens get 0.
    """
    have = {lang: n for lang, n in train_tokens.items() if n > 0 and mix.get(lang, 0) > 0}
    if not have:
        return {lang: 0.0 for lang in train_tokens}
    raw = {lang: mix[lang] / n for lang, n in have.items()}
    scale = 1.0 / min(raw.values())
    if max(raw.values()) * scale > max_repeat:
        scale = max_repeat / max(raw.values())
    return {lang: raw[lang] * scale if lang in have else 0.0 for lang in train_tokens}


def _doc_hash_pair(text: str) -> tuple[float, float]:
    h = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return int(h[:8], 16) / 2**32, int(h[8:16], 16) / 2**32


def _copy_hash(key: float, u: float, c: int) -> int:
    """The shuffle key of copy ``c`` of the document with hashes ``key``, ``u``: the first 32 bits of
    sha256(``"key:u:c"``), as an integer (sorting by it sorts as by the hash / 2**32)."""
    return int(hashlib.sha256(f"{key!r}:{u!r}:{c}".encode()).hexdigest()[:8], 16)


# ------------------------------------------------------------------------------------- the tokenizing workers

@dataclass
class EncodedChunk:
    """One chunk's documents of the configured languages, tokenized (what a worker sends back).

    Per document, in reading order: ``lang`` (index into the languages), ``key``/``u`` (the two hashes of
    :func:`_doc_hash_pair`: split and resampling), ``copies`` (``[docs, COPY_HASHES]`` uint32: the shuffle keys
    :func:`_copy_hash` of its first copies, computed here so that resampling needs no hashing),
    ``tokens`` (with the leading ``<|endoftext|>``), ``chars``, ``bengali_chars`` (Bengali letter share × chars);
    ``ids`` all their token ids back to back (the shards' dtype); ``sources`` ``[((source, license), docs,
    chars)]`` in order of first appearance; ``doc_sources`` and ``clean`` (the cleaning stage's per-document
    features, :class:`train.clean.scan.CleanPart`).
    """

    file_index: int
    nbytes: int
    warnings: list[str]
    other_language_docs: int
    lang: np.ndarray
    key: np.ndarray
    u: np.ndarray
    copies: np.ndarray
    tokens: np.ndarray
    chars: np.ndarray
    bengali_chars: np.ndarray
    ids: np.ndarray
    sources: list
    doc_sources: list
    clean: CleanPart


_WORKER: dict = {}


def _init_encoder(tok_dir: str, languages: list[str], clean: Settings) -> None:
    tok = load_tokenizer(tok_dir)
    for_nfc_text(tok)  # the documents are NFC already (train.corpus): the tokenizer's own NFC pass is redundant
    _WORKER.update(tok=tok, eot=tok.token_to_id(EOT), lang_index={lang: i for i, lang in enumerate(languages)},
                   dtype=dtype_for_vocab(tok.get_vocab_size()), clean=clean)


def _encode_chunk(chunk: Chunk | Skip) -> EncodedChunk | Skip:
    if isinstance(chunk, Skip):
        return chunk
    docs, warnings = parse_chunk(chunk)
    lang_index = _WORKER["lang_index"]
    keep = [d for d in docs if d.lang in lang_index]
    doc_ids = [e.ids for e in _WORKER["tok"].encode_batch_fast([d.text for d in keep], add_special_tokens=False)]
    lengths = np.fromiter((len(x) + 1 for x in doc_ids), dtype=np.int64, count=len(doc_ids))
    ids = np.empty(int(lengths.sum()), dtype=_WORKER["dtype"])
    pos = 0
    for x, n in zip(doc_ids, lengths.tolist()):
        ids[pos] = _WORKER["eot"]
        ids[pos + 1:pos + n] = x
        pos += n
    pairs = [_doc_hash_pair(d.text) for d in keep]
    copies = np.array([[_copy_hash(key, u, c) for c in range(COPY_HASHES)] for key, u in pairs],
                      dtype=np.uint32).reshape(len(pairs), COPY_HASHES)
    sources: dict[tuple, list] = {}
    for d in keep:
        s = sources.setdefault((d.source, d.license), [0, 0])
        s[0] += 1
        s[1] += len(d.text)
    return EncodedChunk(
        file_index=chunk.file_index, nbytes=chunk.nbytes, warnings=warnings, other_language_docs=len(docs) - len(keep),
        lang=np.fromiter((lang_index[d.lang] for d in keep), dtype=np.int8, count=len(keep)),
        key=np.array([p[0] for p in pairs], dtype=np.float64), u=np.array([p[1] for p in pairs], dtype=np.float64),
        copies=copies,
        tokens=lengths, chars=np.fromiter((len(d.text) for d in keep), dtype=np.int64, count=len(keep)),
        bengali_chars=np.array([d.bengali_share * len(d.text) for d in keep], dtype=np.float64),
        ids=ids, sources=[(k, v[0], v[1]) for k, v in sources.items()], doc_sources=[d.source for d in keep],
        clean=scan_documents(keep, _WORKER["clean"]))


# ------------------------------------------------------------------------------------- building the shards

@dataclass
class _Docs:
    """Documents of one language and split, in reading order: their hashes (``copies``: ``COPY_HASHES`` shuffle
    keys per document, back to back), their place in a raw token file (``start``, ``tokens``) and their
    characters."""

    key: array = field(default_factory=lambda: array("d"))
    u: array = field(default_factory=lambda: array("d"))
    copies: array = field(default_factory=lambda: array("I"))
    start: array = field(default_factory=lambda: array("q"))
    tokens: array = field(default_factory=lambda: array("q"))
    chars: array = field(default_factory=lambda: array("q"))

    def subset(self, idx: np.ndarray) -> _Docs:
        """The documents ``idx`` (in that order) as a new table."""
        out = _Docs()
        for name in ("key", "u", "start", "tokens", "chars"):
            a = np.asarray(getattr(self, name))
            getattr(out, name).frombytes(a[idx].tobytes() if len(a) else b"")
        c = np.asarray(self.copies, dtype=np.uint32).reshape(-1, COPY_HASHES)
        out.copies.frombytes(c[idx].tobytes() if len(c) else b"")
        return out

    def pop(self, j: int) -> tuple[float, float, int, int, int]:
        """Remove document ``j``; returns its ``(key, u, start, tokens, chars)``."""
        del self.copies[j * COPY_HASHES:(j + 1) * COPY_HASHES]
        return tuple(col.pop(j) for col in (self.key, self.u, self.start, self.tokens, self.chars))


@dataclass
class ShardBuild:
    """``build_shards`` in named phases; each phase reads the state the earlier ones left.

    :meth:`tokenize` streams every document through the workers into per-language raw files and keeps one small
    record per document (and the cleaning stage's, :class:`train.clean.decide.Cleaner`); :meth:`clean` decides
    the split of whole works, deduplication, the quality rules and decontamination, and keeps the train and val
    documents; :meth:`ensure_val` gives every language a val document;
    :meth:`write_val` writes ``val-<lang>.bin`` in split-hash order; :meth:`resample` computes the order of the
    train documents (with repeats) that meets ``data.mix``; :meth:`write_train` writes ``train-NNNNN.bin`` in
    that order; :meth:`index` returns ``index.json``'s dict. Nothing depends on the number of workers.
    """

    cfg: Config
    files: list[str]
    inputs: list[InputFile]
    tok_dir: Path
    out: Path
    log: Callable[[str], None] = print
    shard_tokens: int = SHARD_TOKENS
    workers: int = 1
    clean_settings: Settings | None = None

    def __post_init__(self) -> None:
        if self.clean_settings is None:
            self.clean_settings = clean_stage.settings_from(self.cfg)
        tok = load_tokenizer(self.tok_dir)
        self.vocab = tok.get_vocab_size()
        self.eot = tok.token_to_id(EOT)
        self.languages = list(self.cfg.data.languages)
        self.report = ReadReport()
        self.stats = {lang: {"docs": 0, "chars": 0, "tokens": 0, "bengali_letters_share": 0.0} for lang in self.languages}
        self.sources: dict[tuple[str, str | None], dict] = {}
        self.all = {lang: _Docs() for lang in self.languages}
        self.bengali = {lang: array("d") for lang in self.languages}
        self.doc_index = array("q")  # per document in reading order: its place in self.all[its language]
        self.cleaner = Cleaner(self.clean_settings, self.languages, self.cfg.data.val_fraction, self.out / ".clean")
        self.clean_report: dict = {}
        self.train = {lang: _Docs() for lang in self.languages}
        self.val = {lang: _Docs() for lang in self.languages}
        self.borrowed: dict[str, tuple] = {}  # lang → the train record moved to val (ensure_val)
        self.skipped_lang = 0
        self.val_stats: dict[str, dict] = {}  # write_val
        self.natural: dict[str, int] = {}  # resample: train tokens per language before resampling
        self.mix: dict[str, float] = {}
        self.factors: dict[str, float] = {}
        self.order: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (lang, doc)
        self.shards: list[str] = []  # write_train
        self.resampled: dict[str, int] = {}

    def _raw(self, lang: str) -> Path:
        return self.out / f".all-{lang}.raw"

    def tokenize(self) -> None:
        """Read, parse and tokenize every input in ``workers`` processes, in reading order."""
        writers = {lang: ShardWriter(self._raw(lang), self.vocab) for lang in self.languages}
        unreadable = {f.path: f.unreadable for f in self.inputs}
        bar = tqdm(total=sum(max(f.bytes, 1) for f in self.inputs), unit="B", unit_scale=True, desc="tokenizing",
                   dynamic_ncols=True, mininterval=0.5)
        letter_kinds()  # built once here, before the workers fork: they inherit it
        with bar:
            results = ordered_map(_encode_chunk, iter_chunks(self.files, unreadable), self.workers, _init_encoder,
                                  (str(self.tok_dir), self.languages, self.clean_settings))
            for part in results:
                if isinstance(part, Skip):
                    self.report.warn(part.message, self.cfg.data.strict)
                    continue
                for w in part.warnings:
                    self.report.warn(w, self.cfg.data.strict)
                self._take(part, writers)
                bar.update(part.nbytes)
        for w in writers.values():
            w.close()
        for msg in self.report.skipped:
            self.log(f"warning: {msg}")
        check_languages_present({lang: len(self.all[lang].key) for lang in self.languages}, self.files,
                                self.report.skipped)

    def _take(self, part: EncodedChunk, writers: dict) -> None:
        self.skipped_lang += part.other_language_docs
        ends = np.cumsum(part.tokens)
        starts = ends - part.tokens
        have = [len(self.all[lang].key) for lang in self.languages]
        for li in part.lang.tolist():
            self.doc_index.append(have[li])
            have[li] += 1
        self.cleaner.add(part.clean, [self.languages[li] for li in part.lang.tolist()], part.doc_sources,
                         part.file_index, part.chars.tolist())
        for li, lang in enumerate(self.languages):
            sel = np.flatnonzero(part.lang == li)
            if len(sel) == 0:
                continue
            w = writers[lang]
            docs = self.all[lang]
            n = part.tokens[sel]
            docs.start.frombytes((w.tokens + np.cumsum(n) - n).astype(np.int64).tobytes())
            docs.tokens.frombytes(n.astype(np.int64).tobytes())
            docs.key.frombytes(part.key[sel].tobytes())
            docs.u.frombytes(part.u[sel].tobytes())
            docs.copies.frombytes(part.copies[sel].astype(np.uint32).tobytes())
            docs.chars.frombytes(part.chars[sel].astype(np.int64).tobytes())
            self.bengali[lang].frombytes(part.bengali_chars[sel].astype(np.float64).tobytes())
            w.write(np.concatenate([part.ids[a:b] for a, b in zip(starts[sel].tolist(), ends[sel].tolist())]))
        for (source, lic), docs, chars in part.sources:
            src = self.sources.setdefault((source, lic), {"source": source, "license": lic, "docs": 0, "chars": 0})
            src["docs"] += docs
            src["chars"] += chars

    def clean(self) -> None:
        """The cleaning stage's decisions (:mod:`train.clean.decide`): keep the train and val documents, count
        the kept ones in the per-language statistics. Raises DataError when a configured language loses every
        document."""
        codes, self.clean_report = self.cleaner.decide()
        shutil.rmtree(self.out / ".clean", ignore_errors=True)
        clean_stage.check_languages_left(self.clean_report, self.languages)
        save_codes(codes_path(self.cfg, self.inputs, self.clean_settings), codes)  # the compressor floor's split
        lang_of = np.frombuffer(self.cleaner.lang, dtype=np.int8) if len(codes) else np.zeros(0, np.int8)
        index = np.asarray(self.doc_index, dtype=np.int64)
        for li, lang in enumerate(self.languages):
            mine = lang_of == li
            for side, code in (("train", TRAIN), ("val", VAL)):
                idx = index[mine & (codes == code)]
                getattr(self, side)[lang] = self.all[lang].subset(idx)
            kept = index[mine & (codes <= VAL)]
            st = self.stats[lang]
            st["docs"] = len(kept)
            st["chars"] = int(np.asarray(self.all[lang].chars, dtype=np.int64)[kept].sum())
            st["tokens"] = int(np.asarray(self.all[lang].tokens, dtype=np.int64)[kept].sum())
            b = np.asarray(self.bengali[lang], dtype=np.float64)[kept]
            st["bengali_letters_share"] = float(sum(b.tolist()))  # in reading order, as one reader adds
        for line in clean_stage.summary_lines(self.clean_report):
            self.log(line)

    def ensure_val(self) -> None:
        """Every language needs val text: borrow the train document with the lowest split hash when val is empty."""
        for lang in self.languages:
            tr = self.train[lang]
            if len(self.val[lang].key) == 0 and len(tr.key) > 1:
                j = min(range(len(tr.key)), key=tr.key.__getitem__)
                self.borrowed[lang] = tr.pop(j)
                self.log(f"note: no {lang} document fell into val at val_fraction={self.cfg.data.val_fraction}; "
                         f"moved one train document to val-{lang}.bin")

    def write_val(self) -> None:
        """``val-<lang>.bin``: the val documents in split-hash order (ties in reading order)."""
        for lang in self.languages:
            docs = self.val[lang]
            raw = open_shard(self._raw(lang))
            items = [(docs.key[j], raw, docs.start[j], docs.tokens[j], docs.chars[j]) for j in range(len(docs.key))]
            if lang in self.borrowed:
                key, _u, start, n, chars = self.borrowed[lang]
                items.append((key, raw, start, n, chars))
            items.sort(key=lambda x: x[0])
            with ShardWriter(self.out / f"val-{lang}.bin", self.vocab) as w:
                for _key, src, start, n, _chars in items:
                    w.write(src[start:start + n])
            self.val_stats[lang] = {"docs": len(items), "chars": sum(x[4] for x in items),
                                    "tokens": sum(x[3] for x in items)}
            del raw, items

    def resample(self) -> None:
        """The train documents, each ``whole`` times plus a hash-chosen share once more, shuffled by hash.

        Vectorised: the copies' shuffle keys came from the workers (``_Docs.copies``); the order is the one of
        sorting every copy by (key, language, document).
        """
        self.natural = {lang: sum(self.train[lang].tokens) for lang in self.languages}
        self.mix = {lang: self.cfg.data.mix.get(lang, 0.0) for lang in self.languages}
        self.factors = repeat_factors(self.natural, self.mix)
        rank = {lang: r for r, lang in enumerate(sorted(self.languages))}
        hashes, ranks, langs, index = [], [], [], []
        for li, lang in enumerate(self.languages):
            docs = self.train[lang]
            f = self.factors[lang]
            whole = int(f)
            tokens = np.asarray(docs.tokens, dtype=np.int64)
            n = len(tokens)
            # the fractional part: documents in hash order until their tokens reach it (exact to one document)
            extra_tokens = (f - whole) * self.natural[lang]
            by_u = np.argsort(np.asarray(docs.u, dtype=np.float64), kind="stable")
            t = tokens[by_u]
            fits = (np.cumsum(t) - t) + t / 2 <= extra_tokens
            first_miss = int(np.argmin(fits)) if n and not fits.all() else n
            count = np.full(n, whole, dtype=np.int64)
            count[by_u[:first_miss]] += 1
            j = np.repeat(np.arange(n, dtype=np.int64), count)
            c = np.arange(len(j), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
            table = np.asarray(docs.copies, dtype=np.uint32).reshape(n, COPY_HASHES)
            h = table[j, np.minimum(c, COPY_HASHES - 1)].astype(np.int64)
            for q in np.flatnonzero(c >= COPY_HASHES).tolist():  # only for a factor above MAX_REPEAT
                h[q] = _copy_hash(docs.key[j[q]], docs.u[j[q]], int(c[q]))
            hashes.append(h)
            ranks.append(np.full(len(j), rank[lang], dtype=np.int64))
            langs.append(np.full(len(j), li, dtype=np.int64))
            index.append(j)
        index_a = np.concatenate(index)
        order = np.lexsort((index_a, np.concatenate(ranks), np.concatenate(hashes)))
        self.order = (np.concatenate(langs)[order], index_a[order])

    def write_train(self) -> None:
        """``train-NNNNN.bin`` in the resampled order; a shard closes once it holds ``shard_tokens`` tokens."""
        # plain array views (slicing a memmap costs a subclass object each) and each copy's place, looked up at once
        raws = [np.asarray(open_shard(self._raw(lang))) for lang in self.languages]
        langs, index = self.order
        starts = np.zeros(len(langs), dtype=np.int64)
        counts = np.zeros(len(langs), dtype=np.int64)
        for li, lang in enumerate(self.languages):
            mine = langs == li
            starts[mine] = np.asarray(self.train[lang].start, dtype=np.int64)[index[mine]]
            counts[mine] = np.asarray(self.train[lang].tokens, dtype=np.int64)[index[mine]]
        self.resampled = {lang: int(counts[langs == li].sum()) for li, lang in enumerate(self.languages)}
        self.shards = []
        writer = None
        pending: list[np.ndarray] = []
        pending_tokens = 0
        for li, start, n in tqdm(zip(langs.tolist(), starts.tolist(), counts.tolist()), total=len(langs),
                                 desc="writing shards", unit="doc", dynamic_ncols=True, mininterval=0.5,
                                 disable=len(langs) < 2000):
            if writer is None or writer.tokens + pending_tokens >= self.shard_tokens:
                if writer is not None:
                    if pending:
                        writer.write(np.concatenate(pending))
                    writer.close()
                pending, pending_tokens = [], 0
                name = f"train-{len(self.shards):05d}.bin"
                self.shards.append(name)
                writer = ShardWriter(self.out / name, self.vocab)
            pending.append(raws[li][start:start + n])
            pending_tokens += n
            if pending_tokens >= 1 << 20:
                writer.write(np.concatenate(pending))
                pending, pending_tokens = [], 0
        if writer is None:
            raise DataError(f"no train documents left in {self.cfg.data.paths} after the val split "
                            f"(val_fraction={self.cfg.data.val_fraction}); add data or lower data.val_fraction")
        if pending:
            writer.write(np.concatenate(pending))
        writer.close()
        del raws, pending
        for lang in self.languages:
            self._raw(lang).unlink()

    def index(self) -> dict:
        """``index.json``'s dict (docs/design.md, "Data")."""
        langs, stats = self.languages, self.stats
        natural = {lang: {"docs": len(self.train[lang].key), "chars": sum(self.train[lang].chars),
                          "tokens": self.natural[lang]} for lang in langs}
        total_train = sum(self.resampled.values())
        languages_out = {lang: {
            "docs": stats[lang]["docs"], "chars": stats[lang]["chars"], "tokens": stats[lang]["tokens"],
            "chars_per_token": stats[lang]["chars"] / max(stats[lang]["tokens"], 1),
            "bengali_letters_share": stats[lang]["bengali_letters_share"] / max(stats[lang]["chars"], 1),
            "repeat_factor": self.factors[lang],
        } for lang in langs}
        val_files = {lang: f"val-{lang}.bin" for lang in langs}
        return {
            "format_version": FORMAT_VERSION,
            "dtype": str(dtype_for_vocab(self.vocab)),
            "vocab_size": self.vocab,
            "eot_id": self.eot,
            "tokenizer_sha256": tokenizer_sha256(self.tok_dir),
            "tokenizer_dir": str(self.tok_dir),
            "inputs": [f.fingerprint() for f in self.inputs],
            "splits": {
                "train": {"shards": self.shards, "tokens": total_train, "tokens_by_lang": self.resampled,
                          "natural": natural},
                "val": {"shards": [val_files[lang] for lang in langs],
                        "tokens": sum(self.val_stats[lang]["tokens"] for lang in langs),
                        "tokens_by_lang": {lang: self.val_stats[lang]["tokens"] for lang in langs},
                        "chars_by_lang": {lang: self.val_stats[lang]["chars"] for lang in langs},
                        "docs_by_lang": {lang: self.val_stats[lang]["docs"] for lang in langs},
                        "files": val_files},
                "works": self.clean_report["split"],
            },
            "cleaning": self.clean_report,
            "languages": languages_out,
            "target_mix": {lang: self.mix[lang] / max(sum(self.mix.values()), 1e-12) for lang in langs},
            "token_mix": {lang: self.resampled[lang] / max(total_train, 1) for lang in langs},
            "char_mix": {lang: stats[lang]["chars"] / max(sum(s["chars"] for s in stats.values()), 1) for lang in langs},
            "sources": sorted(self.sources.values(), key=lambda s: (-s["chars"], s["source"])),
            "skipped": self.report.skipped,
            "skipped_other_language_docs": self.skipped_lang,
        }

    def run(self) -> dict:
        """All phases in order; returns the index dict."""
        self.tokenize()
        self.clean()
        self.ensure_val()
        self.write_val()
        self.resample()
        self.write_train()
        return self.index()


def build_shards(cfg: Config, files: list[str], inputs: list[InputFile], tok_dir: Path, out: Path, log=print,
                 shard_tokens: int = SHARD_TOKENS, workers: int | None = None) -> dict:
    """Tokenize every document into ``out`` (an empty folder) with ``workers`` processes (default
    ``data.num_workers``) and return the index dict. The files written do not depend on ``workers``.

    Raises DataError for a configured language without documents, for no train documents, or (strict mode)
    for the first bad input.
    """
    workers = resolve_workers(cfg.data.num_workers if workers is None else workers)
    return ShardBuild(cfg, files, inputs, tok_dir, out, log, shard_tokens, workers).run()


def write_cleaning_report(index: dict, folder: Path) -> None:
    """``cleaning.md`` beside the shards, from ``index.json``'s ``cleaning`` record."""
    mb = sum(i.get("bytes", 0) for i in index.get("inputs", [])) / 1e6
    atomic_write_text(folder / "cleaning.md", clean_stage.markdown(index["cleaning"], mb))


def mix_report(index: dict) -> list[str]:
    """Human-readable lines: the mix as characters, natural tokens, resampled tokens and target, and the
    fertility guard's verdict."""
    langs = list(index["languages"])
    nat = index["splits"]["train"]["natural"]
    nat_total = max(sum(nat[lang]["tokens"] for lang in langs), 1)
    lines = [f"{'lang':<6}{'docs':>8}{'chars/token':>13}{'char share':>12}{'token share':>13}"
             f"{'after resampling':>18}{'target':>9}{'repeat':>8}"]
    for lang in langs:
        L = index["languages"][lang]
        lines.append(f"{lang:<6}{L['docs']:>8,}{L['chars_per_token']:>13.3f}{index['char_mix'][lang]:>12.1%}"
                     f"{nat[lang]['tokens'] / nat_total:>13.1%}{index['token_mix'][lang]:>18.1%}"
                     f"{index['target_mix'][lang]:>9.1%}{L['repeat_factor']:>7.2f}×")
    if "bn" in index["languages"] and "en" in index["languages"]:
        bn, en = index["languages"]["bn"]["chars_per_token"], index["languages"]["en"]["chars_per_token"]
        ratio = bn / max(en, 1e-9)
        if ratio < FERTILITY_TRAP_RATIO:
            lines.append("!" * 100)
            lines.append(f"WARNING: FERTILITY TRAP — Bangla gets {bn:.2f} characters/token against English's {en:.2f} "
                         f"({ratio:.2f}×, below {FERTILITY_TRAP_RATIO}×). Bangla text costs far more tokens than "
                         f"English: a token mix no longer reflects the text mix. Use a script-aware tokenizer.")
            lines.append("!" * 100)
        else:
            lines.append(f"fertility guard: Bangla {bn:.2f} vs English {en:.2f} characters/token ({ratio:.2f}×) — ok")
    return lines


def prepare(cfg: Config, log=print) -> Prepared:
    """Make sure the tokenizer and the shards for ``cfg`` exist (building what is missing) and return them.

    Raises DataError / ConfigError with a message naming the bad input.
    """
    clean = clean_stage.settings_from(cfg)  # a bad rule name or threshold fails here, before anything is built
    files = list_input_files(cfg.data.paths)
    cache = resolve_path(cfg.data.cache_dir)
    inputs = scan_inputs(files, cache, resolve_workers(cfg.data.num_workers))
    tok_dir = ensure_tokenizer(cfg, files, inputs, log)
    fp = shards_fingerprint(cfg, inputs, tokenizer_sha256(tok_dir), clean)
    shard_dir = cache / "shards" / fp
    if (shard_dir / "index.json").is_file():
        index = json.loads((shard_dir / "index.json").read_text())
        log(f"shards: cache hit, reusing {shard_dir}")
        for line in clean_stage.summary_lines(index.get("cleaning", {})):  # the report in every run's log
            log(line)
    else:
        t0 = time.time()
        with atomic_dir(shard_dir, overwrite=True) as tmp:
            workers = resolve_workers(cfg.data.num_workers)
            index = ShardBuild(cfg, files, inputs, tok_dir, tmp, log, SHARD_TOKENS, workers, clean).run()
            write_cleaning_report(index, tmp)
            atomic_write_json(tmp / "index.json", index)
        dt = time.time() - t0
        mb = sum(i.bytes for i in inputs) / 1e6
        log(f"shards: wrote {index['splits']['train']['tokens']:,} train tokens in "
            f"{len(index['splits']['train']['shards'])} shard(s) in {dt:.1f} s ({mb / max(dt, 1e-9):.2f} MB/s of input) "
            f"→ {shard_dir}")
    for line in mix_report(index):
        log(line)
    return Prepared(shard_dir=shard_dir, tokenizer_dir=Path(index["tokenizer_dir"]) if not cfg.tokenizer.path
                    else resolve_path(cfg.tokenizer.path), index=index)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.data``."""
    p = argparse.ArgumentParser(prog="python -m train.data", description="Prepare the tokenizer and token shards.",
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="tokenize --data into cached shards; prints the shard folder",
                        formatter_class=HelpFormatter)
    pr = sub.add_parser("report", help="prepare (or reuse) the shards and print their cleaning report "
                        "(cleaning.md) without training", formatter_class=HelpFormatter)
    for q in (pp, pr):
        add_config_args(q)
        q.add_argument("--strict", action="store_true", help="a bad input file is an error instead of a warning")
        q.add_argument("--workers", type=int, default=None, metavar="N",
                       help="processes that read and tokenize (default: data.num_workers; 0 = every core)")
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.strict:
            cfg.data.strict = True
        if args.workers is not None:
            if args.workers < 0:
                raise ConfigError(f"--workers: expected 0 (every core) or a positive number, got {args.workers}")
            cfg.data.num_workers = args.workers
        prep = prepare(cfg, log=lambda m: print(m, file=sys.stderr))
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "report":
        md = prep.shard_dir / "cleaning.md"
        print(md.read_text(encoding="utf-8") if md.is_file() else "no cleaning report (shards of an older format)")
        print(f"shards: {prep.shard_dir}")
        return 0
    print(prep.shard_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["prepare", "Prepared", "repeat_factors", "mix_report", "tokenizer_fingerprint", "shards_fingerprint",
           "build_shards", "ensure_tokenizer"]
