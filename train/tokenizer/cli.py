"""Command lines of the tokenizer (docs/design.md, "Command lines")::

    python -m train.tokenizer train     --data P... [--vocab-size N] --out DIR [--config C]
    python -m train.tokenizer fertility --tokenizer DIR --data P... [--split val] [--compare T...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from contract.cli import HelpFormatter
from train.clean.split import document_codes
from train.config import DEFAULT_PRESET, ConfigError, add_config_args, config_from_args, load_config
from train.corpus import DataError, list_input_files
from train.tokenizer import TokenizerError, save_tokenizer, tokenizer_sha256, train_tokenizer
from train.tokenizer.fertility import fertility, load_any_tokenizer, print_table, split_docs
from train.tokenizer.sample import choose_sample

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what save_tokenizer writes, all --force replaces


def check_out(out: str, force: bool) -> Path:
    """``--out`` of ``train``, checked before any work: an empty name is refused; an existing entry is replaced
    only with ``force`` and only when it is a folder holding nothing but a tokenizer's files (:data:`TOKENIZER_FILES`)
    or nothing — ``--force`` never deletes a data folder or a file. Raises TokenizerError naming the path."""
    if not out.strip():
        raise TokenizerError("--out is empty; expected the folder to write tokenizer.json into")
    path = Path(out)
    if os.path.lexists(path):
        if not force:
            raise TokenizerError(f"--out {out} already exists (use --force to replace a tokenizer folder)")
        if path.is_symlink() or not path.is_dir():
            raise TokenizerError(f"--out {out} is a file, not a tokenizer folder; --force replaces only a folder of "
                                 f"{' and '.join(TOKENIZER_FILES)} (remove it yourself or choose another --out)")
        other = sorted(p.name for p in path.iterdir() if p.name not in TOKENIZER_FILES)
        if other:
            raise TokenizerError(f"--out {out} holds other files than a tokenizer's ({', '.join(other[:3])}"
                                 f"{', …' if len(other) > 3 else ''}); --force would delete them, so it is refused "
                                 "(remove the folder yourself or choose another --out)")
    return path


def _cmd_train(args) -> int:
    if args.vocab_size is not None:  # checked with the config's rules (tokenizer.vocab_size), before any work
        args.overrides = [*args.overrides, f"tokenizer.vocab_size={args.vocab_size}"]
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = check_out(args.out, args.force)
    files = list_input_files(cfg.data.paths)
    texts, stats = choose_sample(files, cfg.data.languages, cfg.tokenizer.sample_weights, cfg.tokenizer.sample_chars,
                                 cfg.data.val_fraction, cfg.data.strict, workers=cfg.data.num_workers,
                                 codes=document_codes(cfg, files))
    for lang, s in stats.items():
        print(f"{lang}: sampling {s['sampled']:,} of {s['available']:,} train characters ({s['docs']} documents)")
    tok = train_tokenizer(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency)
    check_out(args.out, args.force)  # again: something may have appeared at --out while the BPE trained
    save_tokenizer(tok, out, cfg.model.max_position_embeddings, overwrite=args.force)
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
        print_table(rows)
        ours = rows[0][1]
        if "bn" in ours and "en" in ours:
            ratio = ours["bn"]["chars_per_token"] / max(ours["en"]["chars_per_token"], 1e-9)
            print(f"\nBangla / English characters per token: {ratio:.3f}"
                  + ("   WARNING: below 0.75 — the fertility trap" if ratio < 0.75 else ""))
    return 0


def _default_vocab() -> str:
    """The default preset's vocabulary size, as --help shows it ("?" when the preset cannot be read)."""
    try:
        return f"{load_config(DEFAULT_PRESET).tokenizer.vocab_size:,}"
    except ConfigError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.tokenizer``."""
    p = argparse.ArgumentParser(prog="python -m train.tokenizer", description="Train Shalik's tokenizer, or "
                                "measure the fertility of tokenizers.",
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a tokenizer on the train split of --data",
                       formatter_class=HelpFormatter)
    add_config_args(t)
    t.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary size (default: the config's tokenizer.vocab_size, {_default_vocab()} for "
                        f"{DEFAULT_PRESET})")
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
    try:
        return _cmd_train(args) if args.cmd == "train" else _cmd_fertility(args)
    except (DataError, TokenizerError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

