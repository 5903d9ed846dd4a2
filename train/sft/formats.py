"""Reading conversations: JSON Lines in the OpenAI / Hugging Face ``messages`` form, and Alpaca and ShareGPT rows
converted on read, from ``.jsonl`` / ``.jsonl.gz`` files, folders of them (searched recursively, in sorted order;
other files there are skipped and listed in :attr:`ReadStats.skipped_files`) or ``hf:`` sources
(:func:`train.corpus.parse_hf_spec`). A file named on its own must be ``.jsonl[.gz]``: :func:`jsonl_files`.

Row forms (one JSON object a line, or one ``datasets`` row):

* ``{"messages": [{"role": "system"|"user"|"assistant", "content": str | [text parts]}, ...]}``;
* Alpaca: ``{"instruction": str, "input": str (optional), "output": str, "system": str (optional)}`` →
  user ``instruction`` (and ``input`` after a blank line), assistant ``output`` (``input`` / ``system`` may be
  null or absent; any other non-string makes the row malformed);
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant", "value": str}, ...]}``.

An error about an Alpaca or ShareGPT row names the row's own keys (``input``, ``conversations[2].value``), not the
``messages`` it becomes.

Optional keys of any form: ``lang`` (the language asked; by default the script of the last user message),
``split`` ("train" or "validation"/"val"; by default the hash of ``group``, else of the rendered conversation,
against ``data.val_fraction``, as documents are split), ``group`` (rows of one group stay on one side), ``task``.

A row that is not a conversation (not JSON, not one of the forms, a bad role or content) is skipped with a
warning naming ``file:line`` and why (``strict``: a :class:`train.corpus.DataError` instead); a conversation
without an assistant turn is skipped and counted, strict or not.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from contract.chat_format import ChatFormatError, normalize_messages
from contract.text import detect_language, is_val
from train.corpus import DataError, expand_paths, is_hf_spec, parse_hf_spec, unreadable_reason

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
VAL_NAMES = ("validation", "val", "valid", "test")
SUFFIXES = (".jsonl", ".jsonl.gz")  # the files conversations (and train.sft.build's corpus) are read from
_CONTENT_AT = re.compile(r"^messages\[(\d+)\]\.content")
# a data folder's own documentation (a dataset card, a licence, notes, dot-files): not read, and not worth a word
_FOLDER_DOCS = re.compile(r"^(readme|licen[cs]e|copying|notice|changelog)\b.*|.*\.md|\..*", re.I)


@dataclass
class Conversation:
    """One conversation: checked, NFC ``messages``; ``lang`` asked; ``split`` "train" or "validation";
    ``origin`` (``file:line`` or ``hf:…:row``), the row's ``task`` (or None), ``source`` (the row's, else the file
    or dataset name) and ``license`` (the row's, or None)."""

    messages: list[dict]
    lang: str
    split: str
    origin: str
    task: str | None = None
    source: str = ""
    license: str | None = None


@dataclass
class ReadStats:
    """What reading skipped: ``skipped`` warnings (``file:line: why``), conversations ``no_assistant``, and
    ``skipped_files``: the files in data folders that are not ``.jsonl[.gz]`` (a README beside the data)."""

    skipped: list[str] = field(default_factory=list)
    no_assistant: int = 0
    rows: int = 0
    skipped_files: list[str] = field(default_factory=list)

    @property
    def unexpected_files(self) -> list[str]:
        """The skipped files a user may have meant as data (``pairs.json``, ``chats.csv``): all but a folder's
        documentation (``README*``, ``LICENSE*``, ``*.md``, dot-files, as a Hugging Face dataset folder holds)."""
        return [f for f in self.skipped_files if not _FOLDER_DOCS.fullmatch(Path(f).name)]


def jsonl_files(paths: list[str], reads: str = "conversations are read from", hf: bool = True
                ) -> tuple[list[str], list[str]]:
    """``(files, skipped)``: the ``.jsonl`` / ``.jsonl.gz`` files of ``paths`` and the other files found in their
    folders, which are not read (:func:`train.corpus.expand_paths` with :data:`SUFFIXES`: its errors, ``reads``
    saying what is read, ``hf`` whether ``hf:`` sources are taken)."""
    return expand_paths(paths, SUFFIXES, reads, hf)


def _kind(v) -> str:
    return "none" if v is None else type(v).__name__


def _named(msgs: list[dict], names: list[str]) -> list[dict]:
    """:func:`normalize_messages` of ``msgs``; an error about ``messages[i].content`` names ``names[i]`` instead
    (the key of the row the message came from)."""
    try:
        return normalize_messages(msgs)
    except ChatFormatError as e:
        m = _CONTENT_AT.match(str(e))
        if m is None:
            raise
        raise ChatFormatError(names[int(m.group(1))] + str(e)[m.end():]) from None


def to_messages(row) -> list[dict]:
    """The ``messages`` of a row in any of the three forms (see the module doc), checked and NFC-normalised by
    :func:`contract.chat_format.normalize_messages`. Raises ChatFormatError (or ValueError) saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        return normalize_messages(row["messages"])
    if "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise ValueError(f"conversations: expected a list of turns, got {_kind(turns)}")
        if not turns:
            raise ValueError("conversations: expected at least one turn, got an empty list")
        msgs = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES:
                got = t.get("from") if isinstance(t, dict) else type(t).__name__
                raise ValueError(f"conversations[{i}].from: expected one of {', '.join(SHAREGPT_ROLES)}, got {got!r}")
            msgs.append({"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")})
        return _named(msgs, [f"conversations[{i}].value" for i in range(len(msgs))])
    if "instruction" in row and "output" in row:
        for key in ("instruction", "output", "input", "system"):
            v = row.get(key)
            if v is None and key in ("input", "system"):
                continue
            if not isinstance(v, str):
                raise ValueError(f"{key}: expected a string, got {_kind(v)}")
            _named([{"role": "user", "content": v}], [key])
        user, extra, system = row["instruction"], row.get("input"), row.get("system")
        if extra is not None and extra.strip():
            user = f"{user}\n\n{extra}"
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        if system is not None and system.strip():
            msgs.insert(0, {"role": "system", "content": system})
        return normalize_messages(msgs)
    raise ValueError("expected a conversation: \"messages\", Alpaca \"instruction\"/\"output\" or ShareGPT "
                     "\"conversations\"")


def _split_of(row: dict, msgs: list[dict], val_fraction: float) -> str:
    given = row.get("split")
    if isinstance(given, str) and given:
        return "validation" if given.lower() in VAL_NAMES else "train"
    key = row.get("group")
    key = str(key) if key is not None else json.dumps(msgs, ensure_ascii=False, sort_keys=True)
    return "validation" if is_val(key, val_fraction) else "train"


def _lang_of(row: dict, msgs: list[dict]) -> str:
    if row.get("lang") in ("bn", "en"):
        return row["lang"]
    users = [m["content"] for m in msgs if m["role"] == "user"]
    return detect_language(users[-1] if users else msgs[-1]["content"])


def _stem(path: str) -> str:
    return parse_hf_spec(path)[0].rstrip("/").split("/")[-1] if is_hf_spec(path) else Path(path).name.split(".")[0]


def _rows(path: str) -> Iterator[tuple[str, object]]:
    """``(origin, parsed row or the parse error)`` of a file or an ``hf:`` source."""
    if is_hf_spec(path):
        try:
            import datasets  # noqa: PLC0415 - heavy, only for hf: sources
        except ImportError as e:  # pragma: no cover - datasets is in the train extra
            raise DataError(f"data source {path!r} needs the 'datasets' package: pip install 'shalik[train]'") from e
        name, config, split = parse_hf_spec(path)
        try:
            ds = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001 - datasets raises many types; name the source
            raise DataError(f"data source {path!r}: cannot open it with datasets.load_dataset: {e}") from None
        for n, row in enumerate(ds, start=1):
            yield f"{path}:{n}", row
        return
    reason = unreadable_reason(path)
    if reason:
        raise DataError(f"data file {path!r}: {reason}")
    # utf-8-sig: a byte-order mark at the start (Windows editors write one) would otherwise break the first row
    with (gzip.open(path, "rt", encoding="utf-8-sig") if path.endswith(".gz") else open(path, encoding="utf-8-sig")) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except (ValueError, RecursionError) as e:
                yield f"{path}:{n}", ValueError(f"not valid JSON ({str(e).splitlines()[0][:120]})")


def read_conversations(paths: list[str], val_fraction: float, strict: bool = False,
                       stats: ReadStats | None = None) -> list[Conversation]:
    """Every conversation of ``paths`` (see the module doc), in reading order. Raises DataError for a path that
    does not exist or cannot be read (:func:`jsonl_files`), and in ``strict`` mode for the first row that is not a
    conversation."""
    stats = stats if stats is not None else ReadStats()
    out = []
    files, stats.skipped_files = jsonl_files(paths)
    for path in files:
        for origin, row in _rows(path):
            stats.rows += 1
            try:
                if isinstance(row, Exception):
                    raise row
                msgs = to_messages(row)
            except (ChatFormatError, ValueError) as e:
                msg = f"skipped {origin}: {e}"
                if strict:
                    raise DataError(msg + " (strict mode: fix the input or drop --strict)") from None
                stats.skipped.append(msg)
                continue
            if not any(m["role"] == "assistant" for m in msgs):
                stats.no_assistant += 1
                continue
            task = row.get("task") if isinstance(row.get("task"), str) else None
            source = str(row.get("source") or _stem(path))
            lic = str(row["license"]) if row.get("license") is not None else None
            out.append(Conversation(msgs, _lang_of(row, msgs), _split_of(row, msgs, val_fraction), origin, task,
                                    source, lic))
    return out
