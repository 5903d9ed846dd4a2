"""Build Shalik's own next-sentence tasks from the VALIDATION split of the corpus: bn-next-sentence and
en-next-sentence (four-way multiple choice), as JSON Lines beside this file, plus ``build.json`` (seed, inputs,
filters, counts).

An item: ``context`` = one or two consecutive sentences of a validation document; ``choices`` = the sentence
that really follows them, and three sentences of the same language taken from OTHER validation documents, of
similar length (within 0.8–1.25× in characters where the pool allows, else the nearest lengths), in a seeded
random order; ``gold`` = the index of the true one. Only validation documents are read (``contract.text.is_val``
on the NFC text, ``val_fraction`` 0.01 as the models were trained with), so no item text was trained on.

Sentences. A document is cut into paragraphs at blank lines; inside a paragraph every run of whitespace
(hard line wraps, verse breaks, NBSP) becomes one space. Sentences end with the danda ``।`` (also ``?`` ``!``)
in Bangla and with ``.`` ``?`` ``!`` followed by whitespace in English (not after Mr., Dr., St. …, an initial,
or before a lower-case word: ``"Come!" cried he.``), closing quotes riding with them. A paragraph's unterminated
tail (a heading, a verse without a danda) is no sentence, and a sentence glued to the previous one without a
space (``…তোলো।দুয়ার…``) starts a new run: contexts never cross either. A sentence is usable as a target or a
distractor when it is 20–180 (bn) / 25–200 (en) characters, has at least 3 words, is mostly letters of its
language's script (> 90 % Bengali-block letters for bn, none for en), holds no markup, and occurs once in the
validation split (refrains and formulae are dropped); as context any terminated sentence of at most that length
will do, one or two of them (two when both fit in 240 characters).

Every item is a context and its true continuation as they stand in the document, one space apart, which is how
the tasks' YAMLs score a choice: as the continuation ``" " + choice`` (see ``_next_sentence.yaml``).

Items. Preferably disjoint: a target's context does not reach back into the previous item. When that gives
fewer than ``--items`` for a language, every usable sentence that follows a sentence in its run becomes a
target (a context may then hold the previous item's answer; each sentence is a target at most once) —
``build.json`` records which mode was used. More candidates than ``--items`` are subsampled with the seed. The
validation split is small (1 %: 41 Bangla documents, 2 English ones), so bn-next-sentence reaches 500 items only
in that sliding mode and en-next-sentence stops at what its two documents hold (see ``build.json``).

Deterministic: documents are ordered by the sha256 of their text and all randomness comes from ``--seed``, so
the same corpus gives byte-identical files wherever it lives (``data/sample`` and ``../shared/corpus`` hold the
same documents).

    python benchmarks/eval_tasks/build.py [--data data/sample] [--items 500] [--seed 13]
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from contract.atomic import atomic_write_json, atomic_write_text, sha256_file  # noqa: E402
from contract.text import bengali_letter_share, is_val  # noqa: E402
from train.corpus import iter_documents, list_input_files  # noqa: E402

SEED = 13
VAL_FRACTION = 0.01
ITEMS = 500
N_CHOICES = 4
TASKS = {"bn": "bn_next_sentence", "en": "en_next_sentence"}
LENGTH = {"bn": (20, 180), "en": (25, 200)}  # characters of a usable sentence (target or distractor)
MAX_CONTEXT_CHARS = 240
LENGTH_BAND = (0.8, 1.25)  # distractor length / true sentence length, where the pool allows
CLOSERS_RAW = "\"'”’»)]"
CLOSERS = re.escape(CLOSERS_RAW)
_END = {  # a sentence's end; the danda is unambiguous, an English full stop must be followed by whitespace
    "bn": re.compile(rf"[।?!]+[{CLOSERS}]*"),
    "en": re.compile(rf"[.?!]+[{CLOSERS}]*(?=\s|$)"),
}
_ABBREV = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Rev|Capt|Col|Gen|Lt|Sgt|No|vs|etc|i\.e|e\.g)|\b[A-Z])\.$")
_MARKUP = re.compile(r"[|=#*_{}<>\[\]\\]|https?:|www\.")
_BLANK = re.compile(r"\n\s*\n")


@dataclass
class Sentence:
    """A sentence of a validation document, with its place and what it may be used for."""

    text: str
    doc: int  # index of the document (sorted by sha256)
    para: int  # run of space-separated sentences (a paragraph, or part of one) inside the document
    pos: int  # sentence number inside the run
    ok: bool = False  # usable as a target or a distractor
    ctx_ok: bool = False  # usable as context: any terminated sentence of the language, not too long


def split_sentences(paragraph: str, lang: str) -> list[list[str]]:
    """A paragraph (whitespace already collapsed) → its terminated sentences, in runs: a new run starts where a
    sentence follows the previous one without a space (``…তোলো।দুয়ার…``), so no context is built across it.

    The unterminated tail is dropped. In English a piece ending in an abbreviation or an initial, or followed
    by a piece that starts in lower case (``"Come!" cried he.``), is joined to the previous piece."""
    runs: list[list[str]] = [[]]
    start = 0
    for m in _END[lang].finditer(paragraph):
        raw, start = paragraph[start:m.end()], m.end()
        piece = raw.strip()
        if not piece:
            continue
        out = runs[-1]
        if lang == "en" and out and (_ABBREV.search(out[-1]) or not _starts_sentence(piece)):
            out[-1] += " " + piece
            continue
        if out and not raw[:1].isspace():
            runs.append([])
        runs[-1].append(piece)
    if lang == "en" and _ABBREV.search(runs[-1][-1] if runs[-1] else ""):  # "… said Mr." at the end: no sentence
        runs[-1].pop()
    return [r for r in runs if r]


def _starts_sentence(piece: str) -> bool:
    first = piece.lstrip(CLOSERS_RAW + "“‘(")[:1]
    return not first.isalpha() or first.isupper()


def usable(sentence: str, lang: str) -> bool:
    """Whether a sentence may be a target or a distractor (length, words, script, no markup)."""
    lo, hi = LENGTH[lang]
    if not lo <= len(sentence) <= hi or len(sentence.split()) < 3 or _MARKUP.search(sentence):
        return False
    letters = sum(ch.isalpha() or (0x0980 <= ord(ch) <= 0x09FF) for ch in sentence)
    if letters < 0.7 * sum(not ch.isspace() for ch in sentence):
        return False
    share = bengali_letter_share(sentence)
    return share > 0.9 if lang == "bn" else share == 0.0


def dedup_key(sentence: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", "", sentence).casefold().split())


def sentences_of(docs: list[str], lang: str) -> list[Sentence]:
    """All sentences of the documents with their place, ``ok`` set for the usable, once-only ones."""
    out: list[Sentence] = []
    for d, text in enumerate(docs):
        runs = (run for para in _BLANK.split(text) for run in split_sentences(" ".join(para.split()), lang))
        for r, run in enumerate(runs):
            out += [Sentence(s, d, r, i) for i, s in enumerate(run)]
    counts = Counter(dedup_key(s.text) for s in out)
    for s in out:
        s.ok = usable(s.text, lang) and counts[dedup_key(s.text)] == 1
        s.ctx_ok = len(s.text) <= LENGTH[lang][1] and not _MARKUP.search(s.text) and sum(map(str.isalpha, s.text)) >= 2
    return out


def candidates(sents: list[Sentence], disjoint: bool) -> list[tuple[list[Sentence], Sentence]]:
    """(context sentences, target) pairs: a usable target and the one or two sentences before it in the same
    paragraph (as many as fit in MAX_CONTEXT_CHARS). ``disjoint``: a context never reaches back to the previous
    pair's target."""
    out: list[tuple[list[Sentence], Sentence]] = []
    last_target: Sentence | None = None
    for i, t in enumerate(sents):
        if not t.ok:
            continue
        ctx: list[Sentence] = []
        for prev in (sents[j] for j in (i - 1, i - 2) if j >= 0):
            if (not prev.ctx_ok or (prev.doc, prev.para) != (t.doc, t.para) or (disjoint and prev is last_target)
                    or sum(len(s.text) + 1 for s in [prev, *ctx]) > MAX_CONTEXT_CHARS):
                break
            ctx.insert(0, prev)
        if ctx:
            out.append((ctx, t))
            last_target = t
    return out


