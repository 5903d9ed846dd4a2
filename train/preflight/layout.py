"""``layout_invariance``: a strided batch gives the contiguous batch's logits, a sample's logits do not depend on
the rest of its batch, and every module's backward is independent of the strides of its inputs and upstream
gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from train import windows as W
from train.preflight.common import capture, first_divergence
from train.preflight.report import CheckResult

BACKWARD_RTOL = 1e-9  # float64: a different summation order moves a value by ~1e-16 relative, a stride bug by O(1)


def _map(fn: Callable, tree):
    """``fn`` applied to every tensor in nested tuples/lists/dicts; everything else is returned as it is."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple | list):
        return type(tree)(_map(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return tree


def _tensors(tree) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map(out.append, tree)
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in a non-contiguous layout: the last two dimensions column-major, or (when that is
    still contiguous) every other element of a buffer twice as wide."""
    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if t.dim() == 0 or t.numel() <= 1:
        return t
    buf = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    buf[..., ::2] = t
    return buf[..., ::2]


def _forward_backward(mod: nn.Module, args, kwargs, grads: list[torch.Tensor], layout: Callable):
    """Outputs, input gradients and own-parameter gradients of ``mod`` with inputs and upstream gradients in
    ``layout`` (``Tensor.contiguous`` or :func:`_strided`)."""
    leaves: list[torch.Tensor] = []

    def prep(t: torch.Tensor) -> torch.Tensor:
        t = layout(t.detach().clone())
        if t.is_floating_point():
            t.requires_grad_(True)
            leaves.append(t)
        return t

    args, kwargs = _map(prep, (args, kwargs))
    outs = _tensors(mod(*args, **kwargs))
    params = [p for p in mod.parameters(recurse=False) if p.requires_grad]
    pairs = [(o, layout(g)) for o, g in zip(outs, grads) if o.requires_grad]
    wrt = leaves + params
    if not (pairs and wrt):
        return [o.detach() for o in outs], []
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    return [o.detach() for o in outs], list(got)


def _differs(a: list, b: list) -> bool:
    """Whether two runs' tensors (or ``None`` gradients) differ: shape, presence, or beyond the tolerance."""
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return True
        if x is None:
            continue
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return True
            continue
        rtol = BACKWARD_RTOL if x.dtype == torch.float64 else 4 * torch.finfo(x.dtype).eps  # a float32 cast
        scale = float(x.abs().max()) if x.numel() else 0.0
        if x.shape != y.shape or not torch.allclose(x, y, rtol=rtol, atol=rtol * scale, equal_nan=True):
            return True
    return False


def backward_layout_culprits(model: nn.Module, x: torch.Tensor) -> tuple[list[str], int]:
    """Modules whose forward or backward depends on memory layout, and how many modules were tried.

    On a float64 copy of ``model`` (no autocast) each module's inputs are recorded during one forward of ``x``
    (int64 ``[batch, seq]``; the check passes 2 × 32 tokens). Each module (leaf and composite) then runs forward + backward twice: contiguous
    inputs with a contiguous upstream gradient, then the same values in non-contiguous layouts (:func:`_strided`)
    with a non-contiguous upstream gradient. Outputs, input gradients and the module's own parameter gradients
    must agree to :data:`BACKWARD_RTOL` relative. Rules out a backward (a custom ``autograd.Function``, a kernel)
    that reads grad_output or a saved input through ``view``/``as_strided`` assuming contiguous strides. Only the
    innermost failing modules are returned, by qualified name (``<root>`` for the model itself).
    """
    m = copy.deepcopy(model).double().eval()
    calls: dict[str, tuple] = {}
    shapes: dict[str, list[tuple[torch.Size, torch.dtype]]] = {}
    hooks = []
    for name, mod in m.named_modules():

        def pre(_m, args, kwargs, name=name):
            if name not in calls:
                calls[name] = _map(lambda t: t.detach().clone(), (args, kwargs))

        def post(_m, _args, out, name=name):  # the upstream gradients' shapes, without another forward
            if name not in shapes:
                shapes[name] = [(t.shape, t.dtype) for t in _tensors(out)]

        hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(mod.register_forward_hook(post))
    try:
        with torch.no_grad():
            m(x)
    finally:
        for h in hooks:
            h.remove()
    gen = torch.Generator(device=x.device).manual_seed(0)
    failing = []
    for name, mod in m.named_modules():
        if name not in calls:
            continue
        args, kwargs = calls[name]
        grads = [torch.randn(shape, dtype=dt, device=x.device, generator=gen) if dt.is_floating_point else None
                 for shape, dt in shapes.get(name, [])]
        oa, ga = _forward_backward(mod, args, kwargs, grads, torch.Tensor.contiguous)
        try:
            ob, gb = _forward_backward(mod, args, kwargs, grads, _strided)
            bad = _differs(oa, ob) or _differs(ga, gb)
        except RuntimeError:  # e.g. a .view that a non-contiguous tensor cannot take: layout-dependent too
            bad = True
        if bad:
            failing.append(name or "<root>")
    inner = [n for n in failing
             if not any(o != n and (n == "<root>" or o.startswith(n + ".")) for o in failing)]
    return inner, len(calls)


def check_layout_invariance(model: nn.Module, batch: torch.Tensor, ctx, atol: float) -> CheckResult:
    m = copy.deepcopy(model).eval()
    x = W.inputs(batch).contiguous()
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
    bad, tried = backward_layout_culprits(model, x[:2, :32])
    culprits += bad
    details.append(f"contiguous vs strided max |Δ| {d1:.2e}, alone vs in batch max |Δ| {d2:.2e} (tol {atol:g})")
    details.append(f"forward+backward of {tried} modules with non-contiguous inputs and upstream gradients: "
                   + (f"layout-dependent in {', '.join(bad)}" if bad else f"all agree to {BACKWARD_RTOL:g}"))
    return CheckResult("layout_invariance", not culprits, detail="; ".join(details), culprits=culprits)
