"""Shalik's script-aware byte-level BPE tokenizer, and tokenizer fertility.

The tokenizer (Hugging Face ``tokenizers``):

* normalizer NFC, inside ``tokenizer.json`` so the Python and Rust paths share it;
* pre-tokenizer ``Split(SPLIT_PATTERN, "isolated")`` then ``ByteLevel(add_prefix_space=False,
  use_regex=False)``. A word is a run of letters AND marks AND ZWJ/ZWNJ (``[\\p{L}\\p{M}\\u200c\\u200d]+``), so a
  Bangla word keeps its vowel signs, virama, nukta and candrabindu; GPT-2's ``\\p{L}+`` cuts "বাংলা" into
  ব · াং · ল · া. A word may take one leading non-letter (a space, a quote, a bracket), numbers go in runs of up
  to three digits and newlines group with the punctuation before them, as in OpenAI's cl100k pattern;
* model BPE over the 256 byte symbols, specials ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1);
* decoder ByteLevel: ``decode(encode(x)) == NFC(x)`` exactly (no prefix space, no clean-up of spaces).

Fertility is NFC code points per token (DESIGN.md).

Command lines::

    python -m train.tokenizer train     --data P... [--vocab-size 32000] --out DIR [--config C]
    python -m train.tokenizer fertility --tokenizer DIR --data P... [--split val] [--compare T...] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from train.atomic import atomic_dir, sha256_file
from train.corpus import DataError, Document, iter_documents, list_input_files
from train.textutil import is_val, split_value

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD]
LANG_NAMES = {"bn": "Bangla", "en": "English"}
_WORD = "\\p{L}\\p{M}\u200c\u200d"
SPLIT_PATTERN = (
    f"[^\\r\\n{_WORD}\\p{{N}}]?[{_WORD}]+"  # a word, with at most one leading non-letter (space, quote…)
    "| ?\\p{N}{1,3}"  # numbers, up to three digits a token (Bangla digits are \p{N} too)
    f"| ?[^\\s{_WORD}\\p{{N}}]+[\\r\\n]*"  # punctuation runs, with the newlines after them
    "|\\s*[\\r\\n]+"  # newlines
    "|\\s+(?!\\S)"  # spaces before spaces
    "|\\s+"
)
# Issue 2's baseline (figures.md): letters+marks words, single digits, trained on equal bn/en characters.
BASELINE_PATTERN = " ?[\\p{L}\\p{M}]+| ?\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+|\\s+(?!\\S)|\\s+"


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be used."""


def new_tokenizer(pattern: str = SPLIT_PATTERN) -> Tokenizer:
    """An untrained Shalik tokenizer (NFC, script-aware split, byte-level BPE, ByteLevel decoder)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 32000, min_frequency: int = 2,
                    pattern: str = SPLIT_PATTERN, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (strings); returns a ``tokenizers.Tokenizer``.

    ``<|endoftext|>`` gets id 0 and ``<|pad|>`` id 1; all 256 byte symbols are in the vocabulary, so any text
    encodes. Raises TokenizerError for a vocab_size below 256 + 2.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise TokenizerError(f"vocab_size {vocab_size}: expected at least {256 + len(SPECIAL_TOKENS)}")
    tok = new_tokenizer(pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def sample_quotas(available: dict[str, int], weights: dict[str, float], sample_chars: int) -> dict[str, int]:
    """Characters to take per language: ``sample_chars`` split by ``weights``, scaled down uniformly when a
    language has fewer characters than its share so the ratio between languages holds.

    >>> sample_quotas({"bn": 7_000_000, "en": 9_000_000}, {"bn": 0.6, "en": 0.4}, 20_000_000)
    {'bn': 7000000, 'en': 4666666}
    """
    total_w = sum(weights.get(lang, 0.0) for lang in available)
    if total_w <= 0:
        return {lang: 0 for lang in available}
    want = {lang: sample_chars * weights.get(lang, 0.0) / total_w for lang in available}
    scale = min([1.0] + [available[lang] / want[lang] for lang in available if want[lang] > 0])
    return {lang: int(want[lang] * scale) for lang in available}


def sample_texts(files: list[str], languages: list[str], weights: dict[str, float], sample_chars: int,
                 val_fraction: float, strict: bool = False) -> tuple[Callable[[], Iterator[str]], dict]:
    """Choose the tokenizer's training sample from the TRAIN split, balanced by language.

    Two passes: the first counts train characters per language and each document's split hash; the
    documents with the lowest hashes (above ``val_fraction``) are taken per language up to its quota
    (:func:`sample_quotas`). Returns ``(make_iterator, stats)`` where ``make_iterator()`` streams the chosen
    texts and ``stats`` = ``{lang: {"available": chars, "sampled": chars, "docs": n}}``.
    """
    keys: dict[str, list[tuple[float, int]]] = {lang: [] for lang in languages}
    seen = {lang: 0 for lang in languages}
    for doc in iter_documents(files, strict=strict):
        if doc.lang not in keys:
            continue
        seen[doc.lang] += 1
        key = split_value(doc.text)
        if key < val_fraction:
            continue
        keys[doc.lang].append((key, len(doc.text)))
    check_languages_present(seen, files)
    available = {lang: sum(n for _, n in v) for lang, v in keys.items()}
    quotas = sample_quotas(available, weights, sample_chars)
    thresholds: dict[str, float] = {}
    stats = {}
    for lang, v in keys.items():
        v.sort()
        taken = docs = 0
        thr = -1.0
        for key, n in v:
            if taken >= quotas[lang]:
                break
            taken += n
            docs += 1
            thr = key
        thresholds[lang] = thr
        stats[lang] = {"available": available[lang], "sampled": taken, "docs": docs}

    def make_iterator() -> Iterator[str]:
        for doc in iter_documents(files, strict=strict):
            thr = thresholds.get(doc.lang, -1.0)
            if thr >= 0:
                key = split_value(doc.text)
                if val_fraction <= key <= thr:
                    yield doc.text

    return make_iterator, stats


def check_languages_present(docs_by_lang: dict[str, int], inputs: list[str]) -> None:
    """Raise DataError naming every configured language without a single document in ``inputs``."""
    missing = [lang for lang, n in docs_by_lang.items() if n == 0]
    if missing:
        names = ", ".join(f"{lang} ({LANG_NAMES.get(lang, lang)})" for lang in missing)
        shown = ", ".join(inputs[:3]) + (" …" if len(inputs) > 3 else "")
        raise DataError(f"data.languages includes {names} but no such documents were found in {shown} "
                        f"(language is decided by script: bn when most letters are Bengali)")


def tokenizer_config(model_max_length: int = 2048) -> dict:
    """``tokenizer_config.json`` for ``transformers.AutoTokenizer`` (PreTrainedTokenizerFast over tokenizer.json).

    ``clean_up_tokenization_spaces`` is false and no prefix space is added: decode(encode(x)) must return x.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
    }