def pick_distractors(target: Sentence, pool: list[Sentence], lengths: list[int], rng: random.Random) -> list[str]:
    """Three sentences from other documents, of similar length (``pool`` sorted by length; ``lengths`` its keys)."""
    n = len(target.text)
    lo = bisect.bisect_left(lengths, int(n * LENGTH_BAND[0]))
    hi = bisect.bisect_right(lengths, int(n * LENGTH_BAND[1]))
    band = [s for s in pool[lo:hi] if s.doc != target.doc]
    if len(band) < N_CHOICES - 1:  # widen to the nearest lengths
        band = sorted((s for s in pool if s.doc != target.doc), key=lambda s: (abs(len(s.text) - n), s.text))
        band = band[:4 * (N_CHOICES - 1)]
    return [s.text for s in rng.sample(band, N_CHOICES - 1)]


def build_task(docs: list[dict], lang: str, n_items: int, seed: int) -> tuple[list[dict], dict]:
    """The items of one language and a summary of how they were made."""
    rng = random.Random(f"{seed}:{lang}")
    texts = [d["text"] for d in docs]
    sents = sentences_of(texts, lang)
    mode = "disjoint"
    pairs = candidates(sents, disjoint=True)
    if len(pairs) < n_items:
        mode = "sliding"
        pairs = candidates(sents, disjoint=False)
    available = len(pairs)
    if len(pairs) > n_items:
        keep = sorted(rng.sample(range(len(pairs)), n_items))
        pairs = [pairs[k] for k in keep]
    pool = sorted((s for s in sents if s.ok), key=lambda s: (len(s.text), s.text))
    lengths = [len(s.text) for s in pool]
    items = []
    for k, (ctx, target) in enumerate(pairs):
        choices = [target.text, *pick_distractors(target, pool, lengths, rng)]
        order = list(range(N_CHOICES))
        rng.shuffle(order)
        doc = docs[target.doc]
        items.append({"id": f"{lang}-next-{k:04d}", "doc": doc["sha256"][:12], "source": doc["source"],
                      "context": " ".join(s.text for s in ctx),
                      "choices": [choices[i] for i in order], "gold": order.index(0)})
    summary = {"items": len(items), "candidates": available, "mode": mode, "documents": len(docs),
               "documents_used": len({it["doc"] for it in items}),
               "sentences": len(sents), "usable_sentences": len(pool),
               "gold_positions": dict(sorted(Counter(it["gold"] for it in items).items()))}
    return items, summary


