"""DESIGN.md's "tiny learns": tiny on data/sample with a 3,000-token vocabulary, 200 steps of 4,096 tokens on CPU,
must bring val NLL at least 2 nats/token below the random-init twin's, in under 2 minutes.

Times the training run itself (data preparation is cached and reported apart) and writes
benchmarks/results/tiny_learns.{md,json}.

    python benchmarks/tiny_learns.py [--vocab 3000] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train.config import load_config  # noqa: E402
from train.data import prepare  # noqa: E402
from train.run import Trainer  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=3000)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="tiny-learns-"))
    try:
        cfg = load_config("tiny", [f"tokenizer.vocab_size={args.vocab}", f"train.max_steps={args.steps}",
                                   f"train.eval_every={args.steps}", "train.ckpt_every=100000", "train.preflight=false",
                                   f"run.out_dir={json.dumps(str(out_dir))}",
                                   f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"])
        t0 = time.time()
        prepare(cfg, log=lambda m: None)
        prep_s = time.time() - t0
        t0 = time.time()
        s = Trainer(cfg, log=lambda m: None).train()
        train_s = time.time() - t0
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    drop = s["random_init"]["all"]["nll"] - s["val"]["all"]["nll"]
    res = {"vocab": args.vocab, "steps": args.steps, "tokens": s["tokens"], "train_seconds": train_s,
           "prepare_seconds": prep_s, "random_init_nll": s["random_init"]["all"]["nll"], "val_nll": s["val"]["all"]["nll"],
           "drop_nats": drop, "val": s["val"], "tokens_per_s": s["tokens_per_s"],
           "passes": drop >= 2.0 and train_s < 120}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiny_learns.json").write_text(json.dumps(res, indent=2) + "\n")
    text = (f"# tiny learns\n\ntiny, vocab {args.vocab}, {args.steps} steps × 4,096 tokens on CPU: val NLL "
            f"{res['random_init_nll']:.3f} → {res['val_nll']:.3f} nats/token (**{drop:.2f} nats** below the random-init "
            f"twin; target ≥ 2) in **{train_s:.0f} s** of training (target < 120 s; data preparation {prep_s:.0f} s, "
            f"cached after the first run), {res['tokens_per_s']:,.0f} tokens/s. Per language: "
            + ", ".join(f"{k} {v['nll']:.3f}" for k, v in s["val"].items() if k != "all") + ".\n")
    (out / "tiny_learns.md").write_text(text)
    print(text)
    return 0 if res["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
