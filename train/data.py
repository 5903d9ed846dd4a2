"""Corpus → tokenizer → token shards, cached by fingerprint (``python -m train.data prepare``).

``prepare(cfg)`` reads the inputs (``train.corpus``), trains or reuses the tokenizer (``train.tokenizer``) and
writes shards (``train.shards``) into ``cache/shards/<fingerprint>/``:

* ``train-00000.bin …`` — documents of the train split, each as ``<|endoftext|>`` + its tokens, resampled so
  the TOKEN mix of languages meets ``data.mix`` (a language short of its share is repeated, whole copies plus
  a hash-chosen fraction, up to ``MAX_REPEAT`` times; past that the others are subsampled), in a shuffled order;
* ``val-bn.bin``, ``val-en.bin`` — the val split per language, not resampled;
* ``index.json`` — DESIGN.md's fields, plus what was skipped and the Bangla letter share.

A fingerprint is the sha256 of the input files' content hashes (sorted: path-independent), the ``[data]`` and
``[tokenizer]`` keys that change the result, the tokenizer's sha256 (for shards) and ``FORMAT_VERSION``. A hit
is reused and says so; a miss is built in a temporary folder and renamed into place.

The fertility trap guard prints the language mix as characters and as tokens beside the target, and warns
loudly when Bangla characters per token fall below 0.75 × English's (the report's 1.4 vs 3.9).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from train.atomic import atomic_dir, atomic_write_json
from train.config import Config, ConfigError, HelpFormatter, add_config_args, config_from_args, resolve_path
from train.corpus import DataError, ReadReport, input_fingerprints, iter_documents, list_input_files
from train.shards import ShardWriter, dtype_for_vocab, open_shard
from train.tokenizer import (
    EOT,
    SPLIT_PATTERN,
    check_languages_present,
    load_tokenizer,
    sample_texts,
    save_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)

FORMAT_VERSION = 1
MAX_REPEAT = 4.0  # "Scaling Data-Constrained Language Models" (Muennighoff et al. 2023): ~4 epochs ≈ fresh data
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


def tokenizer_fingerprint(cfg: Config, inputs: list[dict]) -> str:
    """Fingerprint of a tokenizer trained from these inputs with these settings."""
    t = cfg.tokenizer
    return _fingerprint({
        "format": FORMAT_VERSION, "kind": "tokenizer", "inputs": sorted(i["sha256"] for i in inputs),
        "languages": sorted(cfg.data.languages), "val_fraction": cfg.data.val_fraction,
        "vocab_size": t.vocab_size, "sample_chars": t.sample_chars, "sample_weights": t.sample_weights,
        "min_frequency": t.min_frequency, "pattern": SPLIT_PATTERN,
        "max_len": cfg.model.max_position_embeddings,
    })


def shards_fingerprint(cfg: Config, inputs: list[dict], tok_sha: str) -> str:
    """Fingerprint of the shards for these inputs, [data] keys and tokenizer."""
    d = cfg.data
    return _fingerprint({
        "format": FORMAT_VERSION, "kind": "shards", "inputs": sorted(i["sha256"] for i in inputs),
        "languages": sorted(d.languages), "mix": d.mix, "val_fraction": d.val_fraction, "tokenizer": tok_sha,
    })


def ensure_tokenizer(cfg: Config, files: list[str], inputs: list[dict], log=print) -> Path:
    """The tokenizer folder: ``tokenizer.path`` if set, else the cached one for this fingerprint, trained on a
    miss (on the train split, balanced by ``tokenizer.sample_weights``)."""
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
    make_iter, stats = sample_texts(files, cfg.data.languages, cfg.tokenizer.sample_weights,
                                    cfg.tokenizer.sample_chars, cfg.data.val_fraction, cfg.data.strict)
    for lang, s in stats.items():
        log(f"tokenizer: sampling {s['sampled']:,} of {s['available']:,} train characters of {lang} "
            f"({s['docs']} documents)")
    if sum(s["sampled"] for s in stats.values()) == 0:
        raise DataError(f"no train documents in {cfg.data.languages} to train a tokenizer on in {cfg.data.paths}")
    tok = train_tokenizer(make_iter(), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
    save_tokenizer(tok, path, cfg.model.max_position_embeddings, overwrite=True)
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


def _batched(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def build_shards(cfg: Config, files: list[str], inputs: list[dict], tok_dir: Path, out: Path, log=print,
                 shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize every document into ``out`` (an empty folder) and return the index dict."""
    tok = load_tokenizer(tok_dir)
    vocab = tok.get_vocab_size()
    eot = tok.token_to_id(EOT)
    languages = list(cfg.data.languages)
    report = ReadReport()
    stats = {lang: {"docs": 0, "chars": 0, "tokens": 0, "bengali_letters_share": 0.0} for lang in languages}
    split_stats = {s: {lang: {"docs": 0, "chars": 0, "tokens": 0} for lang in languages} for s in ("train", "val")}
    sources: dict[tuple[str, str | None], dict] = {}
    train_docs: dict[str, list[tuple[float, float, int, int, int]]] = {lang: [] for lang in languages}  # key, u, start, n, chars
    raw_writers = {lang: ShardWriter(out / f".train-{lang}.raw", vocab) for lang in languages}
    val_pending: dict[str, list[tuple[float, list[int], int]]] = {lang: [] for lang in languages}
    skipped_lang = 0

    sizes = [max(i["bytes"], 1) for i in inputs]
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True, mininterval=0.5)
    done_before = [sum(sizes[:i]) for i in range(len(sizes))]

    def progress(i: int, frac: float) -> None:
        bar.update(int(done_before[i] + frac * sizes[i]) - bar.n)

    docs_iter = iter_documents(files, strict=cfg.data.strict, report=report, progress=progress)
    for batch in _batched(docs_iter, 256):
        keep = [d for d in batch if d.lang in stats]
        skipped_lang += len(batch) - len(keep)
        encs = tok.encode_batch([d.text for d in keep], add_special_tokens=False)
        for d, enc in zip(keep, encs):
            ids = [eot] + enc.ids
            key, u = _doc_hash_pair(d.text)
            st = stats[d.lang]
            st["docs"] += 1
            st["chars"] += len(d.text)
            st["tokens"] += len(ids)
            st["bengali_letters_share"] += d.bengali_share * len(d.text)
            src = sources.setdefault((d.source, d.license), {"source": d.source, "license": d.license, "docs": 0,
                                                              "chars": 0})
            src["docs"] += 1
            src["chars"] += len(d.text)
            if key < cfg.data.val_fraction:
                val_pending[d.lang].append((key, ids, len(d.text)))
            else:
                w = raw_writers[d.lang]
                train_docs[d.lang].append((key, u, w.tokens, len(ids), len(d.text)))
                w.write(ids)
    bar.close()
    for w in raw_writers.values():
        w.close()
    for msg in report.skipped:
        log(f"warning: {msg}")
    check_languages_present({lang: stats[lang]["docs"] for lang in languages}, files)

    # every language needs val text: borrow the train document with the lowest split hash when val is empty
    raws = {lang: open_shard(out / f".train-{lang}.raw") for lang in languages}
    for lang in languages:
        if not val_pending[lang] and len(train_docs[lang]) > 1:
            i = min(range(len(train_docs[lang])), key=lambda j: train_docs[lang][j][0])
            key, _u, start, n, nchars = train_docs[lang].pop(i)
            val_pending[lang].append((key, [int(x) for x in raws[lang][start:start + n]], nchars))
            log(f"note: no {lang} document fell into val at val_fraction={cfg.data.val_fraction}; "
                f"moved one train document to val-{lang}.bin")
    val_files = {}
    for lang in languages:
        with ShardWriter(out / f"val-{lang}.bin", vocab) as w:
            for _key, ids, nchars in sorted(val_pending[lang], key=lambda x: x[0]):
                w.write(ids)
                split_stats["val"][lang]["docs"] += 1
                split_stats["val"][lang]["chars"] += nchars
                split_stats["val"][lang]["tokens"] += len(ids)
        val_files[lang] = f"val-{lang}.bin"
    for lang in languages:
        for _key, _u, _start, n, nchars in train_docs[lang]:
            split_stats["train"][lang]["docs"] += 1
            split_stats["train"][lang]["chars"] += nchars
            split_stats["train"][lang]["tokens"] += n

    # resample the train split to the target TOKEN mix
    natural = {lang: split_stats["train"][lang]["tokens"] for lang in languages}
    mix = {lang: cfg.data.mix.get(lang, 0.0) for lang in languages}
    factors = repeat_factors(natural, mix)
    order: list[tuple[float, str, int]] = []
    for lang in languages:
        f = factors[lang]
        whole = int(f)
        # the fractional part: documents in hash order until their tokens reach it (exact to one document)
        extra_tokens = (f - whole) * natural[lang]
        chosen: set[int] = set()
        taken = 0
        for j in sorted(range(len(train_docs[lang])), key=lambda j: train_docs[lang][j][1]):
            if taken + train_docs[lang][j][3] / 2 > extra_tokens:
                break
            chosen.add(j)
            taken += train_docs[lang][j][3]
        for j, (key, u, _start, _n, _c) in enumerate(train_docs[lang]):
            for c in range(whole + (1 if j in chosen else 0)):
                order.append((_doc_hash_pair(f"{key!r}:{u!r}:{c}")[0], lang, j))
    order.sort()
    shards: list[str] = []
    resampled = {lang: 0 for lang in languages}
    writer = None
    for _h, lang, j in tqdm(order, desc="writing shards", unit="doc", dynamic_ncols=True, mininterval=0.5,
                            disable=len(order) < 2000):
        if writer is None or writer.tokens >= shard_tokens:
            if writer is not None:
                writer.close()
            name = f"train-{len(shards):05d}.bin"
            shards.append(name)
            writer = ShardWriter(out / name, vocab)
        _key, _u, start, n, _c = train_docs[lang][j]
        writer.write(raws[lang][start:start + n])
        resampled[lang] += n
    if writer is None:
        raise DataError(f"no train documents left in {cfg.data.paths} after the val split "
                        f"(val_fraction={cfg.data.val_fraction}); add data or lower data.val_fraction")
    writer.close()
    del raws
    for lang in languages:
        (out / f".train-{lang}.raw").unlink()

    total_train = sum(resampled.values())
    languages_out = {}
    for lang in languages:
        st = stats[lang]
        languages_out[lang] = {
            "docs": st["docs"], "chars": st["chars"], "tokens": st["tokens"],
            "chars_per_token": st["chars"] / max(st["tokens"], 1),
            "bengali_letters_share": st["bengali_letters_share"] / max(st["chars"], 1),
            "repeat_factor": factors[lang],
        }
    index = {
        "format_version": FORMAT_VERSION,
        "dtype": str(dtype_for_vocab(vocab)),
        "vocab_size": vocab,
        "eot_id": eot,
        "tokenizer_sha256": tokenizer_sha256(tok_dir),
        "tokenizer_dir": str(tok_dir),
        "inputs": inputs,
        "splits": {
            "train": {"shards": shards, "tokens": total_train, "tokens_by_lang": resampled,
                      "natural": split_stats["train"]},
            "val": {"shards": [val_files[lang] for lang in languages],
                    "tokens": sum(split_stats["val"][lang]["tokens"] for lang in languages),
                    "tokens_by_lang": {lang: split_stats["val"][lang]["tokens"] for lang in languages},
                    "chars_by_lang": {lang: split_stats["val"][lang]["chars"] for lang in languages},
                    "docs_by_lang": {lang: split_stats["val"][lang]["docs"] for lang in languages},
                    "files": val_files},
        },
        "languages": languages_out,
        "target_mix": {lang: mix[lang] / max(sum(mix.values()), 1e-12) for lang in languages},
        "token_mix": {lang: resampled[lang] / max(total_train, 1) for lang in languages},
        "char_mix": {lang: stats[lang]["chars"] / max(sum(s["chars"] for s in stats.values()), 1)
                     for lang in languages},
        "sources": sorted(sources.values(), key=lambda s: (-s["chars"], s["source"])),
        "skipped": report.skipped,
        "skipped_other_language_docs": skipped_lang,
    }
    return index


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
    files = list_input_files(cfg.data.paths)
    inputs = input_fingerprints(files)
    tok_dir = ensure_tokenizer(cfg, files, inputs, log)
    fp = shards_fingerprint(cfg, inputs, tokenizer_sha256(tok_dir))
    shard_dir = resolve_path(cfg.data.cache_dir) / "shards" / fp
    if (shard_dir / "index.json").is_file():
        index = json.loads((shard_dir / "index.json").read_text())
        log(f"shards: cache hit, reusing {shard_dir}")
    else:
        t0 = time.time()
        with atomic_dir(shard_dir, overwrite=True) as tmp:
            index = build_shards(cfg, files, inputs, tok_dir, tmp, log)
            atomic_write_json(tmp / "index.json", index)
        dt = time.time() - t0
        mb = sum(i["bytes"] for i in inputs) / 1e6
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
    add_config_args(pp)
    pp.add_argument("--strict", action="store_true", help="a bad input file is an error instead of a warning")
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.strict:
            cfg.data.strict = True
        prep = prepare(cfg, log=lambda m: print(m, file=sys.stderr))
    except (DataError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(prep.shard_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["prepare", "Prepared", "repeat_factors", "mix_report", "tokenizer_fingerprint", "shards_fingerprint",
           "build_shards", "ensure_tokenizer"]
