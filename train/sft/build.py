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
import random
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from contract.atomic import atomic_write_bytes
from contract.text import detect_language, nfc
from train.corpus import DataError, list_input_files

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


def read_corpus(paths: list[str]) -> list[Piece]:
    """The titled documents of the corpus's JSON Lines files (``text``, ``title``, ``author``, ``source``,
    ``license``; gzipped or not). Language by script, as training decides it. Raises DataError naming a file and
    line that is not such an object, or when no titled document is found."""
    out = []
    for f in list_input_files(paths):
        if ".jsonl" not in Path(f).name:
            raise DataError(f"{f}: expected the corpus's JSON Lines (.jsonl[.gz]) with title and author fields")
        with (gzip.open(f, "rt", encoding="utf-8") if f.endswith(".gz") else open(f, encoding="utf-8")) as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{f}:{n}: not valid JSON ({e})") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise DataError(f"{f}:{n}: expected a JSON object with a string field \"text\"")
                if not row.get("title"):
                    continue
                text = nfc(row["text"])
                out.append(Piece(text, detect_language(text), str(row.get("source") or Path(f).name.split(".")[0]),
                                 nfc(str(row["title"])), nfc(str(row["author"])) if row.get("author") else None,
                                 row.get("license")))
    if not out:
        raise DataError(f"{', '.join(paths)}: no documents with a title (expected the corpus's JSON Lines form)")
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
    if len(text) < 120:
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
    ``{rows, by_split: {split: {lang: n}}, by_task: {task: n}, works: {split: n}}``. ``per_doc``: continuation
    passages per document by split and language (:data:`PER_DOC`: training works give Bangla two, so the
    continuation task, where replies are longest, is not outnumbered by the one-name answers; held-out works keep
    one, the validation mix of tasks as before). Raises DataError for unreadable input or a corpus without
    titles."""
    per_doc = per_doc or PER_DOC
    docs = read_corpus(paths)
    val = _val_works(docs)
    rng = random.Random(seed)
    rows = []
    for d in docs:
        split = "validation" if (d.source, work_of(d)) in val else "train"
        for task, msgs in conversations_of(d, rng, per_doc[split].get(d.lang, 1)):
            rows.append({"messages": msgs, "task": task, "lang": _asked(task, d.lang), "split": split,
                         "group": f"{d.source}/{work_of(d)}", "source": d.source, "license": d.license})
    by_split: dict = defaultdict(Counter)
    for r in rows:
        by_split[r["split"]][r["lang"]] += 1
    works = {s: len({r["group"] for r in rows if r["split"] == s}) for s in ("train", "validation")}
    summary = {"rows": len(rows), "by_split": {k: dict(v) for k, v in by_split.items()},
               "by_task": dict(Counter(r["task"] for r in rows)), "works": works}
    return rows, summary


def write(rows: list[dict], out: Path) -> None:
    """Rows as gzipped JSON Lines (mtime 0, so the same rows give the same bytes), written atomically."""
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    atomic_write_bytes(out, gzip.compress(body, compresslevel=9, mtime=0))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.sft.build``."""
    p = argparse.ArgumentParser(prog="python -m train.sft.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=["data/sample"], help="the corpus (JSON Lines with title/author)")
    p.add_argument("--out", default=DEFAULT_OUT, help="the gzipped JSON Lines file to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        rows, summary = build(args.data, args.seed)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write(rows, Path(args.out))
    print(json.dumps(summary, ensure_ascii=False))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
