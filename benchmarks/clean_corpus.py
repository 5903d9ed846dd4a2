"""What the cleaning stage removes from a corpus, without tokenizing: the report of ``python -m train.data report``.

Runs the stage's scan and decisions (``train.clean.split.scan_and_decide``, the shards' own code) on ``--data``
(default data/sample, which is the whole shared corpus gzipped) and writes the report (``cleaning.md``'s content)
to ``--out``.

    python benchmarks/clean_corpus.py [--data data/sample] [--workers 2] [--out benchmarks/results/cleaning_sample.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from train.clean import stage  # noqa: E402
from train.clean.split import scan_and_decide  # noqa: E402
from train.config import load_config  # noqa: E402
from train.corpus import list_input_files  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", default=["data/sample"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cleaning_sample.md")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("cpu", [f"data.paths={json.dumps(a.data)}", f"data.cache_dir={json.dumps(tmp)}"])
        files = list_input_files(cfg.data.paths)
        t0 = time.perf_counter()
        _, report, _ = scan_and_decide(cfg, files, workers=a.workers)
        wall = time.perf_counter() - t0
    mb = sum(Path(f).stat().st_size for f in files) / 1e6
    head = (f"`python benchmarks/clean_corpus.py --data {' '.join(a.data)} --workers {a.workers}`: the cleaning "
            f"stage alone (scan and decisions, no tokenizing) in {wall:.0f} s wall on {a.workers} processes; AMD EPYC "
            "(Zen 4), the machine shared with other jobs. Input file sizes: " + f"{mb:.1f} MB (compressed where "
            "gzipped).\n\n")
    text = stage.markdown(report).replace("# Cleaning report\n\n", "# Cleaning report: " + " ".join(a.data) + "\n\n"
                                          + head, 1)
    a.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