def write_tokenizer_files(tok: Tokenizer, out_dir: Path, model_max_length: int = 2048) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into an existing (temporary) folder."""
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 2048, overwrite: bool = False) -> Path:
    """Save atomically into ``out_dir`` (built in a temporary folder, then renamed). Returns the folder."""
    with atomic_dir(Path(out_dir), overwrite=overwrite) as tmp:
        write_tokenizer_files(tok, tmp, model_max_length)
    return Path(out_dir)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a folder (or the file itself). Raises TokenizerError naming the path."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise TokenizerError(f"tokenizer {str(path)!r}: no tokenizer.json there")
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on parse errors
        raise TokenizerError(f"tokenizer {str(f)!r}: cannot be read ({e})") from None
    if tok.token_to_id(EOT) != 0:
        raise TokenizerError(f"tokenizer {str(f)!r}: expected {EOT} at id 0, found it at {tok.token_to_id(EOT)}")
    return tok


def tokenizer_sha256(path: str | Path) -> str:
    """sha256 of the folder's ``tokenizer.json`` bytes."""
    p = Path(path)
    return sha256_file(p / "tokenizer.json" if p.is_dir() else p)


def token_char_counts(tok: Tokenizer) -> list[int]:
    """For every id, the number of UTF-8 lead bytes in its byte string: summed over a token sequence this is
    its NFC code point count, even where a token boundary cuts a character (used for bits per character).
    Special tokens count 0."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    vocab = tok.get_vocab(with_added_tokens=True)
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    counts = [0] * tok.get_vocab_size(with_added_tokens=True)
    for token, idx in vocab.items():
        if token in specials:
            continue
        bs = bytes(byte_of[c] for c in token if c in byte_of)
        counts[idx] = sum(1 for b in bs if (b & 0xC0) != 0x80)
    return counts


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (256 entries) that byte-level BPE vocabularies spell tokens with
    (Radford et al. 2019, encoder.py; Hugging Face's ByteLevel uses the same table)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# ----------------------------------------------------------------------------------------- fertility

class TokenizerAdapter:
    """A tokenizer of any supported format behind ``encode(text) -> list[int]`` / ``decode(ids) -> str``."""

    def __init__(self, name: str, kind: str, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 vocab_size: int, encode_batch: Callable[[list[str]], list[list[int]]] | None = None):
        self.name, self.kind, self.encode, self.decode, self.vocab_size = name, kind, encode, decode, vocab_size
        self.encode_batch = encode_batch or (lambda texts: [encode(t) for t in texts])


def _hf_adapter(tok: Tokenizer, name: str, kind: str) -> TokenizerAdapter:
    return TokenizerAdapter(
        name, kind,
        encode=lambda t: tok.encode(t, add_special_tokens=False).ids,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        vocab_size=tok.get_vocab_size(),
        encode_batch=lambda ts: [e.ids for e in tok.encode_batch(ts, add_special_tokens=False)],
    )


def load_any_tokenizer(path: str | Path) -> TokenizerAdapter:
    """Load a tokenizer folder or file, detecting the format from the content: a ``tokenizer.json``
    (Hugging Face), a SentencePiece model (protobuf), a ``vocab.json`` + ``merges.txt`` folder (GPT-2 style
    byte-level BPE) or a WordPiece ``vocab.txt``. Raises TokenizerError when nothing usable is found."""
    p = Path(path)
    name = p.name if p.is_dir() else p.parent.name or p.stem
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise TokenizerError(f"tokenizer {str(path)!r} does not exist")
    for f in files:
        head = f.read_bytes()[:4096] if f.is_file() else b""
        if head.lstrip().startswith(b"{"):
            try:
                obj = json.loads(f.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
                return _hf_adapter(Tokenizer.from_file(str(f)), name, "tokenizer.json")
            merges = f.with_name("merges.txt")
            if isinstance(obj, dict) and merges.is_file():
                bpe = Tokenizer(models.BPE.from_file(str(f), str(merges)))
                bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                bpe.decoder = decoders.ByteLevel()
                return _hf_adapter(bpe, name, "vocab.json+merges.txt")
    for f in files:
        if f.is_file() and f.suffix == ".model":
            import sentencepiece as spm

            try:
                sp = spm.SentencePieceProcessor(model_file=str(f))
            except Exception:  # noqa: BLE001 - not a SentencePiece model after all
                continue
            return TokenizerAdapter(name, "sentencepiece", encode=lambda t, sp=sp: sp.encode(t),
                                    decode=lambda ids, sp=sp: sp.decode(ids), vocab_size=sp.get_piece_size(),
                                    encode_batch=lambda ts, sp=sp: sp.encode(ts))
    for f in files:
        if f.is_file() and f.name == "vocab.txt":
            from tokenizers.implementations import BertWordPieceTokenizer

            wp = BertWordPieceTokenizer(str(f), lowercase=True)
            return TokenizerAdapter(
                name, "wordpiece", encode=lambda t, wp=wp: wp.encode(t, add_special_tokens=False).ids,
                decode=lambda ids, wp=wp: wp.decode(ids), vocab_size=wp.get_vocab_size(),
                encode_batch=lambda ts, wp=wp: [e.ids for e in wp.encode_batch(ts, add_special_tokens=False)])
    raise TokenizerError(f"tokenizer {str(path)!r}: no tokenizer.json, SentencePiece model, vocab.json+merges.txt "
                         f"or vocab.txt found")


def fertility(adapter: TokenizerAdapter, docs: Iterable[Document], group: Callable[[Document], str] = lambda d: d.lang,
              batch: int = 64) -> dict[str, dict]:
    """Per group (language by default): ``docs, chars`` (NFC code points), ``bytes`` (UTF-8), ``words``
    (whitespace-separated), ``tokens``, ``chars_per_token``, ``bytes_per_token``, ``tokens_per_word`` and
    ``roundtrip_failures`` (documents where decode(encode(x)) != x)."""
    acc: dict[str, dict] = {}
    pending: list[Document] = []

    def flush() -> None:
        ids_list = adapter.encode_batch([d.text for d in pending])
        for d, ids in zip(pending, ids_list):
            a = acc.setdefault(group(d), {"docs": 0, "chars": 0, "bytes": 0, "words": 0, "tokens": 0,
                                          "roundtrip_failures": 0})
            a["docs"] += 1
            a["chars"] += len(d.text)
            a["bytes"] += len(d.text.encode("utf-8"))
            a["words"] += len(d.text.split())
            a["tokens"] += len(ids)
            if adapter.decode(list(ids)) != d.text:
                a["roundtrip_failures"] += 1
        pending.clear()

    for d in docs:
        pending.append(d)
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    for a in acc.values():
        t = max(a["tokens"], 1)
        a["chars_per_token"] = a["chars"] / t
        a["bytes_per_token"] = a["bytes"] / t
        a["tokens_per_word"] = a["tokens"] / max(a["words"], 1)
    return acc


def split_docs(files: list[str], split: str, val_fraction: float, strict: bool = False) -> Iterator[Document]:
    """Documents of one split (``val``, ``train`` or ``all``)."""
    if split not in ("val", "train", "all"):
        raise ValueError(f"split {split!r}: expected val, train or all")
    for d in iter_documents(files, strict=strict):
        if split == "all" or (split == "val") == is_val(d.text, val_fraction):
            yield d


def _print_table(rows: list[tuple[str, dict[str, dict]]], out=sys.stdout) -> None:
    groups = sorted({g for _, res in rows for g in res})
    header = f"{'tokenizer':<22} {'vocab':>7}"
    for g in groups:
        header += f" | {g + ' chars/tok':>16} {'bytes/tok':>9} {'tok/word':>8} {'rt-fail':>7}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, res in rows:
        line = f"{name:<22} {res.get('_vocab', ''):>7}"
        for g in groups:
            r = res.get(g)
            if r is None:
                line += f" | {'-':>16} {'-':>9} {'-':>8} {'-':>7}"
            else:
                line += (f" | {r['chars_per_token']:>16.3f} {r['bytes_per_token']:>9.3f} {r['tokens_per_word']:>8.3f}"
                         f" {r['roundtrip_failures']:>7d}")
        print(line, file=out)


def _cmd_train(args) -> int:
    from train.config import ConfigError, config_from_args

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.vocab_size:
        cfg.tokenizer.vocab_size = args.vocab_size
    files = list_input_files(cfg.data.paths)
    make_iter, stats = sample_texts(files, cfg.data.languages, cfg.tokenizer.sample_weights,
                                    cfg.tokenizer.sample_chars, cfg.data.val_fraction, cfg.data.strict)
    for lang, s in stats.items():
        print(f"{lang}: sampling {s['sampled']:,} of {s['available']:,} train characters ({s['docs']} documents)")
    tok = train_tokenizer(make_iter(), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
    out = save_tokenizer(tok, args.out, cfg.model.max_position_embeddings, overwrite=args.force)
    print(f"wrote {out}/tokenizer.json (vocab {tok.get_vocab_size()}, sha256 {tokenizer_sha256(out)[:16]}…)")
    return 0


def _cmd_fertility(args) -> int:
    files = list_input_files(args.data)
    docs = list(split_docs(files, args.split, args.val_fraction))
    if not docs:
        print(f"error: no documents in the {args.split} split of {args.data}", file=sys.stderr)
        return 2
    rows = []
    for path in [args.tokenizer] + list(args.compare or []):
        ad = load_any_tokenizer(path)
        res = fertility(ad, docs)
        res["_vocab"] = ad.vocab_size
        rows.append((ad.name if path != args.tokenizer else f"{ad.name} (ours)", res))
    if args.json:
        print(json.dumps({name: res for name, res in rows}, indent=2, ensure_ascii=False))
    else:
        _print_table(rows)
        ours = rows[0][1]
        if "bn" in ours and "en" in ours:
            ratio = ours["bn"]["chars_per_token"] / max(ours["en"]["chars_per_token"], 1e-9)
            print(f"\nBangla / English characters per token: {ratio:.3f}"
                  + ("   WARNING: below 0.75 — the fertility trap" if ratio < 0.75 else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.tokenizer``."""
    from train.config import HelpFormatter, add_config_args

    p = argparse.ArgumentParser(prog="python -m train.tokenizer", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a tokenizer on the train split of --data",
                       formatter_class=HelpFormatter)
    add_config_args(t)
    t.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default: the config's, 32000)")
    t.add_argument("--out", required=True, help="output folder (tokenizer.json, tokenizer_config.json)")
    t.add_argument("--force", action="store_true", help="replace an existing output folder")
    f = sub.add_parser("fertility", help="characters per token by language, against other tokenizers",
                       formatter_class=HelpFormatter)
    f.add_argument("--tokenizer", required=True, help="our tokenizer folder (or any supported tokenizer)")
    f.add_argument("--data", nargs="+", required=True, help="text inputs (folders, files, hf:NAME)")
    f.add_argument("--split", default="val", choices=["val", "train", "all"], help="which documents to measure")
    f.add_argument("--val-fraction", type=float, default=0.01, help="the split's val fraction (data.val_fraction)")
    f.add_argument("--compare", nargs="*", default=[], metavar="T",
                   help="other tokenizers: folders or files (tokenizer.json, SentencePiece .model, "
                        "vocab.json+merges.txt, vocab.txt)")
    f.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    from train.corpus import DataError

    try:
        return _cmd_train(args) if args.cmd == "train" else _cmd_fertility(args)
    except (DataError, TokenizerError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EOT", "PAD", "SPLIT_PATTERN", "BASELINE_PATTERN", "new_tokenizer", "train_tokenizer", "sample_texts",
           "sample_quotas", "save_tokenizer", "load_tokenizer", "load_any_tokenizer", "fertility", "tokenizer_sha256",
           "token_char_counts"]
