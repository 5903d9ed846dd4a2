"""What the preflight checks share: the loss of a batch, the trainable tensors, per-module output capture."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from train import windows as W
from train.model import ModelConfig, causal_lm_loss

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
ModelFactory = Callable[[ModelConfig], nn.Module]


def batch_loss(model: nn.Module, batch: torch.Tensor, ctx=None) -> torch.Tensor:
    x, y = W.inputs(batch), W.labels(batch)
    with ctx if ctx is not None else contextlib.nullcontext():
        logits, _ = model(x)
    return causal_lm_loss(logits, y, reduction="mean")


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def capture(model: nn.Module, fn: Callable[[], object]) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """Run ``fn`` recording every named module's first tensor output, in call order."""
    records: list[tuple[str, torch.Tensor]] = []
    hooks = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def hook(_m, _inp, out, name=name):
            t = out[0] if isinstance(out, tuple | list) else out
            if isinstance(t, torch.Tensor):
                records.append((name, t.detach().float().clone()))

        hooks.append(mod.register_forward_hook(hook))
    try:
        result = fn()
    finally:
        for h in hooks:
            h.remove()
    return result, records


def first_divergence(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]], atol: float,
                      select: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> str | None:
    """Name of the first module (in call order) whose output differs between two recorded runs."""
    for (na, ta), (nb, tb) in zip(a, b):
        if na != nb:
            return f"{na} (the two runs called different modules: {na} vs {nb})"
        sa, sb = select(ta), select(tb)
        if sa.shape != sb.shape:
            return f"{na} (output shapes differ: {tuple(sa.shape)} vs {tuple(sb.shape)})"
        if not torch.allclose(sa, sb, atol=atol, rtol=atol, equal_nan=True):
            return f"{na} (max |Δ| {float((sa - sb).abs().max()):.3g})"
    return None
