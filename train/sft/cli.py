"""``python -m train.sft RUN [--data PATH...] [--name N] [--set k=v...] [--resume] [--strict] [--no-preflight]``:
fine-tune a pretrained run (a run folder as ``python -m train.run`` writes, e.g. ``runs/cpu``) on conversations.

The config is the pretrained run's ``config.toml`` with :data:`SFT_DEFAULTS` over it, then ``--data`` and
``--set`` (the same keys as ``train.run``); the run goes to ``runs/<base name>-sft`` unless ``--name`` or
``run.name`` says otherwise. ``train.micro_batch_size`` counts conversations. Without ``--data`` it trains on the
embedded Bangla + English set ``data/sft`` (built from the project's corpus by ``python -m train.sft.build``).
Exit codes as ``train.run``: 0 done, 1 a check refused, 2 bad input, 128 + the signal when stopped (130 Ctrl-C,
143 SIGTERM; the same command again continues).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from contract.cli import HelpFormatter
from train.config import ConfigError, load_config
from train.errors import TrainError
from train.run import run_trainer
from train.sft.data import base_checkpoint
from train.sft.trainer import SFTTrainer

DEFAULT_DATA = ["data/sft"]
# Fine-tuning over the pretrained run's config: conversations per micro-batch, a shorter schedule at a lower
# learning rate (the pretraining recipe's optimizer and linear decay to zero), a larger validation share for
# rows that bring no split of their own, evaluation and checkpoints on the shorter schedule.
SFT_DEFAULTS = {
    "train.micro_batch_size": 32,
    "train.grad_accum": 1,
    "train.max_steps": 400,
    "train.lr": 3e-3,
    "train.min_lr": 0.0,
    "train.warmup_steps": 20,
    "train.eval_every": 100,
    "train.eval_tokens": 4096,
    "train.ckpt_every": 100,
    "train.log_every": 10,
    # the head + loss compiled, the layers eager: compiled layers want static shapes, so every row would be padded
    # to train.seq_len + 1 (the conversations are mostly far shorter); --set train.compile=true asks for that
    "train.compile": "head",
    "train.final_eval": True,
    "data.val_fraction": 0.05,
}


def base_config_path(run: str, ckpt: Path) -> Path:
    """The pretrained run's ``config.toml`` (in the run folder, or two levels above a checkpoint folder)."""
    for p in (Path(run) / "config.toml", ckpt.parent.parent / "config.toml"):
        if p.is_file():
            return p
    raise TrainError(f"{run}: no config.toml beside its checkpoints (expected a run folder as python -m train.run "
                     f"writes, e.g. runs/cpu)")


def sft_config(run: str, ckpt: Path, data: list[str] | None, overrides: list[str], strict: bool, name: str | None):
    """The fine-tuning run's config (see the module doc). TrainError on a bad key or value."""
    src = base_config_path(run, ckpt)
    base_name = load_config(str(src)).run.name
    sets = [f"{k}={json.dumps(v)}" for k, v in SFT_DEFAULTS.items()]
    sets += [f"run.name={json.dumps(base_name + '-sft')}", f"data.paths={json.dumps(data or DEFAULT_DATA)}"]
    sets += list(overrides)
    if data:
        sets.append(f"data.paths={json.dumps(data)}")
    if strict:
        sets.append("data.strict=true")
    if name is not None:
        sets.append(f"run.name={json.dumps(name)}")
    try:
        return load_config(str(src), sets)
    except ConfigError as e:
        raise TrainError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.sft``."""
    p = argparse.ArgumentParser(prog="python -m train.sft", formatter_class=HelpFormatter,
                                description="Fine-tune a pretrained run (a run folder as python -m train.run "
                                            "writes, e.g. runs/cpu) on conversations: the same loop, preflight, "
                                            "checkpoints, --resume and run folder as train.run "
                                            "(docs/design.md, Fine-tuning).")
    p.add_argument("run", metavar="RUN", help="the pretrained run folder (or one of its checkpoints), e.g. runs/cpu")
    p.add_argument("--data", nargs="+", metavar="PATH", default=None,
                   help="conversations: .jsonl[.gz] files or folders (messages, Alpaca or ShareGPT rows) or "
                        "hf:NAME[:CONFIG][:SPLIT] (default: data/sft, the embedded set)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key as train.run does (repeatable)")
    p.add_argument("--name", default=None, help="run name: the folder runs/NAME (default: <base name>-sft)")
    p.add_argument("--resume", action="store_true", help="continue runs/NAME exactly from its latest checkpoint")
    p.add_argument("--strict", action="store_true", help="a row that is not a conversation is an error (exit 2)")
    p.add_argument("--no-preflight", action="store_true", help="skip preflight (not recommended)")
    args = p.parse_args(argv)

    def make() -> SFTTrainer:
        ckpt = base_checkpoint(args.run)
        cfg = sft_config(args.run, ckpt, args.data, args.overrides, args.strict, args.name)
        return SFTTrainer(cfg, base=ckpt, resume=args.resume, use_preflight=not args.no_preflight)

    return run_trainer(make, args.resume, done="fine-tuned")
