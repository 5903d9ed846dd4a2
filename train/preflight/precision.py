"""``precision``: the loss under the training dtype and bf16 autocast agrees with float32, and every norm layer is
finite and correct on fp16 input of 300 and small bf16 input (case TR6)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from train.device import autocast_ctx
from train.preflight.common import batch_loss, trainable
from train.preflight.report import CheckResult

PRECISION_TOL = 0.05  # nats: |loss(reduced dtype) - loss(fp32)|

def _norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, mod) for n, mod in model.named_modules()
            if "norm" in type(mod).__name__.lower() and any(True for _ in mod.parameters(recurse=False))]


def check_precision(model: nn.Module, batch: torch.Tensor, device: torch.device, dtype: torch.dtype) -> CheckResult:
    culprits = []
    m = copy.deepcopy(model).train()
    loss32 = batch_loss(m, batch)
    details = []
    lowp = {torch.bfloat16} | ({dtype} if dtype != torch.float32 else set())
    for dt in sorted(lowp, key=str):
        if dt == torch.float16 and device.type == "cpu":
            continue
        mm = copy.deepcopy(model).train()
        loss = batch_loss(mm, batch, autocast_ctx(device, dt))
        loss.backward()
        bad_grads = [n for n, p in trainable(mm) if p.grad is not None and not torch.isfinite(p.grad).all()]
        diff = abs(float(loss.detach()) - float(loss32.detach()))
        details.append(f"{str(dt).replace('torch.', '')} loss {float(loss.detach()):.4f} vs fp32 {float(loss32.detach()):.4f}")
        if not math.isfinite(float(loss.detach())):
            culprits.append(f"{dt}: non-finite loss")
        elif diff > PRECISION_TOL:
            culprits.append(f"{dt}: loss differs from fp32 by {diff:.4f} nats (> {PRECISION_TOL})")
        culprits += [f"{n}: non-finite gradient under {dt}" for n in bad_grads]
    with torch.no_grad():
        for name, mod in _norm_modules(model):
            width = next(mod.parameters()).shape[-1]
            norm = copy.deepcopy(mod).to(device)
            for in_dtype, x in ((torch.float16, torch.full((1, width), 300.0, device=device)),
                                (torch.bfloat16, torch.randn(2, 4, width, generator=torch.Generator().manual_seed(42))
                                 .to(device) * 0.058)):
                ref = copy.deepcopy(norm).float()(x.float())
                out = norm.to(in_dtype)(x.to(in_dtype)).float()
                norm.float()
                tol = 2e-2
                if not torch.isfinite(out).all():
                    culprits.append(f"{name}: non-finite output on {in_dtype} input (reduce in float32)")
                elif not torch.allclose(out, ref, atol=tol, rtol=tol):
                    culprits.append(f"{name}: {in_dtype} output off by {float((out - ref).abs().max()):.3g} from fp32 "
                                    f"(overflow/underflow: reduce in float32)")
    details.append(f"{len(_norm_modules(model))} norm layers checked on fp16 and bf16 input")
    return CheckResult("precision", not culprits, detail="; ".join(details), culprits=culprits)
