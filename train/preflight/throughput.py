"""``throughput``: tokens/s and, on CUDA, MFU of a training step at the run's micro-batch; asked to, also the
tokens/s of the same step under a second compute dtype, timed interleaved with the first (``train.dtype = "auto"``
on a CPU with native bfloat16 decides by that gain).

The steps run on the run's own model, not on a copy, so that preflight never holds a second full model, its
gradients and its activations beside the real one (an out-of-memory risk on a GPU at the full micro-batch): the
weights are saved to host memory first and copied back bit for bit afterwards, the gradients are reset to what
they were, and the throwaway optimizer is dropped (the runner then empties the CUDA cache).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from train.device import autocast_ctx, peak_flops
from train.model import LlamaForCausalLM
from train.preflight.common import OptimizerFactory, batch_loss
from train.preflight.report import CheckResult

MFU_WARN = 0.20
COMPARE_PAIRS = 3  # interleaved pairs of steps (ABBA order) when a second dtype is compared
COMPARE_ROWS = 2  # windows of the micro-batch those steps take (per-token costs, a quarter of the cpu preset's time)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@contextlib.contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _compare(step, ctx, cmp_ctx, device: torch.device) -> tuple[float, float]:
    """(seconds of ``step(ctx)``, of ``step(cmp_ctx)``): a warm-up step of each, then :data:`COMPARE_PAIRS` of
    each interleaved A B B A …, the fastest of each kept. On CPU the steps run on one intra-op thread and are timed
    in process CPU time: on a machine shared with other jobs, wall time and multi-threaded CPU time (threads
    spinning at barriers while a sibling waits for a core) moved a 1.3× gain to 0.8-0.9× here, one thread's CPU
    time by a few percent. On CUDA: wall time after a synchronize."""
    cpu = device.type == "cpu"
    clock = time.process_time if cpu else time.perf_counter

    def timed(c) -> float:
        t0 = clock()
        step(c)
        if not cpu:
            torch.cuda.synchronize(device)
        return clock() - t0

    times: tuple[list[float], list[float]] = ([], [])
    with _one_thread() if cpu else contextlib.nullcontext():
        step(ctx)
        step(cmp_ctx)
        for i in range(COMPARE_PAIRS):
            for c, k in [(ctx, 0), (cmp_ctx, 1)][:: 1 if i % 2 == 0 else -1]:
                times[k].append(timed(c))
    return min(times[0]), min(times[1])


def check_throughput(model: nn.Module, big_batch: torch.Tensor, ctx, device: torch.device, dtype: torch.dtype,
                     optimizer_factory: OptimizerFactory, iters: int = 2,
                     compare_dtype: torch.dtype | None = None) -> CheckResult:
    """Time ``iters`` optimizer steps (after one warm-up step) of ``model`` on ``big_batch`` (int64 ``[b, seq+1]``).

    With ``compare_dtype`` (e.g. bfloat16 on a float32 run), the step is then also timed under that dtype's
    autocast against the run's (:func:`_compare`); the result's ``values`` hold ``tokens_per_s`` and, when
    compared, ``<dtype>_gain`` (its speed over the run dtype's).

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

        def step(c=ctx, batch=big_batch):
            opt.zero_grad(set_to_none=True)
            batch_loss(model, batch, c).backward()
            opt.step()

        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cmp_dt = None
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = (time.perf_counter() - t0) / iters
        if compare_dtype is not None:
            cmp_dt = _compare(lambda c: step(c, big_batch[:COMPARE_ROWS]), ctx, autocast_ctx(device, compare_dtype),
                              device)
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
    values = {"tokens_per_s": tps}
    if cmp_dt is not None:
        name, gain = _name(compare_dtype), cmp_dt[0] / cmp_dt[1]
        values[f"{name}_gain"] = gain
        detail += (f"; {name} {gain:.2f}× {_name(dtype)}'s speed ({cmp_dt[1] * 1000:.0f} against "
                   f"{cmp_dt[0] * 1000:.0f} ms{' of CPU time' if device.type == 'cpu' else ''} a step, "
                   f"fastest of {COMPARE_PAIRS} interleaved each{', one thread' if device.type == 'cpu' else ''})")
    peak = peak_flops(device, dtype)
    if peak and isinstance(model, LlamaForCausalLM):
        mfu = model.flops_per_token(big_batch.shape[1] - 1) * tps / peak
        detail += f", MFU {mfu:.1%}"
        if mfu < MFU_WARN:
            detail += f" — WARNING: below {MFU_WARN:.0%} (the report's backward ran at 3 %; try train.compile=true)"
    return CheckResult("throughput", True, detail=detail, values=values)
