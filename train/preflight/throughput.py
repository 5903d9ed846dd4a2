"""``throughput``: tokens/s and, on CUDA, MFU of a training step at the run's micro-batch.

The steps run on the run's own model, not on a copy, so that preflight never holds a second full model, its
gradients and its activations beside the real one (an out-of-memory risk on a GPU at the full micro-batch): the
weights are saved to host memory first and copied back bit for bit afterwards, the gradients are reset to what
they were, and the throwaway optimizer is dropped (the runner then empties the CUDA cache).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from train.device import peak_flops
from train.model import LlamaForCausalLM
from train.preflight.common import OptimizerFactory, batch_loss
from train.preflight.report import CheckResult

MFU_WARN = 0.20


def check_throughput(model: nn.Module, big_batch: torch.Tensor, ctx, device: torch.device, dtype: torch.dtype,
                     optimizer_factory: OptimizerFactory, iters: int = 2) -> CheckResult:
    """Time ``iters`` optimizer steps (after one warm-up step) of ``model`` on ``big_batch`` (int64 ``[b, seq+1]``).

    ``model``'s parameters, buffers, gradients and train/eval mode are restored exactly before returning, even when
    a step raises."""
    was_training = model.training
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict(keep_vars=True).items()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    model.train()
    opts: list[torch.optim.Optimizer] = []
    try:
        opt = optimizer_factory(model)
        opts.append(opt)

        def step():
            opt.zero_grad(set_to_none=True)
            batch_loss(model, big_batch, ctx).backward()
            opt.step()

        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = (time.perf_counter() - t0) / iters
    finally:
        opts.clear()  # the throwaway optimizer's state goes now, not at the next collection
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                v.copy_(saved[k])
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        model.train(was_training)
    tokens = big_batch.shape[0] * (big_batch.shape[1] - 1)
    tps = tokens / dt
    detail = f"{tps:,.0f} tokens/s ({tokens} tokens a micro-batch, {dt * 1000:.0f} ms a step)"
    peak = peak_flops(device, dtype)
    if peak and isinstance(model, LlamaForCausalLM):
        mfu = model.flops_per_token(big_batch.shape[1] - 1) * tps / peak
        detail += f", MFU {mfu:.1%}"
        if mfu < MFU_WARN:
            detail += f" — WARNING: below {MFU_WARN:.0%} (the report's backward ran at 3 %; try train.compile=true)"
    return CheckResult("throughput", True, detail=detail)
