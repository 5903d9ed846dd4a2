"""``determinism``: the same batch twice gives the same loss and gradients (bit for bit on CPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from train.preflight.common import batch_loss, capture, first_divergence, trainable
from train.preflight.report import CheckResult


def check_determinism(model: nn.Module, batch: torch.Tensor, ctx, device: torch.device) -> CheckResult:
    m = copy.deepcopy(model).train()
    runs = []
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        loss, rec = capture(m, lambda: batch_loss(m, batch, ctx))
        loss.backward()
        runs.append((float(loss.detach()), {n: p.grad.detach().clone() for n, p in trainable(m) if p.grad is not None}, rec))
    (l1, g1, r1), (l2, g2, r2) = runs
    exact = device.type == "cpu"
    tol = 0.0 if exact else 1e-5
    culprits = []
    if (l1 != l2) if exact else abs(l1 - l2) > tol * max(1.0, abs(l1)):
        culprits.append(f"loss {l1!r} then {l2!r}; first divergent module: {first_divergence(r1, r2, 0.0)}")
    for n in g1:
        a, b = g1[n], g2.get(n)
        if b is None or (not torch.equal(a, b) if exact else
                         float((a - b).abs().max()) > tol * max(1.0, float(a.abs().max()))):
            culprits.append(f"{n}: gradient differs between two identical passes")
    detail = (f"two passes agree {'bit for bit' if exact else f'within {tol:g}'} (loss {l1:.6f})" if not culprits
              else "two identical passes disagree")
    return CheckResult("determinism", not culprits, detail=detail, culprits=culprits)
