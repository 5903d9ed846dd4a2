"""``layout_invariance``: a strided batch gives the contiguous batch's logits, a sample's logits do not depend on
the rest of its batch, and every module's backward is independent of the strides of its inputs and upstream
gradients."""

from __future__ import annotations

import copy

import torch
from torch import nn

from train.preflight.common import capture, first_divergence
from train.preflight.report import CheckResult


def check_layout_invariance(model: nn.Module, batch: torch.Tensor, ctx, atol: float) -> CheckResult:
    m = copy.deepcopy(model).eval()
    x = batch[:, :-1].contiguous()
    b, s = x.shape
    wide = torch.zeros(s, 2 * b, dtype=x.dtype, device=x.device)
    wide[:, ::2] = x.t()
    view = wide[:, ::2].t()
    assert torch.equal(view, x) and not view.is_contiguous()
    culprits = []
    details = []
    with torch.no_grad(), ctx:
        (la, _), ra = capture(m, lambda: m(x))
        (lb, _), rb = capture(m, lambda: m(view))
        d1 = float((la - lb).abs().max())
        if not torch.allclose(la, lb, atol=atol, rtol=atol):
            culprits.append("non-contiguous input changes the logits; first divergent module: "
                            + str(first_divergence(ra, rb, atol)))
        (l0, _), r0 = capture(m, lambda: m(x[:1]))
        d2 = float((la[:1] - l0).abs().max())
        if not torch.allclose(la[:1], l0, atol=atol, rtol=atol):
            culprits.append("a sample's logits depend on the rest of its batch; first divergent module: "
                            + str(first_divergence(ra, r0, atol, select=lambda t: t[:1])))
    details.append(f"contiguous vs strided max |Δ| {d1:.2e}, alone vs in batch max |Δ| {d2:.2e} (tol {atol:g})")
    return CheckResult("layout_invariance", not culprits, detail="; ".join(details), culprits=culprits)
