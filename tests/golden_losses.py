"""Golden training losses: the per-step losses of the ``tiny`` preset on ``tests/data/mini``, CPU, float32, one
thread, checked in as ``tests/data/golden/tiny_losses.json`` and asserted bit for bit by
``tests/test_golden_loss.py`` (the practice of torchtitan's loss-convergence tests).

Usage (from the repository root)::

    python -m tests.golden_losses           # train, compare with the file, print the steps that changed
    python -m tests.golden_losses --write   # train and (re)write the file; say why in the commit message
    python -m tests.golden_losses --json    # train and print the run's record as JSON (what the test reads)

The run is pinned to one intra-op thread (``torch.set_num_threads(1)``, restored afterwards) so its floats do
not depend on the machine's core count or on ``OMP_NUM_THREADS``. The tokenizer and shards are prepared in a temporary folder, so nothing in the checkout
changes except the golden file under ``--write``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from train.atomic import atomic_write_text
from train.config import load_config
from train.run import Trainer

ROOT = Path(__file__).resolve().parent.parent
MINI = ROOT / "tests" / "data" / "mini"
GOLDEN = ROOT / "tests" / "data" / "golden" / "tiny_losses.json"
PRESET = "tiny"
REGENERATE = "python -m tests.golden_losses --write"

# ``--set`` overrides on the tiny preset (paths added at run time): ~20 optimizer steps in a few seconds.
SETTINGS: dict[str, object] = {
    "data.val_fraction": 0.05,
    "tokenizer.vocab_size": 1000,
    "model.hidden_size": 64,
    "model.num_hidden_layers": 2,
    "model.num_attention_heads": 4,
    "model.num_key_value_heads": 2,
    "model.intermediate_size": 128,
    "model.max_position_embeddings": 64,
    "train.device": "cpu",
    "train.dtype": "float32",
    "train.compile": False,
    "train.micro_batch_size": 4,
    "train.seq_len": 64,
    "train.grad_accum": 1,
    "train.max_steps": 20,
    "train.warmup_steps": 3,
    "train.eval_every": 1000,
    "train.eval_tokens": 256,
    "train.ckpt_every": 1000,
    "train.log_every": 1,
    "train.preflight": False,
}
NUM_THREADS = 1


def run_losses() -> dict:
    """Train the golden run once and return its record.

    Returns a dict with ``preset``, ``torch`` (``torch.__version__``), ``num_threads``, ``settings`` (the
    overrides above) and ``losses``: one entry per optimizer step, ``{"step", "loss", "hex"}``, where ``loss`` is
    the mean training NLL in nats per target token as logged in the run's ``metrics.jsonl`` and ``hex`` is
    ``float.hex`` of it (the exact value compared).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)  # restored below, so a caller's (a test session's) setting is left alone
    try:
        return _run_pinned()
    finally:
        torch.set_num_threads(threads)


def _run_pinned() -> dict:
    with tempfile.TemporaryDirectory(prefix="shalik-golden-") as tmp:
        paths = {
            "data.paths": [str(MINI)],
            "data.cache_dir": str(Path(tmp) / "cache"),
            "run.out_dir": str(Path(tmp) / "runs"),
            "run.name": "golden",
        }
        overrides = [f"{k}={json.dumps(v)}" for k, v in {**SETTINGS, **paths}.items()]
        cfg = load_config(PRESET, overrides)
        Trainer(cfg, log=lambda m: None).train()
        metrics = Path(tmp) / "runs" / "golden" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    losses = [
        {"step": r["step"], "loss": r["loss"], "hex": float(r["loss"]).hex()} for r in rows if r["kind"] == "train"
    ]
    return {
        "preset": PRESET,
        "torch": torch.__version__,
        "num_threads": NUM_THREADS,
        "settings": SETTINGS,
        "losses": losses,
    }


def diff(expected: dict, actual: dict) -> list[str]:
    """Lines describing every difference between two records (empty when they are bit-identical).

    Names the torch version or settings when they differ, each step whose loss changed with old, new and the
    difference (new − old, nats), and steps present in only one record.
    """
    out = []
    for key in ("preset", "torch", "num_threads", "settings"):
        if expected.get(key) != actual.get(key):
            out.append(f"{key}: recorded {expected.get(key)!r}, now {actual.get(key)!r}")
    old = {e["step"]: e for e in expected.get("losses", [])}
    new = {e["step"]: e for e in actual.get("losses", [])}
    for step in sorted(old.keys() | new.keys()):
        a, b = old.get(step), new.get(step)
        if a is None or b is None:
            out.append(f"step {step}: {'only now' if a is None else 'only recorded'}")
        elif a["hex"] != b["hex"]:
            d = float.fromhex(b["hex"]) - float.fromhex(a["hex"])
            out.append(f"step {step}: {float.fromhex(a['hex'])!r} -> {float.fromhex(b['hex'])!r} ({d:+.3e})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.golden_losses", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"rewrite {GOLDEN.relative_to(ROOT)}")
    g.add_argument("--json", action="store_true", help="print the run's record as JSON on stdout")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    actual = run_losses()
    if args.json:
        print(json.dumps(actual))
        return 0
    expected = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.is_file() else {}
    changes = diff(expected, actual)
    for line in changes:
        print(line)
    if args.write:
        atomic_write_text(GOLDEN, json.dumps(actual, indent=1) + "\n")
        print(f"wrote {GOLDEN.relative_to(ROOT)} ({len(actual['losses'])} steps, {len(changes)} changes)")
        return 0
    print("bit-identical" if not changes else f"{len(changes)} differences; to accept: {REGENERATE}")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
