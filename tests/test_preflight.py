"""Preflight: a healthy model passes all nine checks; each planted defect fails its check and names the culprit
(issue 4; cases TR3, TR6, TR7 of docs/cases.md)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from train.model import MLP, DecoderLayer, LlamaForCausalLM, ModelConfig, RMSNorm
from train.optim import build_optimizer
from train.preflight import CHECK_NAMES, run_preflight

CFG = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=128, rms_norm_eps=1e-6)


def batch(b: int = 2, s: int = 33, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (b, s), generator=g)


def preflight(model, checks=None, **kw):
    kw.setdefault("vocab_size", CFG.vocab_size)
    kw.setdefault("lr", 3e-3)
    return run_preflight(model, batch(), device=torch.device("cpu"), dtype=torch.float32, checks=checks,
                         log=lambda m: None, **kw)


def result(report, name):
    return next(c for c in report.checks if c.name == name)


def build(cls=LlamaForCausalLM, cfg=CFG):
    torch.manual_seed(0)
    return cls(cfg)


def test_healthy_model_passes_all_nine():
    report = preflight(build())
    assert [c.name for c in report.checks] == CHECK_NAMES
    assert report.ok, report.table()
    assert all(c.seconds >= 0 for c in report.checks)
    assert "tokens/s" in result(report, "throughput").detail


def test_preflight_leaves_rng_and_model_untouched():
    m = build()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    preflight(m)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())


# ------------------------------------------------------------------------------------- gradient flow (TR7)

class DetachingLayer(DecoderLayer):
    def forward(self, *args):
        x, present = super().forward(*args)
        return x.detach(), present


class DetachedBlock(LlamaForCausalLM):
    """Layer 1's output is detached: nothing upstream of it learns."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers[1] = DetachingLayer(cfg)


def test_detached_block_names_every_upstream_parameter():
    report = preflight(build(DetachedBlock), checks=["gradient_flow"])
    c = result(report, "gradient_flow")
    assert not c.ok
    named = " ".join(c.culprits)
    assert "model.embed_tokens.weight" in named or "lm_head" not in named
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight"):
        assert n in named
    assert "model.norm.weight" not in named  # downstream of the cut: still learns


class NoGradNorm(RMSNorm):
    """Forward-correct, but computed under no_grad (candle's fused rms_norm that records no backward)."""

    def forward(self, x):
        with torch.no_grad():
            return super().forward(x)


def test_tr7_norm_without_backward_is_named():
    m = build()
    old = m.model.layers[0].input_layernorm
    m.model.layers[0].input_layernorm = NoGradNorm(CFG.hidden_size, CFG.rms_norm_eps)
    m.model.layers[0].input_layernorm.load_state_dict(old.state_dict())
    x = batch()
    with torch.no_grad():
        ref = build()(x[:, :-1])[0]
    assert torch.allclose(m(x[:, :-1])[0], ref)  # forward is correct
    c = result(preflight(m, checks=["gradient_flow"]), "gradient_flow")
    assert not c.ok
    assert any(cul.startswith("model.layers.0.input_layernorm.weight: no gradient") for cul in c.culprits)
    healthy = result(preflight(build(), checks=["gradient_flow"]), "gradient_flow")
    assert healthy.ok and not healthy.culprits


def test_gradient_zeroing_hook_is_named():
    m = build()
    m.model.layers[1].mlp.up_proj.weight.register_hook(lambda g: torch.zeros_like(g))
    c = result(preflight(m, checks=["gradient_flow"]), "gradient_flow")
    assert not c.ok
    assert [x.split(":")[0] for x in c.culprits] == ["model.layers.1.mlp.up_proj.weight"]
    assert "zero gradient" in c.culprits[0]


# ------------------------------------------------------------------------------------- gradient correctness

