"""Reading a text corpus into NFC documents with a language, a source and a licence.

Inputs (docs/design.md, "Data"): folders (searched recursively, in sorted order), ``.jsonl`` files (one JSON object
a line with a string field ``text``; optional ``lang``, ``source``, ``license``, ``title``, ``author``, and ``work``
or ``group``: the unit of the validation split, ``train.clean.works``), ``.txt`` files
(documents separated by blank lines), either gzipped (``.jsonl.gz``, ``.txt.gz``), and Hugging Face datasets
sources ``hf:NAME[:CONFIG][:SPLIT]`` streamed through ``datasets.load_dataset(..., streaming=True)``
(``NAME`` may be a hub id or a local dataset folder).

Bad input never aborts a long read: a file that is not valid UTF-8 (or not valid gzip) is skipped whole and its
path and byte offset reported; a JSON line that is not valid JSON (a 5000-digit integer and nesting too deep to
parse included), not an object with a string ``text``, or whose text holds a lone surrogate is skipped and its
path and line reported. With ``strict=True`` each of those is a :class:`DataError` instead. An empty path, a path
that does not exist or a folder without documents is always a :class:`DataError` naming it.

Files are read in :class:`Chunk` s with bounded memory, cut where parsing the whole file would cut too, so
``train.parallel`` can parse them in several processes and get the documents of one serial read.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from contract.text import bengali_letter_share, language_of_share, lone_surrogate, nfc
from train.config import resolve_path

LANG_NAMES = {"bn": "Bangla", "en": "English"}
SUFFIXES = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


class DataError(ValueError):
    """An input that cannot be read: names the path (and byte offset or line) and what was expected."""


@dataclass
class Document:
    """One NFC-normalised document.

    ``lang`` is decided by script (``contract.text.detect_language``), whatever the input's ``lang`` field
    says; ``origin`` is the file path or ``hf:`` spec it came from.
    """

    text: str
    lang: str
    source: str
    license: str | None = None
    title: str | None = None
    origin: str = ""
    author: str | None = None
    work: str | None = None  # a "work" or "group" field: the unit of the validation split (train.clean.works)
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


def expand_paths(paths: list[str], suffixes: tuple[str, ...] = SUFFIXES, reads: str = "documents are read from",
                 hf: bool = True) -> tuple[list[str], list[str]]:
    """``(files, others)``: the files of ``paths`` that end in one of ``suffixes`` (folders searched recursively, in
    sorted order; ``hf:`` specs kept as they are when ``hf``), and the other files found in those folders, which
    are not read.

    Raises DataError naming the path for no paths, an empty or missing path, a file named on its own with another
    suffix, an ``hf:`` spec when not ``hf`` (or one :func:`parse_hf_spec` refuses), and a folder with no such file;
    ``reads`` says in those messages what is read from the inputs (``"conversations are read from"``)."""
    accepted = f"files ending in {', '.join(suffixes[:-1])} or {suffixes[-1]}" + (
        ", folders of them or hf:NAME[:CONFIG][:SPLIT] sources" if hf else " or folders of them")
    if not paths:
        raise DataError(f"no data paths given: {reads} {accepted}")
    files: list[str] = []
    others: list[str] = []
    for raw in paths:
        p = str(raw).strip()
        if not p:
            raise DataError(f"data path is empty: {reads} {accepted}")
        if is_hf_spec(p):
            if not hf:
                raise DataError(f"data source {p!r}: {reads} {accepted}, not hf: sources")
            parse_hf_spec(p)
            files.append(p)
            continue
        path = resolve_path(p)
        if not path.exists():
            raise DataError(f"data path {p!r} does not exist")
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*") if f.is_file())
            mine = [f for f in found if f.endswith(suffixes)]
            if not mine:
                held = f" (it holds {len(found)} other file(s), e.g. {Path(found[0]).name!r})" if found else ""
                raise DataError(f"folder {p!r} holds no input files: {reads} {accepted}{held}")
            files += mine
            others += [f for f in found if not f.endswith(suffixes)]
        elif str(path).endswith(suffixes):
            files.append(str(path))
        else:
            raise DataError(f"data file {p!r}: {reads} {accepted}")
    return files, others


def list_input_files(paths: list[str]) -> list[str]:
    """The corpus files (:data:`SUFFIXES`) and ``hf:`` specs of ``paths``, folders expanded, in a deterministic
    order (:func:`expand_paths`; other files in folders are not corpus and not read). Raises DataError as it."""
    return expand_paths(paths)[0]


def _make_doc(text: str, meta: dict, default_source: str, origin: str) -> Document | None:
    t = nfc(text)
    if not t or t.isspace():
        return None
    lic = meta.get("license")
    title = meta.get("title")
    author = meta.get("author")
    work = meta.get("work", meta.get("group"))
    share = bengali_letter_share(t)
    return Document(
        text=t,
        lang=language_of_share(share),
        bengali_share=share,
        source=str(meta.get("source") or default_source),
        license=str(lic) if lic is not None else None,
        title=str(title) if title is not None else None,
        origin=origin,
        author=str(author) if author is not None else None,
        work=str(work) if work is not None else None,
    )


@dataclass
class Chunk:
    """A piece of one input, cut where reading the whole file would cut too (after a line of a ``.jsonl``, after
    a blank-line separator of a ``.txt``), so parsing the chunks one by one — in any process — gives the documents
    of parsing the whole file. ``kind`` is ``jsonl``, ``txt`` or ``rows`` (``hf:`` rows as ``(row number, text,
    meta)``; ``text`` then holds the default source name); ``first_line`` numbers the chunk's first line in its
    file; ``nbytes`` is how many bytes of the input file reading the chunk advanced (for progress)."""

    file_index: int
    origin: str
    kind: str
    first_line: int = 1
    text: str = ""
    rows: list = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Skip:
    """A whole input skipped (not readable as gzip or as UTF-8): the warning, where reading reaches the file."""

    file_index: int
    message: str


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def unreadable_reason(path: str, block_bytes: int = 1 << 22) -> str | None:
    """Why ``path`` cannot be read as (gzipped) strict UTF-8 text — ``"not valid UTF-8 at byte offset N in the
    file (reason)"``, ``"cannot read it as gzip (…)"`` — or None when it can. Streams the file (bounded memory);
    the offset is the first bad byte's in the (decompressed) stream, as a whole-file decode reports it."""
    gz = path.endswith(".gz")
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    consumed = 0
    try:
        with _open_bytes(path) as f:
            while True:
                block = f.read(block_bytes)
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    where = "after decompression" if gz else "in the file"
                    return f"not valid UTF-8 at byte offset {consumed - pending + e.start} {where} ({e.reason})"
                consumed += len(block)
                if not block:
                    return None
    except (OSError, EOFError, zlib.error) as e:
        return f"cannot read it as {'gzip' if gz else 'a file'} ({e})"


