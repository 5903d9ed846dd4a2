"""The training step's blocked causal attention (train.model.blocked_causal_attention) and train.attention's choice
(train.components.step_module): the same attention as SDPA's, only in training mode, and taken by "auto" only on
CPU in reduced precision under compiled layers, after its numerics check."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import train.model as model_mod
from tests.conftest import fast_config
from train.components import step_module
from train.components.step_module import StepModuleBuilder
from train.config import ConfigError, TrainSection
from train.device import SDPA_TOL, attention_error
from train.model import CausalLMLoss, LlamaForCausalLM, ModelConfig, blocked_causal_attention, repeat_kv
from train.run import Trainer


def _math(q, k, v):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _qkv(t: int, heads: int = 4, kv: int = 2, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, t, 16, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(2, kv, t, 16, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(2, kv, t, 16, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def _out_and_grads(attend, q, k, v):
    for x in (q, k, v):
        x.grad = None
    rep = q.shape[1] // k.shape[1]
    out = attend(q, repeat_kv(k, rep), repeat_kv(v, rep))
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]


@pytest.mark.parametrize("t,block", [(1, 128), (5, 2), (64, 128), (128, 128), (130, 128), (97, 16)])
def test_blocked_attention_is_causal_attention_in_float64(t, block):
    """Output and q/k/v gradients (GQA: k, v repeated) equal SDPA math's to float64 rounding, whether the sequence is
    shorter than a block, a multiple of it or not."""
    q, k, v = _qkv(t)
    ref = _out_and_grads(_math, q, k, v)
    got = _out_and_grads(lambda a, b, c: blocked_causal_attention(a, b, c, block_size=block), q, k, v)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _bf16_scores(q, k, v):
    """The blocked kernel as first written: the scores' matmul in the inputs' dtype (rounded to bfloat16)."""
    t = q.shape[-2]
    scores = (q @ k.mT).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("qk_std", [1.0, 4.0])
def test_blocked_attention_in_bfloat16_is_as_close_to_float32_as_sdpa(qk_std):
    """The numerics check "auto" runs, at unit-variance q, k and at the peaked logits of a trained model: the blocked
    kernel in bf16 agrees with float32 math as well as SDPA's own CPU kernel does (its scores are a float32 matmul),
    while attention that forgets the causal mask is far outside, and so are bf16-rounded scores at large logits."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    err = attention_error(blocked_causal_attention, cpu, bf16, 2, 64, qk_std=qk_std)
    sdpa_err = attention_error(_sdpa, cpu, bf16, 2, 64, qk_std=qk_std)
    assert 0 < err <= max(step_module.BLOCKED_SLACK * sdpa_err, SDPA_TOL)
    leaky = attention_error(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), cpu, bf16, 2, 64, qk_std=qk_std)
    assert leaky > 5 * max(sdpa_err, SDPA_TOL)
    if qk_std > 1:
        assert attention_error(_bf16_scores, cpu, bf16, 2, 64, qk_std=qk_std) > step_module.BLOCKED_SLACK * sdpa_err


