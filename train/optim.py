"""The optimizer and the learning-rate schedule: one owner for both (``train.optimizer``, ``train.schedule``).

Optimizers (``train.optimizer``):

* ``"adamw"`` — :class:`torch.optim.AdamW` with decay only on matrices. Parameter groups (case TR2): every 2-D
  projection weight (q, k, v, o, gate, up, down, an untied lm_head) decays; 1-D parameters (RMSNorm gains, any bias)
  and the token embedding (tied or not) do not.
* ``"muon"`` — :class:`torch.optim.Muon` (torch ≥ 2.9; Jordan et al., "Muon: An optimizer for hidden layers",
  2024; Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982) on the 2-D hidden matrices of the decoder
  layers (q, k, v, o, gate, up, down), AdamW on the rest (token embedding, an untied head, norms), as modded-nanogpt
  does. Muon runs with ``adjust_lr_fn="match_rms_adamw"``: each orthogonalised update is scaled by
  ``0.2·sqrt(max(rows, cols))`` so its RMS matches a typical AdamW update (Moonshot's rule), which lets **one**
  ``train.lr`` (and one schedule) drive both halves. Decoupled weight decay ``train.weight_decay`` applies to the
  Muon matrices as it does to AdamW's.

torch's Muon runs its Newton–Schulz iteration in bfloat16 (Keller Jordan's choice for GPUs). A CPU without native
bfloat16 (AVX2 only: AMD Zen 3, older Xeons) emulates those matmuls, which made Muon half of the ``cpu`` preset's
step there; :class:`Muon` runs the iteration in float32 on such a CPU and is torch's own step everywhere else
(:func:`newton_schulz_dtype`).

Each trainable tensor appears once: ``named_parameters()`` yields a tied matrix once, so a tied embedding is never
stepped twice (TR3).

Schedules (``train.schedule``, :func:`lr_at`): a linear warmup over ``warmup_steps``, then ``"cosine"`` (to
``min_lr``), ``"linear"`` (straight to ``min_lr``; "Straight to Zero", arXiv 2502.15938, with ``min_lr = 0``) or
``"wsd"`` (warmup–stable–decay, arXiv 2405.18392: ``lr`` held, then a linear cooldown to ``min_lr`` over the last
``cooldown_frac`` of ``max_steps``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from train.config import OPTIMIZERS, SCHEDULES, TrainSection
from train.device import native_cpu_bf16

# The decoder-layer projections Muon owns (train/model.py names them so); anything else stays on AdamW.
MUON_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether parameter ``name`` (a 2-D decoder projection weight) is stepped by Muon under ``"muon"``."""
    parts = name.split(".")
    return p.dim() == 2 and len(parts) >= 2 and parts[-2] in MUON_MATRICES


