"""Precision and recall of each cleaning rule on the planted corpus (benchmarks/planted_corpus.py).

Generates the curated corpus with planted defects (seeded), runs the cleaning stage on it without tokenizing
(``train.clean.split.scan_and_decide``, the shards' own code) and scores every planted defect against the truth:

* near-copies (per edit rate) and exact copies: caught when the copy and its original end in one duplicate
  cluster; the near-copy of a validation document: the validation original kept, the copy removed;
* near_dup precision: a removal is right when it belongs to a planted pair, or when its exact word-3-gram Jaccard
  similarity with another member of its cluster is at least ``TRUE_NEAR`` (a real near-duplicate of the curated
  corpus: the same poem in two collections, spelled differently) — measured on the texts, not on MinHash;
* boilerplate, spam, mojibake, mixed-script pages: removed by a quality rule (which one is listed);
* eval items: the document removed by ``decontam_eval`` (or on the validation side, never trained on).

``--compare`` also runs FineWeb's near-duplicate settings (word 5-grams, 112 hashes in 14 bands of 8, no
verification) and 5-grams in 28 bands of 4 on the same corpus. Writes benchmarks/results/cleaning_planted.{md,json}.

    python benchmarks/clean_planted.py [--seed 0] [--base-docs 0] [--workers 2] [--compare]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.planted_corpus import NEAR_RATES, make_planted  # noqa: E402
from train.clean import quality, stage  # noqa: E402
from train.clean.decide import CODE, VAL  # noqa: E402
from train.clean.split import scan_and_decide  # noqa: E402
from train.clean.text import words  # noqa: E402
from train.config import load_config  # noqa: E402
from train.corpus import iter_documents, list_input_files  # noqa: E402

TRUE_NEAR = 0.3
BAD_KINDS = ("boilerplate", "spam", "mojibake", "mixed_script")
REASON_OF = {v: k for k, v in CODE.items()}


def _jaccard3(a: str, b: str) -> float:
    x, y = words(a), words(b)
    A = {tuple(x[i:i + 3]) for i in range(len(x) - 2)}
    B = {tuple(y[i:i + 3]) for i in range(len(y) - 2)}
    return len(A & B) / max(len(A | B), 1)


def score(codes, report, cleaner, truth: dict, texts: list[str]) -> dict:
    """Recall per planted kind (and edit rate), precision per rule; see the module doc."""
    base = truth["base"]
    planted = truth["planted"]
    cluster_of: dict[int, set] = defaultdict(set)  # a document kept in an exact cluster may head a near one too
    for reason, cls in cleaner.clusters.items():
        for ci, members in enumerate(cls):
            for m in members:
                cluster_of[m].add((reason, ci))
    first_rule = {}
    for name, x in report["removed"].items():
        first_rule[name] = x["docs"]
    out: dict = {"recall": {}, "precision": {}, "notes": []}
    same = defaultdict(lambda: [0, 0])
    pair_docs: set[int] = set()
    for k, p in enumerate(planted):
        d = base + k
        if p["kind"] in ("near", "exact"):
            i = p["base"]
            pair_docs |= {i, d}
            key = f"near {p['rate']:.0%}" if p["kind"] == "near" else "exact"
            if CODE["quality"] in (int(codes[i]), int(codes[d])):  # removed before deduplication: not its miss
                out["notes"].append(f"{key} copy of document {i}: removed by a quality rule before deduplication "
                                    f"(left out of the recall)")
                continue
            caught = bool(cluster_of[i] & cluster_of[d])
            same[key][0] += caught
            same[key][1] += 1
            if p["kind"] == "near" and p.get("of_val_candidate") and codes[i] == VAL:
                out["notes"].append(f"near-copy ({p['rate']:.0%} edits) of a validation document: validation original "
                                    f"kept: {codes[i] == VAL}; copy removed as {REASON_OF.get(int(codes[d]), 'kept')}")
        elif p["kind"] in BAD_KINDS:
            c = int(codes[d])
            same[p["kind"]][0] += c == CODE["quality"]
            same[p["kind"]][1] += 1
        elif p["kind"] == "eval":
            c = int(codes[d])
            same["eval"][0] += c in (CODE["decontam_eval"], CODE["decontam_val"], VAL)
            same["eval"][1] += 1
    out["recall"] = {k: {"found": v[0], "planted": v[1], "recall": v[0] / max(v[1], 1)} for k, v in same.items()}
    le10 = [same[f"near {r:.0%}"] for r in NEAR_RATES if r <= 0.10]
    out["recall"]["near ≤ 10 %"] = {"found": sum(v[0] for v in le10), "planted": sum(v[1] for v in le10),
                                     "recall": sum(v[0] for v in le10) / max(sum(v[1] for v in le10), 1)}
    # near_dup precision: removals that are planted pairs or real near-duplicates by exact 3-gram Jaccard
    tp = fp = real = 0
    false = []
    for members in cleaner.clusters.get("near_dup", []):
        for m in members:
            if codes[m] != CODE["near_dup"]:
                continue
            if m in pair_docs and any(o in pair_docs for o in members if o != m):
                tp += 1
            elif max(_jaccard3(texts[m], texts[o]) for o in members if o != m) >= TRUE_NEAR:
                tp += 1
                real += 1
            else:
                fp += 1
                false.append(texts[m][:80])
    out["precision"]["near_dup"] = {"right": tp, "wrong": fp, "precision": tp / max(tp + fp, 1),
                                    "real_near_duplicates_of_the_curated_corpus": real, "wrong_examples": false[:5]}
    kinds = {base + k: p["kind"] for k, p in enumerate(planted)}
    bits = {name: b for b, name in enumerate(quality.ALL)}
    for name in list(quality.ALL) + ["decontam_eval", "exact_dup"]:
        removed = [i for i in range(len(codes)) if (int(codes[i]) == CODE["quality"] and name in bits
                                                    and _first_rule(cleaner, i) == name)
                   or (name not in bits and int(codes[i]) == CODE[name])]
        if not removed:
            continue
        by = Counter(kinds.get(i, "curated") for i in removed)
        # a quality rule is right on planted bad pages; exact_dup always (equal normalised texts); decontam_eval on
        # planted eval documents and on curated ones (the evaluation items were taken from curated documents)
        good = sum(n for k, n in by.items() if k in BAD_KINDS) if name in bits else len(removed)
        out["precision"][name] = {"removed": len(removed), "by_kind": dict(by), "precision": good / len(removed)}
    return out


def _first_rule(cleaner, i: int) -> str | None:
    mask = int(cleaner.fails[i]) & quality.enabled_mask(cleaner.settings.rules)
    for b, name in enumerate(quality.ALL):
        if mask >> b & 1:
            return name
    return None


def run(folder: Path, workers: int, near: dict | None = None) -> tuple:
    cfg = load_config("cpu", [f"data.paths={json.dumps([str(folder)])}", f"data.num_workers={workers}",
                              f"data.cache_dir={json.dumps(str(folder / 'cache'))}"])
    settings = stage.settings_from(cfg)
    for k, v in (near or {}).items():
        setattr(settings, k, v)
    settings.__post_init__()
    t0 = time.perf_counter()
    codes, report, cleaner = scan_and_decide(cfg, list_input_files(cfg.data.paths), settings)
    return codes, report, cleaner, time.perf_counter() - t0, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-docs", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        truth = make_planted(folder, a.seed, a.base_docs)
        variants = {"ours": None}
        if a.compare:
            variants["fineweb 5-gram 14×8"] = {"ngram": 5, "bands": 14, "rows": 8, "threshold": 0.0}
            variants["5-gram 28×4, verified ≥ 0.3"] = {"ngram": 5, "bands": 28, "rows": 4, "threshold": 0.3}
        results = {}
        for name, near in variants.items():
            codes, report, cleaner, secs, cfg = run(folder, a.workers, near)
            texts = [d.text for d in iter_documents(list_input_files(cfg.data.paths))
                     if d.lang in cfg.data.languages]
            results[name] = {"near": report["near"], "seconds": secs, **score(codes, report, cleaner, truth, texts)}
            print(name, json.dumps(results[name]["recall"], ensure_ascii=False))
    res = {"seed": a.seed, "base_docs": truth["base"], "planted": len(truth["planted"]), "results": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cleaning_planted.json").write_text(json.dumps(res, ensure_ascii=False, indent=1), encoding="utf-8")
    lines = ["# Cleaning on the planted corpus", "",
             f"`python benchmarks/clean_planted.py --seed {a.seed} --base-docs {a.base_docs} --workers {a.workers}"
             f"{' --compare' if a.compare else ''}`: {truth['base']:,} curated documents of data/sample and "
             f"{len(truth['planted'])} planted ones (benchmarks/planted_corpus.py, seed {a.seed}).", ""]
    for name, r in results.items():
        n = r["near"]
        lines += [f"## {name}: word {n['ngram']}-grams, {n['num_perm']} hashes in {n['bands']} bands of {n['rows']}, "
                  f"verified at estimated Jaccard ≥ {n['threshold']} ({r['seconds']:.0f} s, scan and decisions)", "",
                  "| planted | found | of | recall |", "|---|---:|---:|---:|"]
        for k, v in r["recall"].items():
            lines.append(f"| {k} | {v['found']} | {v['planted']} | {v['recall']:.3f} |")
        lines += ["", "| rule | removed | precision | removed documents by kind |", "|---|---:|---:|---|"]
        for k, v in r["precision"].items():
            if k == "near_dup":
                lines.append(f"| near_dup | {v['right'] + v['wrong']} | {v['precision']:.3f} | planted pairs and "
                             f"{v['real_near_duplicates_of_the_curated_corpus']} real near-duplicates of the curated "
                             f"corpus (3-gram Jaccard ≥ {TRUE_NEAR}); wrong: {v['wrong']} |")
            else:
                lines.append(f"| {k} | {v['removed']} | {v['precision']:.3f} | "
                             + ", ".join(f"{kk} {vv}" for kk, vv in v["by_kind"].items()) + " |")
        lines += [""] + [f"- {x}" for x in r["notes"]] + [""]
    (a.out / "cleaning_planted.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
