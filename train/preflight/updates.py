"""``update_flow`` (every trainable tensor in the optimizer once, moved by a step, state of its shape) and
``learning`` (30 steps on one batch halve its loss)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from train.preflight.common import OptimizerFactory, batch_loss, trainable
from train.preflight.report import CheckResult


def check_update_flow(model: nn.Module, batch: torch.Tensor, ctx, optimizer_factory: OptimizerFactory) -> CheckResult:
    m = copy.deepcopy(model).train()
    culprits = []
    try:
        opt = optimizer_factory(m)
    except Exception as e:  # noqa: BLE001 - report any factory failure as the check's failure
        return CheckResult("update_flow", False, detail=f"building the optimizer failed: {e}", culprits=[])
    names = {id(p): n for n, p in m.named_parameters()}
    counts: dict[int, int] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            counts[id(p)] = counts.get(id(p), 0) + 1
    for n, p in trainable(m):
        c = counts.get(id(p), 0)
        if c == 0:
            culprits.append(f"{n}: not in the optimizer (it will never be updated)")
        elif c > 1:
            culprits.append(f"{n}: in the optimizer {c} times (one step moves it {c}×)")
    for pid in counts:
        if pid not in names:
            culprits.append("the optimizer holds a tensor that is not a parameter of the model (stale copy?)")
    before = {n: p.detach().clone() for n, p in trainable(m)}
    opt.zero_grad(set_to_none=True)
    batch_loss(m, batch, ctx).backward()
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - a mis-shaped state raises inside torch; name it
        culprits.append(f"optimizer.step() failed: {type(e).__name__}: {str(e).splitlines()[0]}")
    for n, p in trainable(m):
        if n in before and torch.equal(before[n], p.detach()):
            culprits.append(f"{n}: unchanged after an optimizer step")
    params_by_id = {id(p): (n, p) for n, p in m.named_parameters()}
    for p, st in opt.state.items():
        n, param = params_by_id.get(id(p), ("<not a model parameter>", p))
        for key, val in st.items():
            if isinstance(val, torch.Tensor) and val.dim() > 0 and tuple(val.shape) != tuple(param.shape):
                culprits.append(f"{n}: optimizer state {key!r} has shape {tuple(val.shape)}, the parameter "
                                f"{tuple(param.shape)}")
    ran = "+".join(sorted({str(g.get("optimizer", type(opt).__name__)) for g in opt.param_groups}))
    detail = (f"every trainable tensor is in the optimizer ({ran}) once, moves after a step and has state of its shape"
              if not culprits else f"{len(culprits)} problems ({ran})")
    return CheckResult("update_flow", not culprits, detail=detail, culprits=culprits)




def check_learning(model: nn.Module, batch: torch.Tensor, ctx, optimizer_factory: OptimizerFactory,
                   steps: int = 30) -> CheckResult:
    m = copy.deepcopy(model).train()
    opt = optimizer_factory(m)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = batch_loss(m, batch, ctx)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        final = float(batch_loss(m, batch, ctx))
    ok = math.isfinite(final) and final <= 0.5 * losses[0]
    detail = f"loss {losses[0]:.3f} → {final:.3f} in {steps} steps on one batch (need ≤ {0.5 * losses[0]:.3f})"
    return CheckResult("learning", ok, detail=detail,
                       culprits=[] if ok else ["the model does not fit a single batch: check the learning rate, "
                                               "the optimizer and the loss"])