def test_under_autocast_the_scores_stay_float32():
    """Autocast would run the scores' matmul in bfloat16 again; the kernel turns it off there."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 2, 64, 64, generator=g) * 4 for _ in range(2))
    v = torch.randn(2, 2, 64, 64, generator=g)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = _math(qb.float(), kb.float(), vb.float())  # the same rounded inputs: only the kernel's own rounding counts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = blocked_causal_attention(qb, kb, vb)
        rounded = _bf16_scores(qb, kb, vb)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).abs().max()) < 0.5 * float((rounded.float() - ref).abs().max())


def test_float16_large_logits_stay_finite():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).half() * s for s in (30, 30, 1))
    assert torch.isfinite(blocked_causal_attention(q, k, v)).all()


def test_blocked_attention_refuses_what_it_does_not_compute():
    q, k, v = _qkv(8, heads=2, kv=2)
    longer = torch.randn(2, 2, 12, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="one sequence length, got 8, 12 and 12"):
        blocked_causal_attention(q, longer, longer)
    for bad in (0, -1, 2.5, None, True):
        with pytest.raises(ValueError, match=f"block_size must be an integer >= 1, got {bad!r}"):
            blocked_causal_attention(q, k, v, block_size=bad)
    with pytest.raises(ValueError, match="one floating dtype, got torch.float64, torch.float64 and torch.bfloat16"):
        blocked_causal_attention(q, k, v.bfloat16())
    ints = torch.zeros(1, 1, 4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="one floating dtype, got torch.int64"):
        blocked_causal_attention(ints, ints, ints)


def test_an_empty_sequence_gives_an_empty_output_as_sdpa_does():
    q = torch.randn(2, 2, 0, 8)
    out = blocked_causal_attention(q, q, q)
    assert out.shape == _sdpa(q, q, q).shape == (2, 2, 0, 8)


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).double()


def test_the_kernel_is_read_in_training_mode_only(monkeypatch):
    """CausalLMLoss(attention="blocked") sets the layers' kernel; in training mode every layer calls it, in eval
    mode (evaluation, export, serving) none does and the logits are SDPA's, bit for bit."""
    calls = []
    real = model_mod.blocked_causal_attention
    monkeypatch.setattr(model_mod, "blocked_causal_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = _model()
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    sdpa_logits = m.eval()(x)[0]
    loss_mod = CausalLMLoss(m, attention="blocked")
    assert [layer.self_attn.training_kernel for layer in m.model.layers] == ["blocked", "blocked"]
    assert torch.equal(m.eval()(x)[0], sdpa_logits) and calls == []
    m.train()
    loss_mod(x[:, :-1], x[:, 1:])
    assert len(calls) == 2
    CausalLMLoss(m, attention="sdpa")
    assert [layer.self_attn.training_kernel for layer in m.model.layers] == ["sdpa", "sdpa"]


def test_loss_and_gradients_through_the_blocked_kernel_equal_sdpa_s():
    x = torch.randint(0, 97, (3, 41), generator=torch.Generator().manual_seed(2))
    out = {}
    for kernel in ("sdpa", "blocked"):
        m = _model().train()
        loss = CausalLMLoss(m, chunk_tokens=None, attention=kernel)(x[:, :-1], x[:, 1:])
        loss.backward()
        out[kernel] = (float(loss.detach()), [p.grad.clone() for p in m.parameters()])
    assert out["blocked"][0] == pytest.approx(out["sdpa"][0], rel=1e-12)
    for a, b in zip(out["blocked"][1], out["sdpa"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="attention: expected one of sdpa, blocked, got 'flash'"):
        CausalLMLoss(_model(), attention="flash")


def _placement(device: str, dtype: torch.dtype):
    return SimpleNamespace(device=torch.device(device), dtype=dtype, dtype_name=str(dtype).replace("torch.", ""))


@pytest.mark.parametrize("asked,device,dtype,layers_compiled,expected,why", [
    ("auto", "cpu", torch.bfloat16, True, "blocked", "max |Δ|"),
    ("auto", "cpu", torch.bfloat16, False, "sdpa", "decoder layers eager"),
    ("auto", "cpu", torch.float32, True, "sdpa", "cpu, float32"),
    ("auto", "cuda", torch.bfloat16, True, "sdpa", "cuda, bfloat16"),
    ("blocked", "cpu", torch.float32, False, "blocked", 'train.attention = "blocked"'),
    ("sdpa", "cpu", torch.bfloat16, True, "sdpa", 'train.attention = "sdpa"'),
])
def test_auto_takes_the_blocked_kernel_only_where_it_pays(asked, device, dtype, layers_compiled, expected, why):
    builder = StepModuleBuilder(TrainSection(attention=asked))
    kernel, reason = builder.choose_attention(_placement(device, dtype), 2, 64, layers_compiled)
    assert kernel == expected and why in reason


def test_auto_keeps_sdpa_when_the_blocked_kernel_fails_its_numerics(monkeypatch):
    errors = iter([0.02, 0.03, 0.3, 0.1])  # the blocked kernel, then SDPA, at q, k scale 1, then 4
    monkeypatch.setattr(step_module, "attention_error", lambda *a, **k: next(errors))
    kernel, reason = StepModuleBuilder(TrainSection()).choose_attention(_placement("cpu", torch.bfloat16), 2, 64, True)
    assert kernel == "sdpa"
    assert ("off its numerics (max |Δ| 2.00e-02 / 3.00e-01 vs float32 math at q, k scale 1 / 4, SDPA's 3.00e-02 / "
            f"1.00e-01; allowed: 1.25× SDPA's or {SDPA_TOL})") in reason


def test_attention_value_is_checked(tmp_path, session_cache):
    with pytest.raises(ConfigError, match=r"train.attention: expected \"auto\", \"sdpa\" or \"blocked\", got \"flash\""):
        fast_config(tmp_path, session_cache, **{"train.attention": "flash"})


def _run(tmp_path, session_cache, name, log=lambda m: None, **keys) -> dict:
    cfg = fast_config(tmp_path, session_cache, **{"run.name": name, "train.max_steps": 2, "train.dtype": "bfloat16",
                                                  "train.compile": "auto", **keys})
    Trainer(cfg, log=log).train()
    return json.loads((tmp_path / f"runs/{name}/summary.json").read_text())


def test_a_compiled_bf16_cpu_run_trains_with_the_blocked_kernel_and_says_so(tmp_path, session_cache, monkeypatch):
    """...and a --resume that trains no further step keeps that record and the final report in summary.json (it
    wrote this session's empty ones: eager, SDPA, no val_sources)."""
    real = CausalLMLoss.compile_blocks
    monkeypatch.setattr(CausalLMLoss, "compile_blocks", lambda self, b, backend="inductor": real(self, b, "aot_eager"))
    torch._dynamo.reset()
    logs = []
    s = _run(tmp_path, session_cache, "blk", log=logs.append)
    assert s["compile"]["path"] == "compiled" and s["compile"]["attention"] == "blocked"
    assert s["attention_backend"]["name"] == "blocked" and "max |Δ|" in s["attention_backend"]["detail"]
    assert any(m.startswith("training attention: blocked") for m in logs)
    assert "training attention: blocked" in (tmp_path / "runs/blk/train.log").read_text()
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "blk", "train.max_steps": 2, "train.dtype": "bfloat16",
                                                  "train.compile": "auto"})
    again = Trainer(cfg, resume=True, log=lambda m: None).train()
    on_disk = json.loads((tmp_path / "runs/blk/summary.json").read_text())
    for key in ("compile", "attention_backend", "tokens_per_s", "val_sources", "samples"):
        assert again[key] == on_disk[key] == s[key], key


def test_falling_back_to_eager_falls_back_to_sdpa(tmp_path, session_cache, monkeypatch):
    """A compiler failure under "auto" trains eagerly, and eager the blocked kernel does not pay: SDPA, on every
    layer of the model."""
    def fail(self, *a, **k):
        raise RuntimeError("no C++ compiler (planted)")

    monkeypatch.setattr(CausalLMLoss, "compile_blocks", fail)
    trainer = Trainer(fast_config(tmp_path, session_cache, **{"run.name": "fb", "train.max_steps": 2,
                                                             "train.dtype": "bfloat16", "train.compile": "auto"}),
                      log=lambda m: None)
    trainer.train()
    s = json.loads((tmp_path / "runs/fb/summary.json").read_text())
    assert s["compile"]["path"] == "eager" and s["compile"]["attention"] == "sdpa"
    assert "decoder layers eager" in s["compile"]["attention_reason"]
    assert {layer.self_attn.training_kernel for layer in trainer.model.model.layers} == {"sdpa"}
