"""``gradient_flow`` (every trainable tensor gets a finite, non-zero gradient) and ``gradient_correctness``
(float64 central differences against autograd on a tiny copy of the architecture)."""

from __future__ import annotations

import torch
from torch import nn

from train.model import ModelConfig
from train.preflight.common import ModelFactory, batch_loss, trainable
from train.preflight.report import CheckResult

GRAD_NORM_MIN = 1e-7

def check_gradient_flow(model: nn.Module, batch: torch.Tensor, ctx) -> CheckResult:
    # on the model itself, not a copy: a deep copy would drop tensor hooks (a leftover gradient-zeroing hook is
    # one of the defects this must catch). Only .grad is touched, and it is restored afterwards.
    m = model
    was_training = m.training
    saved = {n: p.grad for n, p in m.named_parameters()}
    m.train()
    m.zero_grad(set_to_none=True)
    try:
        loss = batch_loss(m, batch, ctx)
        loss.backward()
        return _gradient_report(m, loss)
    finally:
        for n, p in m.named_parameters():
            p.grad = saved.get(n)
        m.train(was_training)


def _gradient_report(m: nn.Module, loss: torch.Tensor) -> CheckResult:
    culprits = []
    for name, p in trainable(m):
        if p.grad is None:
            culprits.append(f"{name}: no gradient (not connected to the loss)")
            continue
        g = p.grad.float()
        if not torch.isfinite(g).all():
            culprits.append(f"{name}: non-finite gradient")
        elif float(g.norm()) <= GRAD_NORM_MIN:
            culprits.append(f"{name}: zero gradient (norm {float(g.norm()):.2e} ≤ {GRAD_NORM_MIN:g})")
    n = len(trainable(m))
    detail = (f"{n} of {n} trainable tensors get finite, non-zero gradients (loss {float(loss.detach()):.3f})" if not culprits
              else f"{len(culprits)} of {n} trainable tensors get no usable gradient")
    return CheckResult("gradient_flow", not culprits, detail=detail, culprits=culprits)


def tiny_config(cfg: ModelConfig) -> ModelConfig:
    """A tiny copy of ``cfg``'s architecture (same head ratio, rope theta, eps, tying) for finite differences."""
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    kv = 2 if cfg.num_key_value_heads >= 2 else 1
    heads = kv * rep
    return ModelConfig(vocab_size=48, hidden_size=heads * 4, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=24, max_position_embeddings=16,
                       rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                       tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=0.2)


def check_gradient_correctness(model_factory: ModelFactory, cfg: ModelConfig, coords: int = 3,
                               eps: float = 1e-6, atol: float = 1e-6, rtol: float = 1e-4) -> CheckResult:
    tcfg = tiny_config(cfg)
    m = model_factory(tcfg).double().train()
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, tcfg.vocab_size, (2, 9), generator=g)
    m.zero_grad(set_to_none=True)
    loss = batch_loss(m, batch)
    loss.backward()
    culprits = []
    worst = 0.0
    checked = 0
    with torch.no_grad():
        for name, p in trainable(m):
            if p.grad is None:
                culprits.append(f"{name}: no autograd gradient in the tiny copy")
                continue
            flat, gflat = p.view(-1), p.grad.view(-1)
            for idx in torch.randint(0, flat.numel(), (coords,), generator=g).tolist():
                old = float(flat[idx])
                flat[idx] = old + eps
                lp = float(batch_loss(m, batch))
                flat[idx] = old - eps
                lm = float(batch_loss(m, batch))
                flat[idx] = old
                fd = (lp - lm) / (2 * eps)
                ag = float(gflat[idx])
                err = abs(fd - ag)
                worst = max(worst, err / (atol + rtol * abs(fd)))
                checked += 1
                if err > atol + rtol * abs(fd):
                    culprits.append(f"{name}[{idx}]: autograd {ag:.6g} vs finite difference {fd:.6g}")
                    break
    detail = (f"{checked} coordinates of {len(trainable(m))} tensors agree (worst error {worst:.2f} of tolerance)"
              if not culprits else f"{len(culprits)} tensors have wrong gradients")
    return CheckResult("gradient_correctness", not culprits, detail=detail, culprits=culprits)