def val_documents(paths: list[str], val_fraction: float) -> dict[str, list[dict]]:
    """Validation documents per language, sorted by the sha256 of their (NFC) text."""
    out: dict[str, list[dict]] = {lang: [] for lang in TASKS}
    for d in iter_documents(list_input_files(paths)):
        if d.lang in out and is_val(d.text, val_fraction):
            out[d.lang].append({"text": d.text, "sha256": hashlib.sha256(d.text.encode()).hexdigest(),
                                "source": d.source, "license": d.license, "title": d.title})
    return {lang: sorted(v, key=lambda d: d["sha256"]) for lang, v in out.items()}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows))


def write_tasks(docs: dict[str, list[dict]], out: Path, n_items: int, seed: int, report: dict) -> dict:
    """Write both tasks' JSON Lines and ``build.json`` (``report`` plus per-task summaries) into ``out``."""
    report = {**report, "seed": seed, "items_asked": n_items, "choices": N_CHOICES, "sentence_chars": LENGTH,
              "max_context_chars": MAX_CONTEXT_CHARS, "distractor_length_band": LENGTH_BAND, "tasks": {}}
    for lang, task in TASKS.items():
        items, summary = build_task(docs[lang], lang, n_items, seed)
        write_jsonl(out / f"{task}.jsonl", items)
        report["tasks"][task] = {**summary, "file": f"{task}.jsonl", "sha256": sha256_file(out / f"{task}.jsonl")}
        print(f"{task}: {summary['items']} items ({summary['mode']}; {summary['candidates']} candidates) from "
              f"{summary['documents_used']} of {summary['documents']} val documents; gold positions "
              f"{summary['gold_positions']}")
    atomic_write_json(out / "build.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", nargs="+", default=[str(ROOT / "data" / "sample")],
                   help="corpus paths (../shared/corpus holds the same documents)")
    p.add_argument("--items", type=int, default=ITEMS, help="items per task (at most)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--val-fraction", type=float, default=VAL_FRACTION, help="the split the models were trained with")
    p.add_argument("--out", default=str(HERE), help="folder for the .jsonl files and build.json")
    a = p.parse_args(argv)
    inputs = [{"file": Path(f).name, "sha256": sha256_file(f)} for f in list_input_files(a.data)]
    write_tasks(val_documents(a.data, a.val_fraction), Path(a.out), a.items, a.seed,
                {"val_fraction": a.val_fraction, "inputs": inputs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
