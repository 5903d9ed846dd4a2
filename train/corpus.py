"""Reading a text corpus into NFC documents with a language, a source and a licence.

Inputs (DESIGN.md, "Data"): folders (searched recursively, in sorted order), ``.jsonl`` files (one JSON object
a line with a string field ``text``; optional ``lang``, ``source``, ``license``, ``title``), ``.txt`` files
(documents separated by blank lines), either gzipped (``.jsonl.gz``, ``.txt.gz``), and Hugging Face datasets
sources ``hf:NAME[:CONFIG][:SPLIT]`` streamed through ``datasets.load_dataset(..., streaming=True)``
(``NAME`` may be a hub id or a local dataset folder).

Bad input never aborts a long read: a file that is not valid UTF-8 (or not valid gzip) is skipped and its path
and byte offset reported; a JSON line that is not an object with a string ``text`` is skipped and reported. With
``strict=True`` each of those is a :class:`DataError` instead. An empty path, a path that does not exist or a
folder without documents is always a :class:`DataError` naming it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from train.atomic import sha256_file
from train.textutil import bengali_letter_share, language_of_share, nfc

SUFFIXES = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


class DataError(ValueError):
    """An input that cannot be read: names the path (and byte offset or line) and what was expected."""


@dataclass
class Document:
    """One NFC-normalised document.

    ``lang`` is decided by script (``train.textutil.detect_language``), whatever the input's ``lang`` field
    says; ``origin`` is the file path or ``hf:`` spec it came from.
    """

    text: str
    lang: str
    source: str
    license: str | None = None
    title: str | None = None
    origin: str = ""
    bengali_share: float = 0.0  # share of the letters that are Bengali-block letters


@dataclass
class ReadReport:
    """What a read skipped, for the user and for ``index.json``."""

    skipped: list[str] = field(default_factory=list)
    files: int = 0

    def warn(self, message: str, strict: bool) -> None:
        if strict:
            raise DataError(message + " (strict mode: fix the input or drop --strict / data.strict)")
        self.skipped.append(message)


def is_hf_spec(path: str) -> bool:
    """True for a Hugging Face datasets source ``hf:NAME[:CONFIG][:SPLIT]``."""
    return str(path).startswith("hf:")


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:NAME[:CONFIG][:SPLIT]`` → (NAME, CONFIG or None, SPLIT, default ``train``).

    Raises DataError for an empty name.
    """
    parts = spec[3:].split(":")
    name = parts[0]
    if not name:
        raise DataError(f"data source {spec!r}: expected hf:NAME[:CONFIG][:SPLIT] with a non-empty NAME")
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return name, config, split


def list_input_files(paths: list[str]) -> list[str]:
    """Expand folders into their corpus files; keep ``hf:`` specs as they are.

    Returns a list of file paths (as strings) and ``hf:`` specs, in a deterministic order. Raises DataError
    for an empty path, a missing path, a file with an unsupported suffix or a folder with no corpus files.
    """
    from train.config import resolve_path

    out: list[str] = []
    if not paths:
        raise DataError("no data paths given: expected at least one folder, file or hf:NAME source")
    for raw in paths:
        p = str(raw).strip()
        if not p:
            raise DataError("data path is empty: expected a folder, a .jsonl/.txt[.gz] file or hf:NAME[:CONFIG][:SPLIT]")
        if is_hf_spec(p):
            parse_hf_spec(p)
            out.append(p)
            continue
        path = resolve_path(p)
        if not path.exists():
            raise DataError(f"data path {p!r} does not exist")
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.is_file() and str(f).endswith(SUFFIXES))
            if not found:
                raise DataError(f"folder {p!r} holds no documents: expected files ending in {', '.join(SUFFIXES)}")
            out.extend(found)
        elif str(path).endswith(SUFFIXES):
            out.append(str(path))
        else:
            raise DataError(f"data file {p!r}: unsupported type; expected one of {', '.join(SUFFIXES)}")
    return out


