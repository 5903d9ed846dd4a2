"""A test corpus with known answers: the curated corpus with planted defects, generated from a seed.

``make_planted(out, seed, base_docs)`` writes ``out/base.jsonl`` (documents of ``data/sample``: all of them, or
every k-th to keep ``base_docs``), ``out/planted.jsonl`` (the defects below, source ``planted``, each titled
uniquely, so each is a work of its own) and ``out/truth.json`` (per planted document: its kind, and for copies the
base document it copies and the edit rate). Reading order: base first, then planted (documents are numbered in
that order, as the cleaning stage numbers them).

Defects, per ``counts``:

* ``near`` — a base document with a share ``rate`` of its words edited at random (each edit a substitution by a
  word of another document of the language, a deletion or an insertion, equally likely), at the rates
  ``NEAR_RATES``; the first copy of each rate copies a document of a work the split puts on the validation side
  (the lowest-hash work of its group that fits the budget), so one near-copy of a validation document is planted;
* ``exact`` — a base document copied with its punctuation and spacing changed (same normalised text);
* ``boilerplate`` — a page of navigation, cookie and footer lines around two sentences of content (bn and en);
* ``spam`` — keyword-stuffed pages: a few product phrases repeated with small variations;
* ``mojibake`` — a Bangla document (or an English one with typographic quotes) encoded as UTF-8 and decoded as
  cp1252;
* ``mixed_script`` — a Bangla page whose lines alternate with Devanagari, Cyrillic, Greek and Arabic lines;
* ``eval`` — twenty sentences of different base documents with an evaluation item (context + gold continuation
  of ``benchmarks/eval_tasks``) pasted in the middle.

    python benchmarks/planted_corpus.py OUT [--seed 0] [--base-docs 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from contract.text import detect_language, nfc  # noqa: E402
from train.clean.works import work_key, work_order  # noqa: E402

NEAR_RATES = (0.01, 0.03, 0.05, 0.10, 0.20)
COUNTS = {"near": 40, "exact": 30, "boilerplate": 30, "spam": 30, "mojibake": 30, "mixed_script": 20, "eval": 30}

_BOILER = {
    "bn": ["হোম | খবর | খেলা | বিনোদন | যোগাযোগ করুন", "আরও পড়ুন »", "এই ওয়েবসাইট কুকি ব্যবহার করে। গোপনীয়তা নীতি দেখুন।",
           "শেয়ার করুন: ফেসবুক | টুইটার", "সর্বস্বত্ব সংরক্ষিত © ২০২৩", "লগইন | রেজিস্টার", "বিজ্ঞাপন",
           "সাবস্ক্রাইব করুন আমাদের নিউজলেটার", "ক্লিক করুন এখানে"],
    "en": ["Home | News | Sports | Contact", "Read more »", "This website uses cookies. See our privacy policy.",
           "Share this: Facebook | Twitter", "Copyright © 2023 All rights reserved.", "Log in | Sign up",
           "Subscribe to our newsletter", "Click here to accept all cookies", "Terms of use | Privacy policy"],
}
_SPAM = {
    "bn": ["সস্তা মোবাইল", "সেরা দাম", "অফার", "ফ্রি ডেলিভারি", "আজই কিনুন", "সস্তা ল্যাপটপ", "ছাড়"],
    "en": ["cheap phones", "best price", "free shipping", "buy now", "discount", "cheap laptops", "deal"],
}
_FOREIGN = ["नमस्ते दुनिया यह एक परीक्षण वाक्य है और हम हिंदी में लिख रहे हैं", "Привет мир это проверочное предложение на русском языке",
            "Γειά σου κόσμε αυτή είναι μια δοκιμαστική πρόταση στα ελληνικά", "مرحبا بالعالم هذه جملة اختبار باللغة العربية"]


def _read_base(base_docs: int) -> list[dict]:
    rows = []
    for f in sorted((ROOT / "data" / "sample").glob("*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            rows += [{**json.loads(line), "_file": f.name} for line in fh if line.strip()]
    if base_docs and base_docs < len(rows):
        step = len(rows) / base_docs
        rows = [rows[int(i * step)] for i in range(base_docs)]
    return rows


def _eval_items() -> list[str]:
    out = []
    for f in sorted((ROOT / "benchmarks" / "eval_tasks").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                it = json.loads(line)
                out.append(f"{it['context']} {it['choices'][it['gold']]}")
    return out


def edit_words(text: str, rate: float, vocab: list[str], rng: random.Random) -> str:
    """``text`` with about ``rate`` of its words edited (substituted, deleted or a word inserted), line by line."""
    lines = []
    for line in text.split("\n"):
        out = []
        for w in line.split(" "):
            if w and rng.random() < rate:
                op = rng.randrange(3)
                if op == 0:
                    out.append(rng.choice(vocab))
                elif op == 2:
                    out += [w, rng.choice(vocab)]
                continue
            out.append(w)
        lines.append(" ".join(out))
    return "\n".join(lines)


def _val_candidates(rows: list[dict], val_fraction: float) -> list[int]:
    """Per (file, language) group, the first document of the lowest-hash work that fits the split's budget."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r["_file"] + detect_language(nfc(r["text"])), []).append(i)
    out = []
    for members in groups.values():
        works: dict[str, list[int]] = {}
        for i in members:
            r = rows[i]
            t = nfc(r["text"])
            works.setdefault(work_key(t, r.get("source", ""), r.get("title"), r.get("author"), None), []).append(i)
        budget = val_fraction * sum(len(rows[i]["text"]) for i in members)
        for key in sorted(works, key=work_order):
            if sum(len(rows[i]["text"]) for i in works[key]) / 2 <= budget:
                out.append(works[key][0])
                break
    return out