def newton_schulz_dtype(device_type: str) -> torch.dtype:
    """The dtype of Muon's Newton–Schulz matmuls on ``device_type``: bfloat16 (torch's, Keller Jordan's) on CUDA
    and on a CPU that computes it natively (:func:`train.device.native_cpu_bf16`), float32 on any other CPU, where
    bfloat16 matmuls are emulated (the ``cpu`` preset's step on an AVX2-only AMD EPYC: 1.8 s, half of it in
    Muon)."""
    return torch.bfloat16 if device_type == "cuda" or native_cpu_bf16() else torch.float32


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's orthogonalisation of the 2-D update ``g`` ([rows, cols], any float dtype) in ``dtype``: the quintic
    Newton–Schulz iteration ``X ← a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ`` after scaling ``X`` to Frobenius norm
    ≤ 1 (the wide orientation, transposed back). The same operations as ``torch.optim._muon``'s
    ``_zeropower_via_newtonschulz`` (Jordan et al. 2024, github.com/KellerJordan/Muon), whose dtype is fixed to
    bfloat16; returns a tensor of ``dtype`` and ``g``'s shape."""
    a, b, c = coefficients
    x = g.to(dtype=dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """:class:`torch.optim.Muon` whose Newton–Schulz iteration runs in ``ns_dtype`` (:func:`newton_schulz_dtype`).
    With bfloat16 it is torch's step itself; with another dtype the same update (Nesterov momentum, the
    orthogonalised update scaled by ``adjust_lr_fn``, decoupled weight decay) is computed here, with torch's
    parameter groups and state, so checkpoints move between the two. Supports ``adjust_lr_fn`` None /
    ``"original"`` (``sqrt(max(1, rows/cols))``) and ``"match_rms_adamw"`` (``0.2·sqrt(max(rows, cols))``);
    ValueError for another."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        for g in self.param_groups:
            if g["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
                raise ValueError(f"Muon: adjust_lr_fn {g['adjust_lr_fn']!r} is not supported here; expected None, "
                                 "'original' or 'match_rms_adamw'")

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16:
            return super().step(closure)
        if closure is not None:
            raise ValueError("Muon.step: a closure is not supported (compute the loss before the step)")
        self._step_in(self.ns_dtype)
        return None

    @torch.no_grad()
    def _step_in(self, dtype: torch.dtype) -> None:
        """torch's update with the Newton–Schulz iteration in ``dtype`` (in bfloat16: torch's step, bit for bit)."""
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                rows, cols = p.shape[:2]
                scale = (0.2 * math.sqrt(max(rows, cols)) if group["adjust_lr_fn"] == "match_rms_adamw"
                         else math.sqrt(max(1, rows / cols)))
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * scale)


class MuonAdamW:
    """Muon on the hidden matrices and AdamW on the rest, behind the one optimizer interface the trainer, the
    checkpoint and preflight use: ``param_groups`` (Muon's groups first, each tagged ``"optimizer"``), ``state``
    (both optimizers' per-parameter state), ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict`` (a dict
    ``{"muon": ..., "adamw": ...}``).

    State per parameter: one momentum buffer for a Muon matrix, two moments (``exp_avg``, ``exp_avg_sq``) for an AdamW
    tensor; the planner counts the same.
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        for g in muon.param_groups:
            g["optimizer"] = "muon"
        for g in adamw.param_groups:
            g["optimizer"] = "adamw"

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict:
        """Both optimizers' per-parameter state, read-only (a merged view; Muon's and AdamW's parameters are
        disjoint)."""
        return {**self.muon.state, **self.adamw.state}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step: a closure is not supported (compute the loss before the step)")
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores both halves; raises ``ValueError`` naming what was found when ``state`` is not a Muon+AdamW
        state (an AdamW-only checkpoint resumed with ``train.optimizer = "muon"``, say)."""
        if not isinstance(state, dict) or set(state) != {"muon", "adamw"}:
            raise ValueError(f"optimizer state: expected a Muon+AdamW state with keys ['adamw', 'muon'], got keys "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__} (was the "
                             f"checkpoint written with another train.optimizer?)")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] | list[float],
                    device_type: str = "cpu", optimizer: str = "adamw",
                    muon_momentum: float = 0.95) -> torch.optim.Optimizer | MuonAdamW:
    """The optimizer named ``optimizer`` (one of :data:`OPTIMIZERS`) over ``model``'s trainable parameters.

    ``"adamw"``: AdamW over :func:`param_groups`, fused on CUDA. ``"muon"``: :class:`MuonAdamW` — :class:`Muon` (Nesterov
    momentum ``muon_momentum``, 5 Newton–Schulz steps, ``adjust_lr_fn="match_rms_adamw"``) on the
    :data:`MUON_MATRICES`, AdamW (``betas``) on the rest, both at ``lr``. Raises ``ValueError`` for another name.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer: expected one of {list(OPTIMIZERS)}, got {optimizer!r}")
    kwargs = {"fused": True} if device_type == "cuda" else {}
    if optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=1e-8, **kwargs)
    hidden, hn, rest_groups = [], [], param_groups(model, weight_decay)
    muon_ids = set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in muon_ids and is_muon_matrix(name, p):
            muon_ids.add(id(p))
            hidden.append(p)
            hn.append(name)
    if not hidden:
        raise ValueError(f"train.optimizer = 'muon': the model has no 2-D {', '.join(MUON_MATRICES)} weights")
    for g in rest_groups:
        keep = [(p, n) for p, n in zip(g["params"], g["names"]) if id(p) not in muon_ids]
        g["params"], g["names"] = [p for p, _ in keep], [n for _, n in keep]
    rest_groups = [g for g in rest_groups if g["params"]]
    muon = Muon([{"params": hidden, "names": hn}], lr=lr, weight_decay=weight_decay, momentum=muon_momentum,
                nesterov=True, adjust_lr_fn="match_rms_adamw", ns_dtype=newton_schulz_dtype(device_type))
    adamw = torch.optim.AdamW(rest_groups, lr=lr, betas=tuple(betas), eps=1e-8, **kwargs)
    return MuonAdamW(muon, adamw)


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str = "cosine",
          cooldown_frac: float = 0.2) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Linear warmup from ``lr/warmup_steps`` to ``lr`` over ``warmup_steps``; then by ``schedule``: ``"cosine"`` decays
    to ``min_lr`` at ``max_steps``; ``"linear"`` falls linearly to ``min_lr`` at ``max_steps``; ``"wsd"`` holds ``lr``
    until the last ``round(cooldown_frac · max_steps)`` steps and falls linearly to ``min_lr`` over them. ``min_lr``
    from ``max_steps`` on. Raises ``ValueError`` for an unknown schedule or ``cooldown_frac`` outside [0, 1].
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"train.schedule: expected one of {list(SCHEDULES)}, got {schedule!r}")
    if not 0.0 <= cooldown_frac <= 1.0:
        raise ValueError(f"train.cooldown_frac: expected a number in [0, 1], got {cooldown_frac}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if schedule == "wsd":
        cooldown = round(cooldown_frac * max_steps)
        start = max(max_steps - cooldown, warmup_steps)
        if step < start:
            return lr
        return lr + (min_lr - lr) * (step - start) / max(max_steps - start, 1)
    span = max(max_steps - warmup_steps, 1)
    progress = (step - warmup_steps) / span
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def lr_for(step: int, train: TrainSection) -> float:
    """:func:`lr_at` with a config's ``[train]`` section's schedule (the one owner of its defaults)."""
    return lr_at(step, train.lr, train.min_lr, train.warmup_steps, train.max_steps, train.schedule,
                 train.cooldown_frac)


def build_optimizer_for(model: nn.Module, train: TrainSection, device_type: str = "cpu"):
    """:func:`build_optimizer` with the optimizer, learning rate, weight decay, betas and Muon momentum of a config's
    ``[train]`` section (the one owner of their defaults)."""
    return build_optimizer(model, train.lr, train.weight_decay, train.betas, device_type, train.optimizer,
                           train.muon_momentum)
