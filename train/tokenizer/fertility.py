"""Tokenizer fertility — NFC code points per token (docs/design.md) — for our tokenizer and any other.

:func:`load_any_tokenizer` reads a ``tokenizer.json``, a SentencePiece model, a GPT-2 ``vocab.json`` +
``merges.txt`` pair or a WordPiece ``vocab.txt`` behind one :class:`TokenizerAdapter`; :func:`fertility` counts
per language (or any grouping) characters, bytes, words and tokens, and round-trip failures.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.implementations import BertWordPieceTokenizer

from contract.text import is_val
from train.corpus import Document, iter_documents
from train.tokenizer import TokenizerError


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
            try:
                sp = spm.SentencePieceProcessor(model_file=str(f))
            except Exception:  # noqa: BLE001 - not a SentencePiece model after all
                continue
            return TokenizerAdapter(name, "sentencepiece", encode=lambda t, sp=sp: sp.encode(t),
                                    decode=lambda ids, sp=sp: sp.decode(ids), vocab_size=sp.get_piece_size(),
                                    encode_batch=lambda ts, sp=sp: sp.encode(ts))
    for f in files:
        if f.is_file() and f.name == "vocab.txt":
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


def print_table(rows: list[tuple[str, dict[str, dict]]], out=sys.stdout) -> None:
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
