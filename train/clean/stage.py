"""The cleaning stage of ``python -m train.data prepare``: settings from ``[data]``, the fingerprint, the
evaluation texts, the error for a language cleaned away, and the report (``cleaning.md``, log lines).

The stage runs inside the shards' build (``train.data.ShardBuild``): the data workers compute each document's
features and hashes beside its tokens (:mod:`train.clean.scan`), the main process decides the split,
deduplication and decontamination once every document is read (:mod:`train.clean.decide`). Its settings are
part of the shards' fingerprint, so the shards cache the cleaning as they cache the tokens.

Keys: ``data.clean`` (default true) turns the stage off (the split of whole works stays);
``data.clean_off = ["dup_lines", "near_dup", …]`` switches rules off by name (the quality rules of
``rules.toml`` and ``exact_dup``, ``near_dup``, ``decontam``); ``data.clean_set = {"bn.min_words.min" = 3}``
changes a threshold within its range. Evaluation texts: every ``*.jsonl`` of ``benchmarks/eval_tasks/``
(``context``, ``choices``, ``gold``): the context with its gold continuation, and each choice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from train.clean import quality
from train.clean.decide import CODE, REASONS
from train.clean.scan import STEPS, Settings, eval_ngrams
from train.config import PROJECT_ROOT, Config
from train.corpus import LANG_NAMES, DataError

FORMAT_VERSION = 2  # the cleaning's own code version: a change of how it decides changes every key
EVAL_DIR = PROJECT_ROOT / "benchmarks" / "eval_tasks"


def eval_texts(folder: Path = EVAL_DIR) -> list[str]:
    """The texts of every evaluation item under ``folder`` (none when it does not exist: an installed package)."""
    out = []
    for f in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in f.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            choices = [str(c) for c in item.get("choices", [])]
            gold = item.get("gold")
            ctx = str(item.get("context", ""))
            if isinstance(gold, int) and 0 <= gold < len(choices):
                out.append(f"{ctx} {choices[gold]}")
            out += choices + ([ctx] if ctx else [])
    return out


def settings_from(cfg: Config, eval_folder: Path = EVAL_DIR) -> Settings:
    """The stage's settings for ``cfg.data``. Raises ConfigError naming ``data.clean_off`` / ``data.clean_set``
    for an unknown rule or a threshold out of range."""
    d = cfg.data
    steps = [x for x in d.clean_off if x in STEPS]
    rules = quality.load_rules([x for x in d.clean_off if x not in STEPS], d.clean_set)
    if not d.clean:
        return Settings(False, rules, tuple(d.clean_off))
    from contract.text import nfc  # noqa: PLC0415
    from train.clean.text import prepare_tables  # noqa: PLC0415

    prepare_tables(1 << 20)  # a data chunk's code points (the workers scan a chunk at once), before they fork
    texts = [nfc(t) for t in eval_texts(eval_folder)] if "decontam" not in steps else []
    return Settings(True, rules, tuple(d.clean_off), eval_ngrams(texts))


def fingerprint(s: Settings) -> dict:
    """What of the settings changes the result (for the shards' fingerprint)."""
    if not s.enabled:
        return {"format": FORMAT_VERSION, "enabled": False}
    grams = hashlib.sha256(b"".join(k.to_bytes(2, "little") + v.tobytes() for k, v in s.eval_grams.items()))
    return {"format": FORMAT_VERSION, "enabled": True, "rules": s.rules.as_dict(), "off": sorted(s.off),
            "near": s.near_params(), "eval": grams.hexdigest()[:16]}


def check_languages_left(report: dict, languages: list[str]) -> None:
    """DataError naming a configured language that had documents and has none left after cleaning, with what
    removed them."""
    for lang in languages:
        had = sum(v["docs"] for k, v in report["in"]["by"].items() if k.split("/")[0] == lang)
        left = sum(v["docs"] for k, v in report["kept"]["by"].items() if k.split("/")[0] == lang)
        if had and not left:
            why = {r: sum(v["docs"] for k, v in x["by"].items() if k.split("/")[0] == lang)
                   for r, x in report["removed"].items()}
            why = ", ".join(f"{r} {n}" for r, n in why.items() if n)
            raise DataError(f"cleaning removed every {lang} ({LANG_NAMES.get(lang, lang)}) document ({had}: {why}); "
                            f"switch the rule off (data.clean_off), loosen it (data.clean_set) or data.clean = false")


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.2f} %" if b else "–"


