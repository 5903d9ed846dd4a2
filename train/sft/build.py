"""``python -m train.sft.build``: the Bangla + English fine-tuning set built from the project's own corpus.

Every task is grounded in what the corpus says (the corpus's own ``title``, ``author``, ``source`` and text;
nothing is invented), asked and answered in one language:

* ``title``: a passage from the start of a piece → the piece's title (a poem's, a story's or an article's; for
  the English novels and the Tagore novels, whose pieces are chapters, the novel's);
* ``author``: a passage → its author (literature with a known author);
* ``author_of_title``: "who wrote <title>?" → the author, and as a second turn of a ``title`` conversation;
* ``what_is``: "what is X?" → the first sentence of the Wikipedia article X;
* ``lead``: "the main point of this passage in one sentence" → the article's first sentence (an extractive
  summary: the lead sentence, not a written abstract);
* ``continue``: a passage → the text that follows it in the corpus up to the first sentence or line end after
  :data:`CONTINUE_MIN` characters (within :data:`CONTINUE_MAX`; a passage with no such end gives no row): one
  stopping rule a small model can learn, so a reply stops where a line or sentence does, as a chat reply should
  (in the hard-wrapped prose of :data:`WRAPPED_SOURCES` a line break is a wrap, not an end);
* ``language``: "which language is this written in?" asked in the other language → answered in the language
  of the question (the cross-lingual case of "answer in the language asked").

Some conversations carry a system message (Bangla or English) asking for replies in the question's language.

Input: the corpus's ``.jsonl[.gz]`` files, or folders of them (other files there are skipped and listed in the
summary). A document without a title, or whose ``title`` is not a string, or whose text, title or author holds
the text of a control token (``<|endoftext|>``, ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>``), gives no
conversation; one whose ``author`` is not a string gives none about its author; the summary line counts them
(``documents``). A file that
is not valid gzip or UTF-8, a line that is not a JSON object with a string ``text``, an ``--out`` that is not a
``.jsonl.gz`` (written gzipped) or ``.jsonl`` (plain) file path, or a corpus that gives no conversation is exit 2
with one ``error:`` line, and nothing is written.

Held out by work, not by line: a piece of a novel (a chapter, a part) belongs to the novel, every other piece
(a poem, a song, a story, an article's parts) to itself; the validation split takes, for every source, the
works whose sha256 of ``source/work`` falls lowest, until :data:`VAL_SHARE` of that source's documents. Every
conversation row carries ``split`` ("train" | "validation"), ``group`` (the work), ``task``, ``lang`` (the
language asked), ``source`` and ``license`` (the corpus's: public domain, or CC BY-SA 3.0 for Wikipedia), and
``messages`` in the OpenAI form that ``python -m train.sft`` reads. Deterministic for a given corpus and seed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from contract.atomic import atomic_write_bytes
from contract.chat_format import reserved_token
from contract.cli import HelpFormatter
from contract.text import detect_language, lone_surrogate, nfc
from train.corpus import DataError, unreadable_reason
from train.sft.formats import SUFFIXES, jsonl_files

DEFAULT_OUT = "data/sft/shalik-sft.jsonl.gz"
VAL_SHARE = 0.08  # share of each source's documents whose works go to validation
CONTINUE_MIN = 24  # a continuation ends at the first sentence or line end after this many characters…
CONTINUE_MAX = 140  # …within this many
PER_DOC = {"train": {"bn": 2, "en": 3}, "validation": {"bn": 1, "en": 3}}  # continuation passages per document
LEAD_CHARS = 250  # the longest lead sentence taken as an answer (what_is, lead)
NOVEL_SOURCES = ("100-english-novels", "majantali-bnarchive-wip")  # pieces are chapters of one work
WRAPPED_SOURCES = ("100-english-novels",)  # hard-wrapped prose (lines of about 70 characters): a line break is no end
_PART = re.compile(r"\s*\((?:অংশ|part)\s*[0-9০-৯]+\)\s*$")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SENTENCE_BN = re.compile(r"^(.+?[।?!])(?:\s|$)", re.S)
READS = "the corpus is read from"  # what the input errors say is read
SHORTEST = 120  # a document's cleaned text shorter than this gives no conversation

SYSTEM = {"bn": "তুমি একজন সহায়ক সহকারী। প্রশ্ন যে ভাষায় করা হয়, সেই ভাষায় উত্তর দাও।",
          "en": "You are a helpful assistant. Answer in the language of the question."}
ASK = {
    "title": {"bn": ["এই লেখাটির শিরোনাম কী?", "নিচের অংশটি কোন রচনা থেকে নেওয়া?"],
              "en": ["What is the title of the book this passage comes from?", "Which book is this passage from?"]},
    "title_wiki": {"bn": ["এই নিবন্ধটির শিরোনাম কী?", "নিচের লেখাটি কোন বিষয়ে?"]},
    "author": {"bn": ["এই লেখাটি কার রচনা?", "নিচের অংশটির লেখক কে?"],
               "en": ["Who wrote this passage?", "Who is the author of this text?"]},
    "author_of_title": {"bn": ["«{title}» কার লেখা?", "«{title}» রচনাটির লেখক কে?"],
                        "en": ["Who wrote \"{title}\"?", "Who is the author of \"{title}\"?"]},
    "author_followup": {"bn": ["এটি কার লেখা?"], "en": ["And who wrote it?"]},
    "what_is": {"bn": ["{x} কী?", "{x} সম্পর্কে এক বাক্যে বলো।"]},
    "lead": {"bn": ["নিচের অনুচ্ছেদের মূল কথা এক বাক্যে লেখো।"]},
    "continue": {"bn": ["এই লেখাটি চালিয়ে যাও।", "লেখাটির পরের অংশ লেখো।"],
                 "en": ["Continue this text.", "Write what comes next."]},
    "language": {"bn": ["এই লেখাটি কোন ভাষায় লেখা?"], "en": ["Which language is this text written in?"]},
}
LANGUAGE_NAME = {("bn", "en"): "এটি ইংরেজি ভাষায় লেখা।", ("en", "bn"): "It is written in Bangla (Bengali)."}


@dataclass
class Piece:
    """One corpus document with the fields the tasks read (NFC text and metadata)."""

    text: str
    lang: str
    source: str
    title: str
    author: str | None
    license: str | None


def read_corpus(paths: list[str], counts: Counter | None = None,
                skipped_files: list[str] | None = None) -> list[Piece]:
    """The titled documents of the corpus's JSON Lines files (``text``, ``title``, ``author``, ``source``,
    ``license``; gzipped or not; in a folder, the ``.jsonl[.gz]`` files, the others skipped and appended to
    ``skipped_files``). Language by script, as training decides it.

    A document without a title, or whose ``title`` is not a string, gives no piece, nor does one whose text, title
    or author holds the text of a control token (``contract.chat_format.RESERVED_TOKENS``: fine-tuning refuses
    such content); one whose ``author`` is not a string gives a piece without an author (no question about the
    author): ``counts`` gets ``read`` (documents) and ``no_title``, ``title_not_a_string``, ``reserved_token``,
    ``author_not_a_string``. A ``source`` that is not a non-empty string is the file's name without suffixes, a
    ``license`` that is not a string is None. Raises DataError naming the path for an
    input that cannot be read (:func:`train.sft.formats.jsonl_files`; a file that is not valid gzip or UTF-8) and
    ``file:line`` for a line that is not a JSON object with a string ``text`` or whose kept fields hold a lone
    surrogate."""
    counts = counts if counts is not None else Counter()
    out = []
    files, skipped = jsonl_files(paths, reads=READS, hf=False)
    if skipped_files is not None:
        skipped_files += skipped
    for f in files:
        reason = unreadable_reason(f)
        if reason:
            raise DataError(f"corpus file {f!r}: {reason}; expected the corpus's JSON Lines (UTF-8, gzipped or not "
                            f"as the name says)")
        with (gzip.open(f, "rt", encoding="utf-8") if f.endswith(".gz") else open(f, encoding="utf-8")) as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise DataError(f"{f}:{n}: not valid JSON ({str(e).splitlines()[0][:120]})") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise DataError(f"{f}:{n}: expected a JSON object with a string field \"text\"")
                for key in ("text", "title", "author", "source", "license"):
                    at = lone_surrogate(row[key]) if isinstance(row.get(key), str) else None
                    if at is not None:
                        raise DataError(f"{f}:{n}: field \"{key}\" holds a lone surrogate U+{ord(row[key][at]):04X} "
                                        f"(expected Unicode text; a JSON \\ud800-\\udfff escape needs its pair)")
                counts["read"] += 1
                if any(reserved_token(v) for v in (row.get(k) for k in ("text", "title", "author"))
                       if isinstance(v, str)):
                    counts["reserved_token"] += 1  # fine-tuning would refuse every conversation made from it
                    continue
                title, author = row.get("title"), row.get("author")
                if title is not None and not isinstance(title, str):
                    counts["title_not_a_string"] += 1
                    continue
                if not title:
                    counts["no_title"] += 1
                    continue
                if author is not None and not isinstance(author, str):
                    counts["author_not_a_string"] += 1
                    author = None
                text, source, license_ = nfc(row["text"]), row.get("source"), row.get("license")
                out.append(Piece(text, detect_language(text),
                                 source if isinstance(source, str) and source else Path(f).name.split(".")[0],
                                 nfc(title), nfc(author) if author else None,
                                 license_ if isinstance(license_, str) else None))
    return out


def clean(text: str) -> str:
    """Runs of spaces and tabs as one space, each line stripped, at most one blank line in a row."""
    lines = [_SPACES.sub(" ", ln).strip() for ln in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def cut(text: str, start: int, size: int) -> tuple[str, int]:
    """About ``size`` characters of ``text`` from ``start``, ended at the last line break or space inside the
    window (never inside a word); returns the piece and where it ends."""
    end = min(len(text), start + size)
    if end < len(text):
        brk = max(text.rfind("\n", start + size // 2, end), text.rfind(" ", start + size // 2, end))
        if brk > start:
            end = brk
    return text[start:end].strip(), end


_END = re.compile(r"[.?!।॥][\"'”’)]*(?=\s|$)|\n")
_END_WRAPPED = re.compile(r"[.?!।॥][\"'”’)]*(?=\s|$)|\n\n")


def continuation(text: str, start: int, least: int = CONTINUE_MIN, most: int = CONTINUE_MAX,
                 wrapped: bool = False) -> str | None:
    """The text after ``start`` up to the first sentence end (., ?, !, ।, ॥ and closing quotes) or line break that
    makes it at least ``least`` characters long (white space at either end stripped), within ``most``
    characters; None when there is no such end. ``wrapped``: hard-wrapped prose, where only a blank line (a
    paragraph's end) counts as a line end."""
    window = text[start:start + most]
    for m in (_END_WRAPPED if wrapped else _END).finditer(window):
        piece = window[:m.end()].strip()
        if len(piece) >= least:
            return piece
    return None


def work_of(doc) -> str:
    """The work a document belongs to: the novel for chapter pieces, else the piece itself (parts joined)."""
    title = _PART.sub("", doc.title or "")
    if doc.source in NOVEL_SOURCES:
        return title.split(" — ")[0].strip()
    return title.strip()


def piece_title(doc) -> str | None:
    """The title a reader would give the piece (see the module doc), or None when the corpus gives none."""
    title = _PART.sub("", doc.title or "").strip()
    if not title:
        return None
    if doc.source in NOVEL_SOURCES:
        return title.split(" — ")[0].strip()
    if " :: " in title:
        return title.split(" :: ", 1)[1].strip()
    if " — " in title:
        return title.split(" — ", 1)[1].strip()
    return title


def first_sentence(text: str, lang: str) -> str | None:
    """The first sentence of a paragraph (Bangla ends it at ।, ? or !), or None when it is shorter than 20 or longer
    than :data:`LEAD_CHARS` characters."""
    para = text.split("\n\n")[0].replace("\n", " ").strip()
    m = _SENTENCE_BN.match(para) if lang == "bn" else re.match(r"^(.+?[.?!])(?:\s|$)", para, re.S)
    if not m:
        return None
    s = m.group(1).strip()
    return s if 20 <= len(s) <= LEAD_CHARS else None


def _val_works(docs: list) -> set[tuple[str, str]]:
    by_source: dict[str, Counter] = defaultdict(Counter)
    for d in docs:
        by_source[d.source][work_of(d)] += 1
    out = set()
    for source, works in by_source.items():
        total, taken = sum(works.values()), 0
        for w in sorted(works, key=lambda w: hashlib.sha256(f"{source}/{w}".encode()).hexdigest()):
            if taken >= VAL_SHARE * total:
                break
            out.add((source, w))
            taken += works[w]
    return out


def _turns(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def conversations_of(doc, rng: random.Random, per_doc: int) -> list[tuple[str, list[dict]]]:
    """``[(task, messages)]`` for one document (see the module doc); at most ``per_doc`` continuation passages."""
    lang, text = doc.lang, clean(doc.text)
    other = "en" if lang == "bn" else "bn"
    if len(text) < SHORTEST:
        return []
    out: list[tuple[str, list[dict]]] = []
    pick = rng.choice
    head, _ = cut(text, 0, 300)
    title, author = piece_title(doc), (doc.author or "").strip() or None
    wiki = doc.source == "bnwiki-2023"
    part1 = not _PART.search(doc.title or "")
    if title and lang in ASK["title"] and (part1 or doc.source in NOVEL_SOURCES):
        key = "title_wiki" if wiki else "title"
        msgs = _turns(f"{pick(ASK[key][lang])}\n\n{head}", title)
        if author and rng.random() < 0.5:
            msgs += _turns(pick(ASK["author_followup"][lang]), author)
        out.append(("title", msgs))
    if author and lang in ASK["author"]:
        start = rng.randrange(0, max(1, len(text) - 300))
        passage, _ = cut(text, text.find(" ", start) + 1 if start else 0, 300)
        out.append(("author", _turns(f"{pick(ASK['author'][lang])}\n\n{passage}", author)))
        if title and part1:
            out.append(("author_of_title", _turns(pick(ASK["author_of_title"][lang]).format(title=title), author)))
    if wiki and part1 and title:
        lead = first_sentence(text, lang)
        if lead:
            out.append(("what_is", _turns(pick(ASK["what_is"][lang]).format(x=title), lead)))
            para = text.split("\n\n")[0]
            if len(para) > len(lead) + 80:
                out.append(("lead", _turns(f"{pick(ASK['lead'][lang])}\n\n{cut(para, 0, 500)[0]}", lead)))
    made = 0
    for _ in range(2 * per_doc):  # a passage with no end in reach is replaced by another draw, up to per_doc tries more
        if len(text) < 400 or made == per_doc:
            break
        start = rng.randrange(0, len(text) - 350)
        start = text.find(" ", start) + 1 if start else 0
        prompt, end = cut(text, start, rng.choice((160, 240)))
        answer = continuation(text, end, wrapped=doc.source in WRAPPED_SOURCES)
        if prompt and answer:
            out.append(("continue", _turns(f"{pick(ASK['continue'][lang])}\n\n{prompt}", answer)))
            made += 1
    if rng.random() < 0.12:
        passage, _ = cut(text, 0, 200)
        out.append(("language", _turns(f"{pick(ASK['language'][other])}\n\n{passage}", LANGUAGE_NAME[(other, lang)])))
    for i, (task, msgs) in enumerate(out):
        if rng.random() < 0.25:
            out[i] = (task, [{"role": "system", "content": SYSTEM[_asked(task, lang)]},
                             *msgs])
    return out


def _asked(task: str, lang: str) -> str:
    """The language a task of a ``lang`` document is asked in."""
    return ("en" if lang == "bn" else "bn") if task == "language" else lang


def build(paths: list[str], seed: int = 0, per_doc: dict[str, dict[str, int]] | None = None
          ) -> tuple[list[dict], dict]:
    """The set's rows (see the module doc) from the corpus at ``paths`` and a summary
    ``{rows, by_split: {split: {lang: n}}, by_task: {task: n}, works: {split: n}, documents: {...}, skipped_files:
    [path]}``: ``documents`` counts those ``read``, ``used`` (that gave a conversation) and those that gave none or
    fewer: ``no_title``, ``title_not_a_string`` (no conversation), ``author_not_a_string`` (none about the author),
    ``too_short`` (under :data:`SHORTEST` characters), ``no_task`` (titled and long enough, yet no task fits: a
    later part without an author and too short for a continuation); ``skipped_files`` are the files of the data
    folders that are not ``.jsonl[.gz]``. ``per_doc``: continuation passages per document by split and language
    (:data:`PER_DOC`: training works give Bangla two, so the continuation task, where replies are longest, is not
    outnumbered by the one-name answers; held-out works keep one, the validation mix of tasks as before). Raises
    DataError for unreadable input, and naming the counts when no document gives a conversation."""
    per_doc = per_doc or PER_DOC
    counts: Counter = Counter()
    skipped_files: list[str] = []
    docs = read_corpus(paths, counts, skipped_files)
    val = _val_works(docs)
    rng = random.Random(seed)
    rows = []
    for d in docs:
        split = "validation" if (d.source, work_of(d)) in val else "train"
        convs = conversations_of(d, rng, per_doc[split].get(d.lang, 1))
        if convs:
            counts["used"] += 1
        else:
            counts["too_short" if len(clean(d.text)) < SHORTEST else "no_task"] += 1
        for task, msgs in convs:
            rows.append({"messages": msgs, "task": task, "lang": _asked(task, d.lang), "split": split,
                         "group": f"{d.source}/{work_of(d)}", "source": d.source, "license": d.license})
    documents = {k: counts[k] for k in ("read", "used", "no_title", "title_not_a_string", "author_not_a_string",
                                        "reserved_token", "too_short", "no_task")}
    if not rows:
        files = f"; skipped {len(skipped_files)} file(s) that are not .jsonl or .jsonl.gz" if skipped_files else ""
        raise DataError(
            f"{', '.join(paths)}: no conversation to write: read {documents['read']} "
            f"document{'' if documents['read'] == 1 else 's'}; "
            f"{documents['no_title']} without a title, {documents['title_not_a_string']} with a title that is not a "
            f"string, {documents['reserved_token']} holding control-token text, {documents['too_short']} shorter "
            f"than {SHORTEST} characters, {documents['no_task']} with no "
            f"task that fits (a later part without an author, too short to continue){files}; expected the corpus's "
            f"JSON Lines: objects with a string \"title\" (and \"author\") and a \"text\" of at least {SHORTEST} "
            f"characters")
    by_split: dict = defaultdict(Counter)
    for r in rows:
        by_split[r["split"]][r["lang"]] += 1
    works = {s: len({r["group"] for r in rows if r["split"] == s}) for s in ("train", "validation")}
    summary = {"rows": len(rows), "by_split": {k: dict(v) for k, v in by_split.items()},
               "by_task": dict(Counter(r["task"] for r in rows)), "works": works, "documents": documents,
               "skipped_files": skipped_files}
    return rows, summary


def out_path(out: str, data: list[str]) -> Path:
    """``--out`` checked before any work: a file path ending in ``.jsonl.gz`` (written gzipped) or ``.jsonl``
    (plain), not a folder, under a folder (or where one can be made), and not one of the corpus files of ``data``.
    Raises DataError naming it and what was expected."""
    expected = "expected a file path ending in .jsonl.gz (gzipped JSON Lines) or .jsonl (plain)"
    if not out.strip():
        raise DataError(f"--out is empty: {expected}")
    path = Path(out)
    if out.endswith(("/", os.sep)) or path.is_dir():
        raise DataError(f"--out {out!r} is a folder: {expected}")
    if not out.endswith(SUFFIXES):
        raise DataError(f"--out {out!r}: {expected}")
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise DataError(f"--out {out!r}: {str(above)!r} is a file, not a folder: {expected} in a folder")
    if path.resolve() in {Path(f).resolve() for f in jsonl_files(data, reads=READS, hf=False)[0]}:
        raise DataError(f"--out {out!r} is one of the corpus files read (--data): expected another file, so the "
                        f"corpus is kept")
    return path


def write(rows: list[dict], out: Path) -> None:
    """Rows as JSON Lines, gzipped (mtime 0, so the same rows give the same bytes) when ``out`` ends in ``.gz``,
    written atomically (nothing at ``out`` changes when writing fails). Raises OSError as the file system does."""
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    atomic_write_bytes(out, gzip.compress(body, compresslevel=9, mtime=0) if str(out).endswith(".gz") else body)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.sft.build``: exit 0 written (the summary line, then the path), 2 bad input
    (one ``error:`` line; nothing written)."""
    p = argparse.ArgumentParser(prog="python -m train.sft.build", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--data", nargs="+", default=["data/sample"],
                   help="the corpus: .jsonl[.gz] files or folders of them (JSON Lines with title/author)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="the file to write: .jsonl.gz (gzipped JSON Lines) or .jsonl (plain)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random draws that build each conversation")
    args = p.parse_args(argv)
    try:
        out = out_path(args.out, args.data)
        rows, summary = build(args.data, args.seed)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        write(rows, out)
    except OSError as e:
        print(f"error: cannot write --out {args.out!r}: {e.strerror or e}; nothing was written", file=sys.stderr)
        return 2
    print(json.dumps(summary, ensure_ascii=False))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
