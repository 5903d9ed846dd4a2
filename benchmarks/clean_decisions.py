"""The cleaning stage's decisions, recorded and checked: a change that makes it faster must not change them.

Runs the stage without tokenizing (``train.clean.split.scan_and_decide``, the shards' own code) on data/sample
and on the planted corpus (benchmarks/planted_corpus.py, seed 0), on 1 and on 2 processes, and digests per
corpus what it decided and what it computed per document:

* ``codes`` — the kept/removed sets: one code per document in reading order (train, val, or the removal
  reason), with the count of each;
* ``fails`` (the quality rules' failure masks, every rule), ``text_hash`` (exact deduplication), ``bands`` (the
  LSH band keys of the MinHash signatures), ``eval_hit`` and ``gram_counts`` (decontamination) — sha256 of each.

``--record`` writes them to benchmarks/results/clean_decisions.json; without it the run is compared with that
file and with itself across process counts, and the script exits 1 naming what differs.

    python benchmarks/clean_decisions.py [--record] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.planted_corpus import make_planted  # noqa: E402
from train.clean.decide import CODE  # noqa: E402
from train.clean.split import scan_and_decide  # noqa: E402
from train.config import load_config  # noqa: E402
from train.corpus import list_input_files  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "clean_decisions.json"
NAMES = {0: "train", 1: "val", **{v: k for k, v in CODE.items()}}


def _sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:32]


def digest(paths: list[str], workers: int, cache: str) -> dict:
    """What the stage decided and computed on ``paths`` (see the module doc)."""
    cfg = load_config("cpu", [f"data.paths={json.dumps(paths)}", f"data.cache_dir={json.dumps(cache)}"])
    codes, _, cl = scan_and_decide(cfg, list_input_files(cfg.data.paths), workers=workers)
    th = np.concatenate(cl.text_hash) if cl.text_hash else np.zeros(0, np.uint64)
    bands = np.concatenate(cl.bands) if cl.bands else np.zeros(0, np.uint64)
    return {"docs": len(codes),
            "counts": {NAMES[k]: v for k, v in sorted(Counter(codes.tolist()).items())},
            "codes": _sha(codes.astype(np.int8)),
            "fails": _sha(np.asarray(cl.fails, dtype=np.uint32)),
            "text_hash": _sha(th.astype(np.uint64)),
            "bands": _sha(bands.astype(np.uint64)),
            "eval_hit": _sha(np.asarray(cl.eval_hit, dtype=np.int8)),
            "gram_counts": _sha(np.asarray(cl.gram_counts, dtype=np.int64))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help="write the digests instead of checking them")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args(argv)
    out: dict[str, dict] = {}
    bad: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        planted = Path(tmp) / "planted"
        make_planted(planted, 0, 0)
        for name, paths in (("data/sample", [str(ROOT / "data" / "sample")]), ("planted seed 0", [str(planted)])):
            for w in a.workers:
                d = digest(paths, w, str(Path(tmp) / f"cache-{w}"))
                print(f"{name}, {w} process(es): {json.dumps(d)}", flush=True)
                if name in out and d != out[name]:
                    bad.append(f"{name}: {w} processes differ from {a.workers[0]}")
                out.setdefault(name, d)
    if a.record:
        RESULT.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"recorded {RESULT.relative_to(ROOT)}")
    else:
        want = json.loads(RESULT.read_text(encoding="utf-8"))
        for name, d in out.items():
            for k, v in d.items():
                if want.get(name, {}).get(k) != v:
                    bad.append(f"{name}: {k} differs from the record ({want.get(name, {}).get(k)} → {v})")
    for b in bad:
        print("DIFFERS:", b)
    if not bad:
        print("same decisions" + ("" if a.record else " as recorded") + f" on {', '.join(out)} for processes "
              + ", ".join(map(str, a.workers)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
