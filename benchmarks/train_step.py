"""The shared frame of the CPU training-step benchmarks (``cpu_bf16.py``, ``muon_ns.py``): their arguments, the
random batch every lane trains on, and the interleaved rounds (:mod:`benchmarks.timing`'s method: a warm-up step a
lane, then rounds in a rotated order, the load average before and after)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from benchmarks import timing
from train.config import Config, load_config

RESULTS = timing.ROOT / "benchmarks" / "results"
T = TypeVar("T")


def add_args(p: argparse.ArgumentParser, threads: int) -> None:
    """``--config`` (a preset), ``--rows`` (windows a step), ``--threads`` (default ``threads``), ``--rounds``,
    ``--vocab`` (the model's vocabulary size: a random batch needs no tokenizer) and ``--out`` (results folder)."""
    p.add_argument("--config", default="cpu")
    p.add_argument("--rows", type=int, default=8, help="windows a step (the cpu preset's micro-batch is 8)")
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--out", type=Path, default=RESULTS)


def setup(a: argparse.Namespace) -> tuple[Config, torch.Tensor]:
    """Set torch's threads to ``a.threads`` and return the config and the batch: ``[a.rows, seq_len + 1]`` int64
    token ids, uniform over ``a.vocab``, the same for every seed-0 run (inputs ``x[:, :-1]``, labels ``x[:, 1:]``)."""
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config, [])
    x = torch.randint(0, a.vocab, (a.rows, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return cfg, x


def interleave(step: Callable[[str], T], names: Sequence[str], rounds: int) -> tuple[dict[str, list[T]], list[float]]:
    """One untimed warm-up ``step(name)`` per lane, then ``rounds`` rounds of every lane in a rotated order. Returns
    each lane's results in round order, and the 1-minute load average before and after the rounds."""
    for n in names:
        step(n)
    load0 = timing.loadavg()
    runs: dict[str, list[T]] = {n: [] for n in names}
    for r in range(rounds):
        for n in timing.rotated(names, r):
            runs[n].append(step(n))
    return runs, [load0[0], timing.loadavg()[0]]