def summary_lines(report: dict) -> list[str]:
    """A few lines for the log (train.log)."""
    if not report:
        return []
    r = report
    lines = [f"cleaning: {r['in']['docs']:,} documents ({r['in']['chars']:,} chars) in, {r['kept']['docs']:,} kept "
             f"({_pct(r['kept']['chars'], r['in']['chars'])} of the characters)"
             + ("" if r["enabled"] else " — data.clean = false: split of whole works only")]
    for name, x in r["removed"].items():
        lines.append(f"cleaning: removed {x['docs']:,} documents ({x['chars']:,} chars) by {name}")
    sp = r["split"]
    lines.append(f"cleaning: split of whole works: train {sp['train']['works']:,} works / {sp['train']['docs']:,} docs, "
                 f"val {sp['val']['works']:,} works / {sp['val']['docs']:,} docs; validation works with a part in "
                 f"training: {r['val_works_with_train_parts']}")
    return lines


def markdown(report: dict, mb: float | None = None) -> str:
    """``cleaning.md``: documents and characters in, removed per rule per language/source, what each quality
    rule would remove alone, cluster sizes, examples, the split, time per phase."""
    r = report
    out = ["# Cleaning report", ""]
    if not r["enabled"]:
        out.append("`data.clean = false`: no deduplication, quality filter or decontamination; the validation split "
                   "is still one of whole works.")
        out.append("")
    out += [f"In: {r['in']['docs']:,} documents, {r['in']['chars']:,} characters. Kept: {r['kept']['docs']:,} "
            f"documents, {r['kept']['chars']:,} characters ({_pct(r['kept']['chars'], r['in']['chars'])}).", ""]
    out += ["| language/source | docs in | chars in | docs kept | kept |", "|---|---:|---:|---:|---:|"]
    for k, v in r["in"]["by"].items():
        kept = r["kept"]["by"].get(k, {"docs": 0, "chars": 0})
        out.append(f"| {k} | {v['docs']:,} | {v['chars']:,} | {kept['docs']:,} | {_pct(kept['docs'], v['docs'])} |")
    out += ["", "## Removed, by rule (each document counted once, under the first rule it fails)", ""]
    if not r["removed"]:
        out.append("Nothing.")
    else:
        out += ["| rule | language/source | docs | chars | share of the source's docs |", "|---|---|---:|---:|---:|"]
        for name, x in r["removed"].items():
            for k, v in x["by"].items():
                out.append(f"| {name} | {k} | {v['docs']:,} | {v['chars']:,} | "
                           f"{_pct(v['docs'], r['in']['by'][k]['docs'])} |")
    if r.get("would_fail_alone"):
        out += ["", "## Each quality rule alone (documents it would remove if it were the only rule)", ""]
        keys = list(r["in"]["by"])
        out += ["| rule | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for name, by in r["would_fail_alone"].items():
            cells = [f"{by.get(k, {'docs': 0})['docs']} ({_pct(by.get(k, {'docs': 0})['docs'], r['in']['by'][k]['docs'])})"
                     for k in keys]
            on = "" if name in r["rules"]["enabled"] else " (off)"
            out.append(f"| {name}{on} | " + " | ".join(cells) + " |")
    out += ["", "## Duplicate clusters (size: clusters)", ""]
    for kind, sizes in r["clusters"].items():
        out.append(f"- {kind}: " + (", ".join(f"{s}: {n}" for s, n in sizes.items()) or "none"))
    out += ["", "## Examples (first 80 characters)", ""]
    for name, x in r["removed"].items():
        for e in x["examples"]:
            out.append(f"- {name}: `{e.replace(chr(10), ' / ').replace('`', chr(39))}`")
    sp = r["split"]
    out += ["", "## Validation split of whole works", "",
            "| side | works | docs | chars |", "|---|---:|---:|---:|"]
    for side in ("train", "val"):
        out.append(f"| {side} | {sp[side]['works']:,} | {sp[side]['docs']:,} | {sp[side]['chars']:,} |")
        for lang, x in sp[side]["by_lang"].items():
            out.append(f"| {side}, {lang} | {x['works']:,} | {x['docs']:,} | {x.get('chars', 0):,} |")
    out.append("")
    out.append(f"Validation works with a part in training: {r['val_works_with_train_parts']}.")
    out += ["", "## Time", ""]
    for k, v in r["seconds"].items():
        rate = f" ({mb / v:.1f} MB/s of input)" if mb and v > 0 else ""
        out.append(f"- {k}: {v:.2f} s{rate}")
    near = r["near"]
    out += ["", f"Near duplicates: MinHash of word {near['ngram']}-grams, {near['num_perm']} hashes in {near['bands']} "
            f"bands of {near['rows']}, estimated Jaccard ≥ {near['threshold']}. Rules switched off: "
            f"{', '.join(r['off']) or 'none'}.", ""]
    return "\n".join(out)


__all__ = ["settings_from", "fingerprint", "check_languages_left", "summary_lines", "markdown", "eval_texts",
           "REASONS", "CODE"]
