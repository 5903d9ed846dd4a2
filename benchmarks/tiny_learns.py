"""docs/design.md's "tiny learns": tiny on data/sample with a 3,000-token vocabulary, 200 steps of 4,096 tokens on CPU,
must bring val NLL at least 2 nats/token below the random-init twin's, in under 2 minutes.

Times the training run itself (data preparation is cached and reported apart), puts each language's validation
bits/char beside the compressor floor (PPMd-16 primed with the training side of the same split,
``train.compression``) and writes benchmarks/results/tiny_learns.{md,json}.

    python benchmarks/tiny_learns.py [--vocab 3000] [--steps 200] [--seeds 1337 0 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import timing  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from train import compression  # noqa: E402
from train.config import load_config  # noqa: E402
from train.data import prepare  # noqa: E402
from train.run import Trainer  # noqa: E402


def run_once(vocab: int, steps: int, seed: int | None) -> dict:
    """One tiny run in a temporary folder: its summary plus training and preparation seconds."""
    out_dir = Path(tempfile.mkdtemp(prefix="tiny-learns-"))
    try:
        sets = [f"tokenizer.vocab_size={vocab}", f"train.max_steps={steps}", f"train.eval_every={steps}",
                "train.ckpt_every=100000", "train.preflight=false", f"run.out_dir={json.dumps(str(out_dir))}",
                f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"] + ([f"run.seed={seed}"] if seed is not None else [])
        cfg = load_config("tiny", sets)
        t0 = time.time()
        prepare(cfg, log=lambda m: None)
        prep_s = time.time() - t0
        t0 = time.time()
        s = Trainer(cfg, log=lambda m: None).train()
        train_s = time.time() - t0
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    drop = s["random_init"]["all"]["nll"] - s["val"]["all"]["nll"]
    return {"seed": cfg.run.seed, "tokens": s["tokens"], "train_seconds": train_s, "prepare_seconds": prep_s,
            "random_init_nll": s["random_init"]["all"]["nll"], "val_nll": s["val"]["all"]["nll"], "drop_nats": drop,
            "val": s["val"], "tokens_per_s": s["tokens_per_s"], "passes": drop >= 2.0 and train_s < 120}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=3000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="*", default=None,
                   help="run.seed of each run (default: the preset's); the outcome at this budget moves with the seed")
    args = p.parse_args(argv)
    runs = [run_once(args.vocab, args.steps, seed) for seed in (args.seeds or [None])]
    floor = compression.measure(load_config("tiny", [f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"]),
                                log=lambda m: None)["languages"]
    res = {"vocab": args.vocab, "steps": args.steps, "runs": runs, "passes": all(r["passes"] for r in runs),
           "floor_ppmd16_bpc": {k: v["ppmd16"] for k, v in floor.items()}}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "tiny_learns.json", res)
    omp = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    lines = ["# tiny learns", "",
             f"tiny, vocab {args.vocab}, {args.steps} steps × 4,096 tokens on CPU; target: val NLL ≥ 2 nats/token below "
             f"the random-init twin in < 120 s of training (data preparation is cached after the first run). "
             f"`{omp}python benchmarks/tiny_learns.py{' --seeds ' + ' '.join(map(str, args.seeds)) if args.seeds else ''}`"
             f" ({torch.get_num_threads()} torch thread(s); CPU: {timing.cpu_name()}; load average {timing.loadavg()[0]:.1f} at the end).", "",
             "| seed | random-init NLL | val NLL | drop (nats) | training s | tokens/s | per language NLL | "
             "val bits/char (PPMd-16 floor) | passes |",
             "|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in runs:
        langs = ", ".join(f"{k} {v['nll']:.3f}" for k, v in r["val"].items() if k != "all")
        bpc = ", ".join(f"{k} {v['bpc']:.3f} ({floor[k]['ppmd16']:.3f})" for k, v in r["val"].items()
                        if k in floor)
        lines.append(f"| {r['seed']} | {r['random_init_nll']:.3f} | {r['val_nll']:.3f} | **{r['drop_nats']:.2f}** | "
                     f"{r['train_seconds']:.0f} | {r['tokens_per_s']:,.0f} | {langs} | {bpc} | "
                     f"{'yes' if r['passes'] else 'no'} |")
    drops = [r["drop_nats"] for r in runs]
    lines += ["", f"Drops {min(drops):.2f}–{max(drops):.2f} nats over {len(runs)} seed(s), {min(drops) - 2:+.2f} from the "
              "target at the worst. With the previous recipe (AdamW + cosine) the drop moved with the seed by about 0.4 "
              "nats and sat at the target's edge (2.05 and 1.71), so read several seeds.", "",
              "The validation split is one of whole works (train.clean: no part of a validation work is trained on). "
              "Bits/char: the run's own validation evaluation (a sample of the split); the floor: PPMd-16 primed with "
              "the training side, on the whole validation side of each language (train.compression)."]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "tiny_learns.md", text)
    print(text)
    return 0 if res["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