class BadSiLU(torch.autograd.Function):
    """SiLU whose backward is half the true derivative: gradients flow, but wrong."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return 0.5 * g * (s * (1 + x * (1 - s)))


class BadMLP(MLP):
    def forward(self, x):
        return self.down_proj(BadSiLU.apply(self.gate_proj(x)) * self.up_proj(x))


class WrongGradModel(LlamaForCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        for layer in self.model.layers:
            layer.mlp = BadMLP(cfg)


def test_wrong_but_nonzero_gradients_fail_finite_differences():
    report = preflight(build(WrongGradModel), checks=["gradient_flow", "gradient_correctness"])
    assert result(report, "gradient_flow").ok  # every gradient is non-zero...
    c = result(report, "gradient_correctness")
    assert not c.ok  # ...but wrong
    assert any("gate_proj" in x for x in c.culprits)
    assert all("vs finite difference" in x for x in c.culprits)


# ------------------------------------------------------------------------------------- update flow (TR3)

def test_parameter_left_out_of_the_optimizer():
    def factory(m):
        params = [p for n, p in m.named_parameters() if "layers.1.self_attn.v_proj" not in n]
        return torch.optim.AdamW(params, lr=1e-3)

    c = result(preflight(build(), checks=["update_flow"], optimizer_factory=factory), "update_flow")
    assert not c.ok
    assert any(x.startswith("model.layers.1.self_attn.v_proj.weight: not in the optimizer") for x in c.culprits)
    assert any(x.startswith("model.layers.1.self_attn.v_proj.weight: unchanged") for x in c.culprits)


def test_tied_tensor_twice_in_the_optimizer():
    def factory(m):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch only warns about a duplicate inside one group
            return torch.optim.SGD([{"params": list(m.parameters()) + [m.lm_head.weight]}], lr=0.1)

    c = result(preflight(build(), checks=["update_flow"], optimizer_factory=factory), "update_flow")
    assert not c.ok and any("in the optimizer 2 times" in x for x in c.culprits)


def test_optimizer_built_before_a_module_swap():
    def factory(m):
        opt = build_optimizer(m, 1e-3, 0.1, (0.9, 0.95))
        m.model.layers[0].mlp.up_proj = nn.Linear(CFG.hidden_size, CFG.intermediate_size, bias=False)
        return opt

    c = result(preflight(build(), checks=["update_flow"], optimizer_factory=factory), "update_flow")
    assert not c.ok
    assert any("model.layers.0.mlp.up_proj.weight: not in the optimizer" in x for x in c.culprits)
    assert any("not a parameter of the model" in x for x in c.culprits)


def test_misshaped_optimizer_state():
    def factory(m):
        opt = build_optimizer(m, 1e-3, 0.1, (0.9, 0.95))
        w = m.model.layers[0].self_attn.o_proj.weight
        opt.state[w] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(w.shape[0], w.shape[1] // 2),
                        "exp_avg_sq": torch.zeros(w.shape[0], w.shape[1] // 2)}
        return opt

    c = result(preflight(build(), checks=["update_flow"], optimizer_factory=factory), "update_flow")
    assert not c.ok
    assert any("o_proj" in x and ("exp_avg" in x or "step() failed" in x) for x in c.culprits)


# ------------------------------------------------------------------------------------- layout invariance

class StrideBug(LlamaForCausalLM):
    """Reads input_ids as if they were contiguous (as_strided with contiguous strides)."""

    def forward(self, input_ids, *a, **kw):
        b, s = input_ids.shape
        input_ids = torch.as_strided(input_ids, (b, s), (s, 1))
        return super().forward(input_ids, *a, **kw)


class LeakyNorm(RMSNorm):
    def forward(self, x):
        return super().forward(x - x.mean(0, keepdim=True) * 0.5)


class BatchLeak(LlamaForCausalLM):
    """A layer that normalises across the batch: a sample's logits depend on the others."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.norm = LeakyNorm(cfg.hidden_size, cfg.rms_norm_eps)


def test_stride_bug_is_caught():
    c = result(preflight(build(StrideBug), checks=["layout_invariance"]), "layout_invariance")
    assert not c.ok and any("non-contiguous input changes the logits" in x for x in c.culprits)
    assert any("model.embed_tokens" in x for x in c.culprits)


def test_batch_dependence_is_caught():
    c = result(preflight(build(BatchLeak), checks=["layout_invariance"]), "layout_invariance")
    assert not c.ok
    assert any("depend on the rest of its batch" in x and "model.norm" in x for x in c.culprits)


class _StrideBlindSiLUFn(torch.autograd.Function):
    """SiLU whose backward reads grad_output through as_strided with contiguous strides (wrong when it is not)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        g = torch.as_strided(g, g.shape, torch.empty(g.shape).stride())
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


class StrideBlindSiLU(nn.Module):
    def forward(self, x):
        return _StrideBlindSiLUFn.apply(x)


class StrideBlindMLP(MLP):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.act = StrideBlindSiLU()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class BackwardStrideBug(LlamaForCausalLM):
    """Layer 1's MLP activation has a backward that is right only for a contiguous upstream gradient."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers[1].mlp = StrideBlindMLP(cfg)


