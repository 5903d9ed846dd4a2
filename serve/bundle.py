"""Facts about a bundle that serving needs, each with one owner: the quantization setting, the end-of-text id,
and the manifest's integrity check.

* :func:`parse_quantize`: ``None`` / ``"none"`` / ``"int8"`` (any case) → ``None`` or ``"int8"``; used by
  :func:`serve.load`, the backends, the server's settings and the command lines.
* :func:`eot_id`: ``<|endoftext|>``'s id in a ``tokenizers.Tokenizer``; a :class:`BundleError` when it has none
  (every prompt starts with it, so there is no safe default).
* :func:`verify_files`: the sha256 of each file a backend reads against ``manifest.json``'s ``files`` table
  (``{name: {"sha256", "bytes"}}``, written by ``export``), hashed in 1 MiB blocks; a :class:`BundleError` that
  names the first file that differs. ``verify=False`` / ``SHALIK_VERIFY=0`` skip it (for those who verify the
  bundle elsewhere, e.g. a content-addressed store). Layout: docs/design.md "Bundle".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

EOT = "<|endoftext|>"
MANIFEST = "manifest.json"
GENERATION_CONFIG = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty")
QUANTIZE_CHOICES = ("none", "int8")
HASH_BLOCK = 1 << 20


class BundleError(ValueError):
    """A bundle that cannot be served as it is: a file differs from its manifest, a fact is missing, ..."""


def parse_quantize(value: Any, name: str = "quantize") -> str | None:
    """``None`` / ``"none"`` → None, ``"int8"`` → ``"int8"`` (case-insensitive). ValueError naming ``name``
    (the argument, option or variable) for anything else."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in QUANTIZE_CHOICES:
        v = value.strip().lower()
        return None if v == "none" else v
    raise ValueError(f"{name} is {value!r}; expected None, 'none' or 'int8'")


def eot_id(tokenizer: Any) -> int:
    """The id of ``<|endoftext|>`` in ``tokenizer`` (a ``tokenizers.Tokenizer``). BundleError when absent."""
    i = tokenizer.token_to_id(EOT)
    if i is None:
        raise BundleError(f"the tokenizer has no {EOT} token: not a Shalik tokenizer (every prompt starts with it)")
    return int(i)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in :data:`HASH_BLOCK` blocks (memory stays flat for multi-GB weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def read_manifest(bundle: Path) -> dict:
    """``bundle/manifest.json`` as a dict. BundleError when missing, not JSON, or without a ``files`` table."""
    path = Path(bundle) / MANIFEST
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{path} is missing: cannot verify the bundle (export it with python -m export.onnx, "
                          "or load with verify=False / SHALIK_VERIFY=0)") from None
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: not a readable manifest ({e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        raise BundleError(f"{path}: no 'files' table of sha256 sums")
    return m


def verify_files(bundle: Path, names: Iterable[str]) -> None:
    """Check each of ``names`` (files in ``bundle`` that exist) against the manifest's sha256 and size.

    Raises BundleError naming the file for a size or sha256 that differs, or a file the manifest does not list
    (it cannot be vouched for). Missing files are left to the loader (it names them)."""
    bundle = Path(bundle)
    table = read_manifest(bundle)["files"]
    for name in names:
        path = bundle / name
        if not path.is_file():
            continue
        entry = table.get(name)
        if not isinstance(entry, dict) or "sha256" not in entry:
            raise BundleError(f"{path}: not listed in {MANIFEST}, so it cannot be verified "
                              "(re-export the bundle, or load with verify=False / SHALIK_VERIFY=0)")
        size = path.stat().st_size
        if "bytes" in entry and size != entry["bytes"]:
            raise BundleError(f"{path} is corrupt: {size} bytes, the manifest says {entry['bytes']} "
                              "(re-export or re-download the bundle)")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise BundleError(f"{path} is corrupt: sha256 {digest[:16]}…, the manifest says {entry['sha256'][:16]}… "
                              "(re-export or re-download the bundle)")


def sampling_defaults(bundle: str | Path) -> dict[str, float]:
    """The bundle's default sampling (``generation_config.json``, written by training from ``train.hf_files.SAMPLING``):
    ``{temperature, top_k, top_p, repetition_penalty}``. A bundle that does not sample by default (``do_sample``
    false or absent, as before these defaults existed) gives greedy: ``{"temperature": 0.0}``. BundleError for a
    missing or unreadable file."""
    path = Path(bundle) / GENERATION_CONFIG
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: cannot read the generation defaults ({e})") from None
    if not isinstance(cfg, dict) or not cfg.get("do_sample"):
        return {"temperature": 0.0}
    return {k: cfg[k] for k in SAMPLING_KEYS if k in cfg}