def make_planted(out: Path, seed: int = 0, base_docs: int = 0, counts: dict | None = None,
                 val_fraction: float = 0.01) -> dict:
    """Write the corpus (see the module doc) and return the truth: ``{"base": n, "planted": [{kind, …}]}``."""
    counts = {**COUNTS, **(counts or {})}
    rng = random.Random(seed)
    rows = _read_base(base_docs)
    lang_of = [detect_language(nfc(r["text"])) for r in rows]
    by_lang = {lang: [i for i, x in enumerate(lang_of) if x == lang] for lang in ("bn", "en")}
    vocab = {lang: sorted({w for i in by_lang[lang][:400] for w in rows[i]["text"].split() if len(w) > 1})
             for lang in ("bn", "en")}
    planted: list[dict] = []

    def add(kind: str, text: str, lang: str, **extra) -> None:
        planted.append({"kind": kind, "lang": lang, "text": text, **extra})

    val_docs = _val_candidates(rows, val_fraction)
    per_rate = max(counts["near"] // len(NEAR_RATES), 1)
    for rate in NEAR_RATES:
        for j in range(per_rate):
            i = val_docs[j % len(val_docs)] if j == 0 and val_docs else rng.randrange(len(rows))
            lang = lang_of[i]
            add("near", edit_words(rows[i]["text"], rate, vocab[lang], rng), lang, base=i, rate=rate,
                of_val_candidate=j == 0)
    for _ in range(counts["exact"]):
        i = rng.randrange(len(rows))
        t = re.sub(r"([,।.!?;:])", r" \1 ", rows[i]["text"]).replace("\n", "\n ")
        add("exact", t, lang_of[i], base=i)
    for j in range(counts["boilerplate"]):
        lang = "bn" if j % 2 == 0 else "en"
        i = rng.choice(by_lang[lang])
        content = " ".join(rows[i]["text"].split()[:30])
        lines = rng.sample(_BOILER[lang], 6) + [content] + rng.sample(_BOILER[lang], 4)
        add("boilerplate", "\n".join(lines), lang)
    for j in range(counts["spam"]):
        lang = "bn" if j % 2 == 0 else "en"
        words = _SPAM[lang]
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 9))) for _ in range(rng.randint(8, 15))]
        add("spam", "\n".join(lines), lang)
    typographic = [i for i in by_lang["en"] if sum(rows[i]["text"][:3000].count(q) for q in "'\"") >= 20]
    for j in range(counts["mojibake"]):
        lang = "bn" if j % 3 or not typographic else "en"
        i = rng.choice(by_lang[lang] if lang == "bn" else typographic)
        t = rows[i]["text"][:3000]
        if lang == "en":
            t = t.replace("'", "’").replace('"', "“").replace("--", "—")
        add("mojibake", t.encode("utf-8").decode("cp1252", errors="replace"), lang, base=i)
    for _ in range(counts["mixed_script"]):
        i = rng.choice(by_lang["bn"])
        lines = [ln for ln in rows[i]["text"].split("\n") if ln.strip()][:12]
        mixed = []
        for k2, ln in enumerate(lines):
            mixed.append(ln)
            mixed.append(_FOREIGN[k2 % len(_FOREIGN)])
        add("mixed_script", "\n".join(mixed), "bn", base=i)
    items = _eval_items()
    for _ in range(counts["eval"]):
        item = rng.choice(items)
        lang = detect_language(nfc(item))
        sents = []
        for i in rng.sample(by_lang[lang], 20):
            parts = [p for p in re.split(r"(?<=[।.!?])\s+", rows[i]["text"]) if len(p.split()) > 3]
            if parts:
                sents.append(rng.choice(parts).strip())
        sents.insert(len(sents) // 2, item)
        add("eval", "\n".join(sents), lang, item=item[:80])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "base.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items() if k != "_file"}, ensure_ascii=False) + "\n")
    with open(out / "planted.jsonl", "w", encoding="utf-8") as f:
        for n, p in enumerate(planted):
            f.write(json.dumps({"text": p["text"], "source": "planted", "title": f"planted {p['kind']} {n}",
                                "license": "test"}, ensure_ascii=False) + "\n")
    truth = {"seed": seed, "base": len(rows),
             "planted": [{k: v for k, v in p.items() if k != "text"} for p in planted]}
    (out / "truth.json").write_text(json.dumps(truth, ensure_ascii=False, indent=1), encoding="utf-8")
    return truth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-docs", type=int, default=0, help="base documents to keep (0 = all of data/sample)")
    a = p.parse_args()
    t = make_planted(a.out, a.seed, a.base_docs)
    print(f"{t['base']} base and {len(t['planted'])} planted documents in {a.out}")


if __name__ == "__main__":
    main()