def test_backward_stride_bug_is_caught_and_named():
    c = result(preflight(build(BackwardStrideBug), checks=["layout_invariance"]), "layout_invariance")
    assert not c.ok
    assert c.culprits == ["model.layers.1.mlp.act"], c.culprits
    assert "model.layers.1.mlp.act" in c.detail


def test_backward_layout_of_the_healthy_model_passes():
    c = result(preflight(build(), checks=["layout_invariance"]), "layout_invariance")
    assert c.ok and c.culprits == [], c.detail
    assert "backward" in c.detail


# ------------------------------------------------------------------------------------- precision (TR6)

class Fp16OverflowNorm(RMSNorm):
    """Computes the mean of squares in the input dtype: x=300 in fp16 overflows to inf → zeros."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class OverflowModel(LlamaForCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.norm = Fp16OverflowNorm(cfg.hidden_size, cfg.rms_norm_eps)


def test_fp16_overflowing_norm_is_named():
    c = result(preflight(build(OverflowModel), checks=["precision"]), "precision")
    assert not c.ok
    assert [x.split(":")[0] for x in c.culprits] == ["model.norm"]
    healthy = result(preflight(build(), checks=["precision"]), "precision")
    assert healthy.ok and "5 norm layers" in healthy.detail


# ------------------------------------------------------------------------------------- determinism

class NoisyMLP(MLP):
    def forward(self, x):
        return super().forward(x) + torch.rand_like(x) * 1e-3


class NoisyModel(LlamaForCausalLM):
    """A non-deterministic op: unseeded noise in the forward pass."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers[1].mlp = NoisyMLP(cfg)


def test_nondeterministic_op_is_caught():
    c = result(preflight(build(NoisyModel), checks=["determinism"]), "determinism")
    assert not c.ok
    assert "model.layers.1.mlp" in c.culprits[0]
    assert result(preflight(build(), checks=["determinism"]), "determinism").ok


# ------------------------------------------------------------------------------------- learning, init loss

def test_learning_fails_with_a_frozen_optimizer():
    c = result(preflight(build(), checks=["learning"], optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.0)),
               "learning")
    assert not c.ok and "need ≤" in c.detail


def test_init_loss_refuses_a_too_large_init():
    cfg = ModelConfig(**{**CFG.to_dict(), "initializer_range": 1.0})
    c = result(preflight(build(cfg=cfg), checks=["init_loss"]), "init_loss")
    assert not c.ok and "init scale too big" in c.culprits[0]
    ok = result(preflight(build(), checks=["init_loss"]), "init_loss")
    assert ok.ok and f"{math.log(512):.3f}" in ok.detail


def test_init_loss_skipped_when_not_at_init():
    c = result(preflight(build(), checks=["init_loss"], at_init=False), "init_loss")
    assert c.ok and c.detail.startswith("skipped")


def test_crashing_check_is_a_failure_not_a_traceback():
    def factory(m):
        raise RuntimeError("boom")

    c = result(preflight(build(), checks=["learning"], optimizer_factory=factory), "learning")
    assert not c.ok and "RuntimeError: boom" in c.detail


@pytest.mark.parametrize("layer_cls", [DecoderLayer])
def test_report_json_shape(layer_cls, tmp_path):
    import json

    report = preflight(build(), checks=["gradient_flow", "init_loss"])
    d = json.loads(json.dumps(report.to_dict()))
    assert set(d) == {"ok", "device", "dtype", "torch_version", "checks"}
    assert set(d["checks"][0]) == {"name", "ok", "seconds", "detail", "culprits", "values"}


def test_preflight_cli_writes_report(tmp_path, session_cache):
    import json

    from tests.conftest import fast_overrides
    from train.preflight.__main__ import main

    args = ["--config", "tiny", "--name", "pf-cli"]
    for o in fast_overrides(tmp_path, session_cache):
        args += ["--set", o]
    assert main(args) == 0
    report = json.loads((tmp_path / "runs" / "pf-cli" / "preflight.json").read_text())
    assert report["ok"] is True and [c["name"] for c in report["checks"]] == CHECK_NAMES