def input_fingerprints(files: list[str]) -> list[dict]:
    """``[{path, sha256, bytes}]`` for every input; an ``hf:`` source is keyed by its spec (and, for a local
    dataset folder, by the hashes of its files)."""
    out = []
    for f in files:
        if is_hf_spec(f):
            name, _, _ = parse_hf_spec(f)
            h = hashlib.sha256(f.encode())
            local = Path(name)
            nbytes = 0
            if local.is_dir():
                for sub in sorted(x for x in local.rglob("*") if x.is_file()):
                    h.update(sha256_file(str(sub)).encode())
                    nbytes += sub.stat().st_size
            out.append({"path": f, "sha256": h.hexdigest(), "bytes": nbytes})
        else:
            out.append({"path": f, "sha256": sha256_file(f), "bytes": Path(f).stat().st_size})
    return out


def _read_text(path: str, report: ReadReport, strict: bool) -> str | None:
    """The file's text (gunzipped, strict UTF-8), or None after reporting why it was skipped."""
    try:
        raw = Path(path).read_bytes()
        if path.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        report.warn(f"skipped {path}: cannot read it as {'gzip' if path.endswith('.gz') else 'a file'} ({e})", strict)
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = "after decompression" if path.endswith(".gz") else "in the file"
        report.warn(f"skipped {path}: not valid UTF-8 at byte offset {e.start} {where} ({e.reason})", strict)
        return None


def _make_doc(text: str, meta: dict, default_source: str, origin: str) -> Document | None:
    t = nfc(text)
    if not t.strip():
        return None
    lic = meta.get("license")
    title = meta.get("title")
    share = bengali_letter_share(t)
    return Document(
        text=t,
        lang=language_of_share(share),
        bengali_share=share,
        source=str(meta.get("source") or default_source),
        license=str(lic) if lic is not None else None,
        title=str(title) if title is not None else None,
        origin=origin,
    )


def _iter_file(path: str, report: ReadReport, strict: bool,
               progress: Callable[[float], None] | None) -> Iterator[Document]:
    text = _read_text(path, report, strict)
    if text is None:
        if progress:
            progress(1.0)
        return
    report.files += 1
    name = Path(path).name
    stem = name.split(".")[0]
    total = max(len(text), 1)
    done = 0
    if ".jsonl" in name:
        for lineno, line in enumerate(text.split("\n"), start=1):
            done += len(line) + 1
            if progress:
                progress(min(done / total, 1.0))
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                report.warn(f"skipped {path}:{lineno}: not valid JSON ({e.msg})", strict)
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                report.warn(f"skipped {path}:{lineno}: expected a JSON object with a string field \"text\"", strict)
                continue
            doc = _make_doc(obj["text"], obj, stem, path)
            if doc is not None:
                yield doc
    else:
        for piece in _BLANK_LINES.split(text.replace("\r\n", "\n")):
            done += len(piece) + 2
            if progress:
                progress(min(done / total, 1.0))
            doc = _make_doc(piece.strip("\n"), {}, stem, path)
            if doc is not None:
                yield doc


def _iter_hf(spec: str) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is in the train extra
        raise DataError(f"data source {spec!r} needs the 'datasets' package: pip install 'shalik[train]'") from e
    name, config, split = parse_hf_spec(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; name the source and pass the reason on
        raise DataError(f"data source {spec!r}: cannot open it with datasets.load_dataset: {e}") from None
    for row in ds:
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            doc = _make_doc(row["text"], row, name.rstrip("/").split("/")[-1], spec)
            if doc is not None:
                yield doc


def iter_documents(files: list[str], strict: bool = False, report: ReadReport | None = None,
                   progress: Callable[[int, float], None] | None = None) -> Iterator[Document]:
    """Yield the documents of already-expanded inputs (see :func:`list_input_files`) in order.

    ``progress(i, fraction)`` is called as file ``i`` is read (fraction of it done, 0..1).
    Raises DataError only in strict mode or for an unreadable ``hf:`` source.
    """
    report = report if report is not None else ReadReport()
    for i, f in enumerate(files):
        cb = (lambda frac, i=i: progress(i, frac)) if progress else None
        if is_hf_spec(f):
            yield from _iter_hf(f)
            if cb:
                cb(1.0)
        else:
            yield from _iter_file(f, report, strict, cb)
