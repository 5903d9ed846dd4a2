"""Validation tokens for measuring the quantized forms: a run's val shards, or a folder/file given with --val-data.

Without ``--val-data`` the shard folder is found through the run: ``config.toml``'s ``data.cache_dir``, then the
``shards/*/index.json`` whose ``tokenizer_sha256`` equals the checkpoint tokenizer's (no input is re-read or
re-hashed). ``--val-data`` takes a shard folder (``val-*.bin`` + ``index.json``) or text inputs (a folder, .txt,
.jsonl, gzipped or not: every document becomes ``<|endoftext|>`` + its tokens, as in training).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from contract.atomic import sha256_file
from contract.bundle import CONFIG, TOKENIZER, eot_id
from export.errors import ExportError
from train.config import resolve_path
from train.corpus import DataError, iter_documents, list_input_files
from train.loader import val_windows
from train.shards import ShardError, open_shard

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

MAX_TOKENS_PER_LANG = 4096


@dataclass
class ValData:
    """Windows of ≤ ``seq_len + 1`` int64 ids per language and where they came from."""

    windows: dict[str, list[np.ndarray]]
    origin: str

    @property
    def tokens(self) -> int:
        """Predicted positions (targets) over all windows."""
        return sum(len(w) - 1 for ws in self.windows.values() for w in ws)


def from_shards(folder: Path, vocab_size: int, tokenizer_sha: str | None, seq_len: int,
                max_tokens: int = MAX_TOKENS_PER_LANG) -> ValData:
    """Windows from ``folder/val-*.bin``. Raises ExportError when the shards were made with another tokenizer
    or hold ids outside the vocabulary."""
    index = _read_index(folder)
    if tokenizer_sha and index.get("tokenizer_sha256") not in (None, tokenizer_sha):
        raise ExportError(f"{folder}: shards were tokenized with another tokenizer "
                          f"(sha256 {str(index.get('tokenizer_sha256'))[:12]}…, the checkpoint's is {tokenizer_sha[:12]}…)")
    files = sorted(folder.glob("val-*.bin"))
    if not files:
        raise ExportError(f"{folder}: no val-*.bin shards")
    out = {}
    for f in files:
        try:
            ids = open_shard(f)
        except ShardError as e:
            raise ExportError(str(e)) from None
        ws = val_windows(ids, seq_len, max_tokens)
        if ws and max(int(w.max()) for w in ws) >= vocab_size:
            raise ExportError(f"{f}: token ids beyond the model's vocabulary ({vocab_size})")
        if ws:
            out[f.stem.removeprefix("val-")] = ws
    return ValData(out, str(folder))


def from_text(path: Path, tokenizer_path: Path, eot_id: int, seq_len: int,
              max_tokens: int = MAX_TOKENS_PER_LANG) -> ValData:
    """Windows from text inputs, tokenized with the bundle's tokenizer, grouped by detected language."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    streams: dict[str, list[int]] = {}
    try:
        for doc in iter_documents(list_input_files([str(path)])):
            ids = streams.setdefault(doc.lang, [])
            if len(ids) <= max_tokens + 1:
                ids += [eot_id] + tok.encode(doc.text).ids
    except DataError as e:
        raise ExportError(f"--val-data {path}: {e}") from None
    out = {lang: val_windows(np.asarray(ids, dtype=np.int64), seq_len, max_tokens) for lang, ids in streams.items()}
    out = {k: v for k, v in out.items() if v}
    if not out:
        raise ExportError(f"--val-data {path}: no documents to measure on")
    return ValData(out, str(path))


def load_val_data(path: Path, vocab_size: int, tokenizer_path: Path, eot_id: int, seq_len: int) -> ValData:
    """``--val-data PATH``: a shard folder or text inputs. Raises ExportError naming a bad path."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"--val-data {path}: no such file or directory")
    if path.is_dir() and (path / "index.json").is_file():
        return from_shards(path, vocab_size, sha256_file(tokenizer_path), seq_len)
    return from_text(path, tokenizer_path, eot_id, seq_len)


def find_run_shards(run_dir: Path | None, tokenizer_path: Path) -> Path | None:
    """The cached shard folder made with this tokenizer, found through the run's config.toml; None if none."""
    conf = read_run_config(run_dir)
    if conf is None:
        return None
    cache = resolve_path(conf.get("data", {}).get("cache_dir", "cache")) / "shards"
    if not cache.is_dir():
        return None
    want = sha256_file(tokenizer_path)
    for idx in sorted(cache.glob("*/index.json")):
        try:
            if json.loads(idx.read_text()).get("tokenizer_sha256") == want:
                return idx.parent
        except (OSError, ValueError):
            continue
    return None


def run_seq_len(run_dir: Path | None, context: int) -> int:
    """The run's ``train.seq_len`` (what its val NLL was measured at), else min(context, 512)."""
    conf = read_run_config(run_dir) or {}
    try:
        return max(1, min(int(conf["train"]["seq_len"]), context))
    except (KeyError, TypeError, ValueError):
        return min(context, 512)


def read_run_config(run_dir: Path | None) -> dict | None:
    """The run's resolved ``config.toml`` as a dict, or None when there is none (or it is unreadable)."""
    if run_dir is None or not (run_dir / "config.toml").is_file():
        return None
    try:
        return tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_index(folder: Path) -> dict:
    try:
        return json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        return {}


def bundle_val_data(bundle: Path, val_data: str | Path | None = None,
                    max_tokens: int = MAX_TOKENS_PER_LANG) -> tuple[ValData | None, str]:
    """Validation windows for a finished bundle (``runs/NAME/bundle``): ``val_data`` (a shard folder or text), else
    the shards of its run folder (the bundle's parent) made with the bundle's tokenizer, as ``export.onnx`` finds
    them; windows of the run's ``train.seq_len`` + 1 ids. Returns ``(windows or None, why none)``. Raises
    ExportError for a bad ``val_data`` or unreadable bundle files."""
    bundle = Path(bundle)
    tok = bundle / TOKENIZER
    try:
        cfg = json.loads((bundle / CONFIG).read_text(encoding="utf-8"))
        vocab, context = int(cfg["vocab_size"]), int(cfg["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{bundle / CONFIG}: cannot read vocab_size / max_position_embeddings ({e})") from None
    run = bundle.resolve().parent
    seq = run_seq_len(run, context)
    if val_data is not None:
        try:
            eot = eot_id(Tokenizer.from_file(str(tok)))
        except Exception as e:  # noqa: BLE001 - BundleError, or tokenizers' own exception class
            raise ExportError(f"{tok}: {e}") from None
        return load_val_data(Path(val_data), vocab, tok, eot, seq), ""
    shards = find_run_shards(run, tok)
    if shards is None:
        return None, (f"no validation shards found through {run.name}/config.toml for this tokenizer "
                      "(pass --val-data PATH); not measured")
    return from_shards(shards, vocab, sha256_file(tok), seq, max_tokens), ""
