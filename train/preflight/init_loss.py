"""``init_loss``: the step-0 loss on a real batch lies within 1 nat of ln(vocab_size)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from train.preflight.common import batch_loss
from train.preflight.report import CheckResult


def check_init_loss(model: nn.Module, batch: torch.Tensor, ctx, vocab_size: int, at_init: bool) -> CheckResult:
    if not at_init:
        return CheckResult("init_loss", True, detail="skipped: the model is not at initialisation (resume/init-from)")
    with torch.no_grad():
        loss = float(batch_loss(copy.deepcopy(model).eval(), batch, ctx))
    ln_v = math.log(vocab_size)
    ok = math.isfinite(loss) and abs(loss - ln_v) <= 1.0
    detail = f"step-0 loss {loss:.3f} vs ln(V) = {ln_v:.3f} (need within 1 nat)"
    culprits = [] if ok else ["initial logits are too large (init scale too big: the report's twin sat at 12.60)"
                              if loss > ln_v else "initial loss is suspiciously low (labels leaking into inputs?)"]
    return CheckResult("init_loss", ok, detail=detail, culprits=culprits)
