"""The input scan: each input file's sha256, size and readability, computed once and cached.

A fingerprint (``train.data``) needs every input's content hash before anything else can be decided (which
tokenizer, which shards), so hashing cannot ride along with tokenizing. It is cheap beside it — sha256 and gzip
run at hundreds of MB/s a core, tokenizing at about 1 MB/s — and it is done once: the result is kept in
``<cache_dir>/inputs.json``, keyed by the file's absolute path, size and ``st_mtime_ns`` (what rsync and git
trust to detect a change). A cache hit costs one ``stat``; every later step, rank or run reuses it. The same
pass checks that the file reads as (gzipped) UTF-8, so the tokenizing pass knows in advance which files to skip
whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from contract.atomic import atomic_write_json, sha256_file
from train.corpus import is_hf_spec, parse_hf_spec, unreadable_reason
from train.parallel import ordered_map

CACHE_FILE = "inputs.json"
CACHE_VERSION = 1


@dataclass
class InputFile:
    """One input: ``path`` (as listed), ``sha256`` of its bytes (of its files, for a local ``hf:`` folder),
    ``bytes`` on disk, and ``unreadable`` — why it cannot be read as text, or None."""

    path: str
    sha256: str
    bytes: int
    unreadable: str | None = None

    def fingerprint(self) -> dict:
        """The ``{path, sha256, bytes}`` entry of ``index.json``'s ``inputs``."""
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes}


def _scan_file(path: str) -> InputFile:
    return InputFile(path, sha256_file(path), Path(path).stat().st_size, unreadable_reason(path))


def _scan_hf(spec: str) -> InputFile:
    name, _, _ = parse_hf_spec(spec)
    h = hashlib.sha256(spec.encode())
    local = Path(name)
    nbytes = 0
    if local.is_dir():
        for sub in sorted(x for x in local.rglob("*") if x.is_file()):
            h.update(sha256_file(str(sub)).encode())
            nbytes += sub.stat().st_size
    return InputFile(spec, h.hexdigest(), nbytes)


def _key(path: str) -> tuple[str, dict]:
    st = os.stat(path)
    return str(Path(path).resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def scan_inputs(files: list[str], cache_dir: str | Path | None = None, workers: int = 1) -> list[InputFile]:
    """:class:`InputFile` for every input of :func:`train.corpus.list_input_files`, in order.

    Files not in the cache (or changed since: other size or mtime) are scanned by ``workers`` processes; the
    cache is rewritten atomically when something was added. ``hf:`` sources are hashed each time (a local
    dataset folder by its files' hashes; a hub id by its name).
    """
    cache_path = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    cached: dict = {}
    if cache_path is not None and cache_path.is_file():
        try:
            obj = json.loads(cache_path.read_text(encoding="utf-8"))
            if isinstance(obj, dict) and obj.get("version") == CACHE_VERSION and isinstance(obj.get("files"), dict):
                cached = obj["files"]
        except (OSError, ValueError):
            cached = {}  # a damaged cache is only a cache: scan again and rewrite it
    out: dict[int, InputFile] = {}
    todo: list[int] = []
    keys: dict[int, tuple[str, dict]] = {}
    for i, f in enumerate(files):
        if is_hf_spec(f):
            out[i] = _scan_hf(f)
            continue
        keys[i] = _key(f)
        hit = cached.get(keys[i][0])
        if isinstance(hit, dict) and all(hit.get(k) == v for k, v in keys[i][1].items()):
            out[i] = InputFile(f, hit["sha256"], hit["size"], hit.get("unreadable"))
        else:
            todo.append(i)
    for i, res in zip(todo, ordered_map(_scan_file, [files[i] for i in todo], min(workers, max(len(todo), 1)))):
        out[i] = res
        cached[keys[i][0]] = {**keys[i][1], "sha256": res.sha256, "unreadable": res.unreadable}
    if todo and cache_path is not None:
        atomic_write_json(cache_path, {"version": CACHE_VERSION, "files": cached})
    return [out[i] for i in range(len(files))]
