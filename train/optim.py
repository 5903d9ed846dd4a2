"""AdamW with decay only on matrices, and the warmup + cosine learning-rate schedule.

Parameter groups (case TR2): every 2-D projection weight (q, k, v, o, gate, up, down, an untied lm_head) decays;
1-D parameters (RMSNorm gains, any bias) and the token embedding (tied or not) do not. Each trainable tensor
appears once: ``named_parameters()`` yields a tied matrix once, so a tied embedding is never stepped twice (TR3).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from train.config import TrainSection


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """``[{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]`` with names kept in
    ``"names"`` for reports."""
    decay, no_decay, dn, nn_ = [], [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() >= 2 and "embed_tokens" not in name:
            decay.append(p)
            dn.append(name)
        else:
            no_decay.append(p)
            nn_.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": dn},
        {"params": no_decay, "weight_decay": 0.0, "names": nn_},
    ]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] | list[float],
                    device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; fused on CUDA (one kernel for all parameters)."""
    groups = param_groups(model, weight_decay)
    kwargs = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=1e-8, **kwargs)


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup from lr/warmup to lr over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps`` (and ``min_lr`` after)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    span = max(max_steps - warmup_steps, 1)
    progress = (step - warmup_steps) / span
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer_for(model: nn.Module, train: TrainSection, device_type: str = "cpu") -> torch.optim.AdamW:
    """:func:`build_optimizer` with the learning rate, weight decay and betas of a config's ``[train]`` section
    (the one owner of their defaults)."""
    return build_optimizer(model, train.lr, train.weight_decay, train.betas, device_type)
