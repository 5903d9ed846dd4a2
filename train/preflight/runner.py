"""The preflight driver: runs the nine checks in order inside an isolated RNG scope and frees what they allocated."""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from train.config import TrainSection
from train.device import autocast_ctx
from train.model import ModelConfig
from train.optim import build_optimizer_for
from train.preflight.common import ModelFactory, OptimizerFactory
from train.preflight.determinism import check_determinism
from train.preflight.gradients import check_gradient_correctness, check_gradient_flow
from train.preflight.init_loss import check_init_loss
from train.preflight.layout import check_layout_invariance
from train.preflight.precision import check_precision
from train.preflight.report import CheckResult, PreflightReport
from train.preflight.throughput import check_throughput
from train.preflight.updates import check_learning, check_update_flow

CHECK_NAMES = ["gradient_flow", "gradient_correctness", "update_flow", "layout_invariance", "precision",
               "determinism", "learning", "throughput", "init_loss"]


def default_optimizer_factory(lr: float, device_type: str) -> OptimizerFactory:
    """The default recipe's optimizer (``[train]``'s defaults: Muon on the hidden matrices, AdamW on the rest) at
    ``lr``."""
    train = TrainSection(lr=lr)
    return lambda m: build_optimizer_for(m, train, device_type)


def release_memory(device: torch.device) -> None:
    """Collect what the checks left and, on CUDA, hand the cached blocks back (so the run's memory is its own)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def isolated_rng(device: torch.device, seed: int):
    """Fork every RNG (torch CPU/CUDA, Python, numpy), seed it, and restore all on exit."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def run_preflight(model: nn.Module, batch: torch.Tensor, *, device: torch.device, dtype: torch.dtype,
                  vocab_size: int, big_batch: torch.Tensor | None = None,
                  optimizer_factory: OptimizerFactory | None = None, model_factory: ModelFactory | None = None,
                  model_config: ModelConfig | None = None, lr: float = 1e-3, at_init: bool = True, seed: int = 0,
                  checks: list[str] | None = None, compare_dtype: torch.dtype | None = None,
                  log=print) -> PreflightReport:
    """Run the checks on copies of ``model`` and return the report (``report.ok`` False if any failed).

    ``batch`` is a small fixed batch of token windows, int64 ``[b, seq+1]`` on ``device``; ``big_batch`` (default
    ``batch``) is a training micro-batch for the throughput check. ``optimizer_factory(model)`` must build the
    optimizer the run uses (default: the ``[train]`` defaults' optimizer at ``lr``); ``model_factory(ModelConfig)`` builds the tiny
    float64 copy for finite differences (default: the model's class). The caller's RNG states and data are left
    untouched, and every tensor preflight allocated is freed (the CUDA cache emptied) before it returns.
    ``compare_dtype``: the throughput check also times the step under that dtype's autocast, interleaved (its
    ``values`` then hold the gain; the precision check always compares bfloat16 with float32).
    """
    cfg = model_config or getattr(model, "config", None)
    optimizer_factory = optimizer_factory or default_optimizer_factory(lr, device.type)
    model_factory = model_factory or type(model)
    ctx = autocast_ctx(device, dtype)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    big = big_batch if big_batch is not None else batch
    wanted = checks or CHECK_NAMES
    runners: dict[str, Callable[[], CheckResult]] = {
        "gradient_flow": lambda: check_gradient_flow(model, batch, ctx),
        "gradient_correctness": lambda: check_gradient_correctness(model_factory, cfg),
        "update_flow": lambda: check_update_flow(model, batch, ctx, optimizer_factory),
        "layout_invariance": lambda: check_layout_invariance(model, batch, ctx, atol),
        "precision": lambda: check_precision(model, batch, device, dtype),
        "determinism": lambda: check_determinism(model, batch, ctx, device),
        "learning": lambda: check_learning(model, batch, ctx, optimizer_factory),
        "throughput": lambda: check_throughput(model, big, ctx, device, dtype, optimizer_factory,
                                                  compare_dtype=compare_dtype),
        "init_loss": lambda: check_init_loss(model, batch, ctx, vocab_size, at_init),
    }
    results = []
    with isolated_rng(device, seed):
        for name in CHECK_NAMES:
            if name not in wanted:
                continue
            t0 = time.perf_counter()
            try:
                res = runners[name]()
            except Exception as e:  # noqa: BLE001 - a crash inside a check is that check's failure, named
                res = CheckResult(name, False, detail=f"the check crashed: {type(e).__name__}: {e}")
            res.seconds = time.perf_counter() - t0
            results.append(res)
            log(f"preflight {name:<21} {'PASS' if res.ok else 'FAIL'} ({res.seconds:.2f} s) {res.detail}")
    release_memory(device)
    return PreflightReport(ok=all(r.ok for r in results), device=str(device), dtype=str(dtype).replace("torch.", ""),
                           torch_version=torch.__version__, checks=results)
