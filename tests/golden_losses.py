"""Golden training losses: the per-step losses of the ``tiny`` preset on ``tests/data/mini``, CPU, float32, one
thread, checked in as ``tests/data/golden/tiny_losses.json`` and asserted bit for bit by
``tests/test_golden_loss.py`` (the practice of torchtitan's loss-convergence tests).

Usage (from the repository root)::

    python -m tests.golden_losses           # train, compare with the file, print the steps that changed
    python -m tests.golden_losses --write   # train and (re)write the file; say why in the commit message
    python -m tests.golden_losses --json    # train and print the run's record as JSON (what the test reads)

The run is pinned to one intra-op thread (``torch.set_num_threads(1)``, restored afterwards) so its floats do
not depend on the machine's core count or on ``OMP_NUM_THREADS``. They still depend on the CPU's instruction set
(oneDNN and the BLAS pick kernels by CPU: an Intel Xeon and an AMD EPYC differed in the last bits), so the file
holds one record per environment (torch version + :func:`cpu_fingerprint`): the test compares bit for bit with
the record of its own environment and, on a machine with none, within :data:`FOREIGN_RTOL` of the first record
(``--write`` adds this machine's record and keeps the others). The tokenizer and shards are prepared in a temporary folder, so nothing in the checkout
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

from contract.atomic import atomic_write_text
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
    # AdamW + cosine pinned: Muon's Newton-Schulz runs in bfloat16, whose CPU kernels (AMX, AVX-512 BF16, none)
    # round differently per ISA, so its losses cannot be held bit for bit across machines; the default recipe's own
    # determinism is held by the bit-identical --resume and DDP tests on one machine
    "train.optimizer": "adamw",
    "train.schedule": "cosine",
    "train.lr": 1e-2,
    "train.min_lr": 1e-3,
    "train.warmup_steps": 3,
    "train.eval_every": 1000,
    "train.eval_tokens": 256,
    "train.ckpt_every": 1000,
    "train.log_every": 1,
    "train.preflight": False,
}
NUM_THREADS = 1
FOREIGN_RTOL = 1e-5  # relative, per step: another ISA moved losses by <= 4e-7 here; a numerics change by >= 1e-4


def cpu_fingerprint() -> str:
    """The CPU as its kernels see it: ``platform.machine()``, torch's dispatch level
    (``torch.backends.cpu.get_cpu_capability()``, e.g. ``AVX512``) and ``/proc/cpuinfo``'s model name
    (:func:`contract.cpu.cpu_name`)."""
    import platform

    from contract.cpu import cpu_name

    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} {cpu_name() or 'unknown'}"


def environment(record: dict) -> tuple:
    """What a record's floats depend on besides the code: (torch version, CPU fingerprint)."""
    return record.get("torch"), record.get("cpu")


def read_records() -> list[dict]:
    """The golden file's records (``{"records": [...]}``), oldest first; [] when there is none."""
    if not GOLDEN.is_file():
        return []
    data = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return data["records"] if "records" in data else [data]


def pick(records: list[dict], actual: dict) -> tuple[dict | None, bool]:
    """The record to compare ``actual`` with and whether it is of the same environment (bit-identical expected);
    else the first record (compared within FOREIGN_RTOL). (None, False) when there are none."""
    for r in records:
        if environment(r) == environment(actual):
            return r, True
    return (records[0], False) if records else (None, False)


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
        "cpu": cpu_fingerprint(),
        "num_threads": NUM_THREADS,
        "settings": SETTINGS,
        "losses": losses,
    }


def diff(expected: dict, actual: dict, rtol: float = 0.0) -> list[str]:
    """Lines describing every difference between two records (empty when they agree: bit for bit when ``rtol``
    is 0, else each loss within ``rtol`` relative).

    Names the preset, thread count or settings when they differ, each step whose loss changed with old, new and
    the difference (new − old, nats), and steps present in only one record. (The environment — torch, CPU — is
    chosen by :func:`pick`, not reported here.)
    """
    out = []
    for key in ("preset", "num_threads", "settings"):
        if expected.get(key) != actual.get(key):
            out.append(f"{key}: recorded {expected.get(key)!r}, now {actual.get(key)!r}")
    old = {e["step"]: e for e in expected.get("losses", [])}
    new = {e["step"]: e for e in actual.get("losses", [])}
    for step in sorted(old.keys() | new.keys()):
        a, b = old.get(step), new.get(step)
        if a is None or b is None:
            out.append(f"step {step}: {'only now' if a is None else 'only recorded'}")
        elif a["hex"] != b["hex"]:
            old_v, new_v = float.fromhex(a["hex"]), float.fromhex(b["hex"])
            d = new_v - old_v
            if abs(d) <= rtol * abs(old_v):
                continue
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
    records = read_records()
    expected, same = pick(records, actual)
    changes = diff(expected or {}, actual, 0.0 if same else FOREIGN_RTOL)
    if expected is not None and not same:
        print(f"no record for this environment {environment(actual)}; compared within {FOREIGN_RTOL:g} with "
              f"{environment(expected)}")
    for line in changes:
        print(line)
    if args.write:
        keep = [r for r in records if environment(r) != environment(actual)]
        atomic_write_text(GOLDEN, json.dumps({"records": [*keep, actual]}, indent=1) + "\n")
        print(f"wrote {GOLDEN.relative_to(ROOT)} ({len(keep) + 1} records; this one: {len(actual['losses'])} steps, "
              f"{len(changes)} changes)")
        return 0
    print("identical" if not changes else f"{len(changes)} differences; to accept: {REGENERATE}")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
