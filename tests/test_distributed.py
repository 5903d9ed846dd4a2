"""torchrun: 2 processes on CPU (gloo) reach the weights of one process with the same global batch, and
resume works under torchrun (issue 5)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from tests.conftest import ROOT, fast_overrides
from train.components.checkpoint import find_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), "-m", "train.run", *args]
    else:
        cmd = [sys.executable, "-m", "train.run", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _args(tmp, cache, name, **extra) -> list[str]:
    sets = fast_overrides(tmp, cache, **{"run.name": name, "train.grad_accum": 2, **extra})
    return ["--config", "tiny", *[a for s in sets for a in ("--set", s)]]


def _weights(run_dir):
    return safetensors.torch.load_file(str(find_checkpoint(run_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def prepared_cache(tmp_path_factory):
    """Prepare data once, single-process, so the torchrun ranks hit the cache."""
    from tests.conftest import fast_config
    from train.data import prepare

    tmp = tmp_path_factory.mktemp("ddp")
    cache = tmp / "cache"
    prepare(fast_config(tmp, cache), log=lambda m: None)
    return tmp, cache


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_ranks_match_one_process(prepared_cache, optimizer):
    tmp, cache = prepared_cache
    kw = {"train.max_steps": 4, "train.optimizer": optimizer}
    one = _run(_args(tmp, cache, f"one-{optimizer}", **kw), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(_args(tmp, cache, f"two-{optimizer}", **kw), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "× 1 accum × 2 ranks" in two.stderr  # grad_accum 2 split across 2 ranks: the global batch is kept
    wa, wb = _weights(tmp / "runs" / f"one-{optimizer}"), _weights(tmp / "runs" / f"two-{optimizer}")
    moved = max(float((wa[k] - _weights_init(tmp, cache)[k]).abs().max()) for k in wa)
    assert moved > 1e-3  # the weights did move, so agreement means something
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < 1e-5, f"max |Δw| {worst}"
    # only rank 0 wrote: one metrics file, one set of rows per step
    rows = (tmp / "runs" / f"two-{optimizer}" / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "train"' in r for r in rows) == 4
    assert '"world_size": 2' in (tmp / "runs" / f"two-{optimizer}" / "summary.json").read_text()


_INIT: dict = {}


def _weights_init(tmp, cache):
    if not _INIT:
        r = _run(_args(tmp, cache, "init0", **{"train.max_steps": 0}), nproc=1)
        assert r.returncode == 0, r.stderr[-2000:]
        _INIT.update(_weights(tmp / "runs" / "init0"))
    return _INIT


@pytest.mark.slow
def test_resume_under_torchrun(prepared_cache):
    tmp, cache = prepared_cache
    for name, nproc in (("r1", 1), ("r2", 2)):
        first = _run(_args(tmp, cache, name, **{"train.max_steps": 3}), nproc=nproc)
        assert first.returncode == 0, first.stderr[-3000:]
        again = _run(_args(tmp, cache, name, **{"train.max_steps": 5}) + ["--resume"], nproc=nproc)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resumed from" in again.stderr and "at step 3" in again.stderr
    wa, wb = _weights(tmp / "runs" / "r1"), _weights(tmp / "runs" / "r2")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    assert torch.load(find_checkpoint(tmp / "runs" / "r2") / "optimizer.pt", weights_only=True)


def test_micro_split_keeps_the_global_batch_or_refuses():
    """Each rank's (micro_batch_size, grad_accum): the accumulation is divided among the ranks when it can be, else
    the micro-batch; a world size that divides neither is refused, naming both."""
    from train.components.placement import micro_split
    from train.config import TrainSection
    from train.errors import TrainError

    t = TrainSection(micro_batch_size=8, grad_accum=4)
    assert [micro_split(t, w) for w in (1, 2, 4, 8)] == [(8, 4), (8, 2), (8, 1), (1, 4)]
    with pytest.raises(TrainError, match=r"world size 3 divides neither train.grad_accum \(4\) nor "
                                         r"train.micro_batch_size \(8\)"):
        micro_split(t, 3)