def _text_blocks(path: str, block_bytes: int) -> Iterator[tuple[str, int, bool]]:
    """``(decoded text, input bytes advanced, at the end)`` of a readable file, block by block; a UTF-8 byte-order
    mark at its start is dropped (Windows editors write one; left in, it broke the first JSON line)."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    with open(path, "rb") as raw:
        f = gzip.open(raw, "rb") if path.endswith(".gz") else raw
        pos = 0
        while True:
            block = f.read(block_bytes)
            text = decoder.decode(block, final=not block)
            now = raw.tell()
            yield text, now - pos, not block
            pos = now
            if not block:
                return


def _file_chunks(i: int, path: str, chunk_bytes: int) -> Iterator[Chunk]:
    jsonl = ".jsonl" in Path(path).name
    kind = "jsonl" if jsonl else "txt"
    carry = ""  # text after the last cut (CRLF already replaced in .txt)
    hold = ""  # a .txt block's trailing CR, kept back until the next block says whether a LF follows
    line = 1
    advanced = 0
    for text, nbytes, end in _text_blocks(path, chunk_bytes):
        advanced += nbytes
        if end:
            break
        if jsonl:
            buf = carry + text
            cut = buf.rfind("\n") + 1
        else:
            # the whole-file reading replaces CRLF once, before splitting: replace each new stretch once
            new = hold + text
            new, hold = (new[:-1], "\r") if new.endswith("\r") else (new, "")
            buf = carry + new.replace("\r\n", "\n")
            # cut after the last blank-line separator: the separators that splitting the whole text finds before it
            # are found the same way in this buffer (a match ends at its second newline; an attempt that fails
            # stops at the next newline, so none reads past the cut)
            cut = 0
            for m in _BLANK_LINES.finditer(buf):
                cut = m.end()
        piece, carry = buf[:cut], buf[cut:]
        if piece:
            yield Chunk(i, path, kind, first_line=line, text=piece, nbytes=advanced)
            advanced = 0
            line += piece.count("\n") if jsonl else 0
    yield Chunk(i, path, kind, first_line=line, text=carry + hold, nbytes=advanced)


def _hf_chunks(i: int, spec: str, rows_per_chunk: int) -> Iterator[Chunk]:
    # datasets is imported only for an hf: source: it is heavy, and most runs read files
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is in the train extra
        raise DataError(f"data source {spec!r} needs the 'datasets' package: pip install 'shalik[train]'") from e
    name, config, split = parse_hf_spec(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; name the source and pass the reason on
        raise DataError(f"data source {spec!r}: cannot open it with datasets.load_dataset: {e}") from None
    default_source = name.rstrip("/").split("/")[-1]
    rows: list = []
    for n, row in enumerate(ds, start=1):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            rows.append((n, row["text"], {k: row[k] for k in _META if row.get(k) is not None}))
        if len(rows) >= rows_per_chunk:
            yield Chunk(i, spec, "rows", rows=rows, text=default_source)
            rows = []
    yield Chunk(i, spec, "rows", rows=rows, text=default_source)


def iter_chunks(files: list[str], unreadable: dict[str, str | None] | None = None,
                chunk_bytes: int = 1 << 20, rows_per_chunk: int = 256) -> Iterator[Chunk | Skip]:
    """Cut already-expanded inputs into :class:`Chunk` s of about ``chunk_bytes`` of text, in reading order.

    ``unreadable`` maps a path to its :func:`unreadable_reason` when the caller knows it already (the input
    scan, ``train.inputs``); other files are checked here first. An unreadable file yields one :class:`Skip`
    and no chunk: a file is used whole or not at all. Memory is bounded by one block and one chunk.
    Raises DataError for an ``hf:`` source that cannot be opened.
    """
    for i, f in enumerate(files):
        if is_hf_spec(f):
            yield from _hf_chunks(i, f, rows_per_chunk)
            continue
        reason = unreadable[f] if unreadable is not None and f in unreadable else unreadable_reason(f)
        if reason is not None:
            yield Skip(i, f"skipped {f}: {reason}")
        else:
            yield from _file_chunks(i, f, chunk_bytes)


_META = ("source", "license", "title", "author", "work", "group")
def _lone_surrogate(obj: dict, origin: str, where: int) -> str | None:
    """A warning when a field we keep (text, source, license, title) holds a lone surrogate: such a string is not
    Unicode text (it has no UTF-8 form) and would abort the run later, when it is hashed or written."""
    for key in ("text", *_META):
        v = obj.get(key)
        at = lone_surrogate(v) if isinstance(v, str) else None
        if at is not None:
            return (f"skipped {origin}:{where}: field \"{key}\" holds a lone surrogate U+{ord(v[at]):04X} at "
                    f"character {at} (expected Unicode text; a JSON \\ud800-\\udfff escape needs its pair)")
    return None


def parse_chunk(chunk: Chunk) -> tuple[list[Document], list[str]]:
    """The documents of one chunk, and the warnings for what it skipped (``path:line: why``), in order.

    Never raises for bad input: a line that is not JSON (a 5000-digit integer, or nesting too deep to parse,
    included), not an object with a string ``text``, or whose kept fields hold a lone surrogate is a warning.
    """
    docs: list[Document] = []
    warnings: list[str] = []
    if chunk.kind == "txt":
        stem = Path(chunk.origin).name.split(".")[0]
        for piece in _BLANK_LINES.split(chunk.text):
            doc = _make_doc(piece.strip("\n"), {}, stem, chunk.origin)
            if doc is not None:
                docs.append(doc)
        return docs, warnings
    if chunk.kind == "rows":
        for n, text, meta in chunk.rows:
            bad = _lone_surrogate({"text": text, **meta}, chunk.origin, n)
            doc = None if bad else _make_doc(text, meta, chunk.text, chunk.origin)
            if bad:
                warnings.append(bad)
            elif doc is not None:
                docs.append(doc)
        return docs, warnings
    stem = Path(chunk.origin).name.split(".")[0]
    for lineno, line in enumerate(chunk.text.split("\n"), start=chunk.first_line):
        if not line.strip():
            continue
        where = f"skipped {chunk.origin}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            warnings.append(f"{where}: not valid JSON ({e.msg})")
            continue
        except ValueError as e:  # an integer longer than sys.get_int_max_str_digits() digits
            warnings.append(f"{where}: not valid JSON ({str(e).split(';')[0]})")
            continue
        except RecursionError:
            warnings.append(f"{where}: not valid JSON (nested too deeply to parse)")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            warnings.append(f"{where}: expected a JSON object with a string field \"text\"")
            continue
        # json.loads makes a lone surrogate only from a \u escape (the text itself was decoded as strict UTF-8)
        bad = _lone_surrogate(obj, chunk.origin, lineno) if "\\u" in line else None
        if bad:
            warnings.append(bad)
            continue
        doc = _make_doc(obj["text"], obj, stem, chunk.origin)
        if doc is not None:
            docs.append(doc)
    return docs, warnings


def iter_documents(files: list[str], strict: bool = False, report: ReadReport | None = None,
                   progress: Callable[[int, float], None] | None = None) -> Iterator[Document]:
    """Yield the documents of already-expanded inputs (see :func:`list_input_files`) in order, in this process
    (``train.parallel`` parses the same chunks in several).

    ``progress(i, fraction)`` is called as file ``i`` is read (fraction of it done, 0..1).
    Raises DataError only in strict mode or for an unreadable ``hf:`` source.
    """
    report = report if report is not None else ReadReport()
    sizes = [0 if is_hf_spec(f) else Path(f).stat().st_size for f in files]
    done = [0] * len(files)
    for c in iter_chunks(files):
        if isinstance(c, Skip):
            report.warn(c.message, strict)
            done[c.file_index] = sizes[c.file_index]
        else:
            docs, warnings = parse_chunk(c)
            for w in warnings:
                report.warn(w, strict)
            yield from docs
            done[c.file_index] += c.nbytes
        if progress:
            progress(c.file_index, min(done[c.file_index] / max(sizes[c.file_index], 1), 1.0))


def check_languages_present(docs_by_lang: dict[str, int], inputs: list[str], skipped: list[str] = ()) -> None:
    """Raise DataError naming every configured language without a single document in ``inputs``; the message
    lists what was skipped, and why (``skipped``: a ReadReport's warnings)."""
    missing = [lang for lang, n in docs_by_lang.items() if n == 0]
    if missing:
        names = ", ".join(f"{lang} ({LANG_NAMES.get(lang, lang)})" for lang in missing)
        shown = ", ".join(inputs[:3]) + (" …" if len(inputs) > 3 else "")
        msg = (f"data.languages includes {names} but no such documents were found in {shown} "
               f"(language is decided by script: bn when most letters are Bengali)")
        if skipped:
            msg += f"; skipped {len(skipped)} input(s) or line(s): " + "; ".join(skipped[:5])
            msg += " …" if len(skipped) > 5 else ""
        raise DataError(msg)
