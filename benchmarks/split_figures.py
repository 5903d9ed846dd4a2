"""A trained run's bits per character on the validation split of whole works, beside the compressor floor primed on
the new training side: the figures that quoted the old split, restated.

Loads ``RUN/checkpoints/latest`` (or ``--checkpoint``) and the run's ``config.toml``, computes the cleaning stage's
split for its data (``train.clean.split``; cached in ``--cache``), measures PPMd-16 and xz -9e primed with the
training side (``train.compression.measure``) and scores every validation document per source file with the
trainer's own final evaluation (``train.components.evaluation.evaluate_sources``). For a run trained before the split changed it
also says which share of the new validation characters that run trained on (the old split: a document was
validation when its own hash fell below ``val_fraction``): those figures flatter the model.

    python benchmarks/split_figures.py RUN [--cache cache] [--checkpoint DIR] [--out FILE.json]

Example: ``python benchmarks/split_figures.py runs/cpu`` after the README's main job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from contract.text import is_val  # noqa: E402
from train import compression  # noqa: E402
from train.clean.decide import VAL  # noqa: E402
from train.clean.split import iter_split  # noqa: E402
from train.components.checkpoint import load_model  # noqa: E402
from train.components.evaluation import evaluate_sources  # noqa: E402
from train.config import load_config  # noqa: E402
from train.corpus import list_input_files  # noqa: E402
from train.tokenizer import EOT, load_tokenizer, token_char_counts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--cache", default="cache", help="data.cache_dir for the split and the floor")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    t0 = time.time()
    cfg = load_config(str(a.run / "config.toml"), [f"data.cache_dir={json.dumps(a.cache)}"])
    files = list_input_files(cfg.data.paths)
    val_chars = trained_on = 0
    for d, code in iter_split(cfg, files, log=lambda m: print(m, file=sys.stderr)):
        if code == VAL:
            val_chars += len(d.text)
            trained_on += 0 if is_val(d.text, cfg.data.val_fraction) else len(d.text)
    floor = compression.measure(cfg, log=lambda m: print(m, file=sys.stderr))
    sources = compression.validation_sources(cfg)
    ckpt = a.checkpoint
    if ckpt is None:
        latest = a.run / "checkpoints" / "latest"
        ckpt = a.run / "checkpoints" / latest.read_text().strip() if latest.is_file() else latest
    model, _ = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    val = evaluate_sources(model, sources, tok, tok.token_to_id(EOT), np.asarray(token_char_counts(tok), dtype=np.int64), cfg.train.seq_len,
                           torch.device("cpu"))
    bpc = {k: v["bpc"] for k, v in val.items()}
    print(f"run {a.run} ({ckpt.name}), validation split of whole works: {sum(s.chars for s in sources.values()):,} "
          f"characters in {sum(len(s.docs) for s in sources.values())} documents; the run trained on "
          f"{trained_on / max(val_chars, 1):.1%} of them (old split)")
    print(compression.format_table(floor, bpc))
    res = {"run": str(a.run), "checkpoint": str(ckpt), "model_bpc": bpc, "floor": floor,
           "val_chars": val_chars, "val_chars_trained_on_old_split": trained_on, "seconds": time.time() - t0}
    if a.out:
        a.out.write_text(json.dumps(res, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
