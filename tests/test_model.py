"""The model against transformers, the KV cache, and cases TR1–TR3, TR6, TR8, TR9 of docs/cases.md."""

from __future__ import annotations

import copy
import io

import pytest
import safetensors.torch
import torch
from torch.utils.checkpoint import checkpoint

from train.components.checkpoint import hf_state_dict, load_weights, save_weights
from train.model import (
    CausalLMLoss,
    LlamaForCausalLM,
    ModelConfig,
    RMSNorm,
    apply_rotary,
    causal_lm_loss,
    checkpointed_layers,
    repeat_kv,
)
from train.optim import build_optimizer, param_groups


def hf_twin(model: LlamaForCausalLM):
    transformers = pytest.importorskip("transformers")
    keys = ("architectures", "model_type", "torch_dtype")
    hcfg = transformers.LlamaConfig(**{k: v for k, v in model.config.hf_config().items() if k not in keys})
    hf = transformers.LlamaForCausalLM(hcfg).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False)
    hf.tie_weights()
    return hf


@pytest.mark.parametrize("theta,kv", [(10000.0, 2), (50000.0, 1), (500000.0, 4)])
def test_logits_equal_transformers(fixture_m, theta, kv):
    cfg = copy.deepcopy(fixture_m.config)
    cfg.rope_theta, cfg.num_key_value_heads = theta, kv
    torch.manual_seed(1)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    hf = hf_twin(m)
    x = torch.randint(0, cfg.vocab_size, (2, 100))
    with torch.no_grad():
        ours, _ = m(x)
        theirs = hf(x).logits
    assert ours.abs().max() > 1.0  # logits of real scale, not a vacuous comparison
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), float((ours - theirs).abs().max())


def test_kv_cache_forward_equals_full_forward(fixture_m):
    m = fixture_m.eval()
    x = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        full, _ = m(x)
        a, past = m(x[:, :25], use_cache=True)
        pieces = [a]
        for t in range(25, 40):
            logit, past = m(x[:, t:t + 1], past_key_values=past)
            pieces.append(logit)
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)
    assert past[0][0].shape == (2, 2, 40, 16)  # cache holds the KV head count, not the expanded one


def test_gqa_maps_query_head_to_kv_head_integer_division():
    k = torch.arange(2).float().view(1, 2, 1, 1).expand(1, 2, 1, 3)
    r = repeat_kv(k, 2)
    assert r[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # h // 2, not h % 2


def test_tr8_left_padding_no_nan_and_matches_unpadded(fixture_m):
    m = fixture_m
    ids = torch.randint(2, 512, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 1
    logits, _ = m(ids, attention_mask=mask)
    labels = ids.clone()
    labels[mask == 0] = -100
    loss = causal_lm_loss(logits[:, :-1], labels[:, 1:], reduction="mean")
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    with torch.no_grad():
        alone, _ = m(ids[:1, 3:])
    assert torch.allclose(logits[0, 3:], alone[0], atol=1e-5)


def test_tr9_rope_not_in_place_and_gradcheck():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 6, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 6, 16, dtype=torch.float64, requires_grad=True)
    from train.model import RotaryEmbedding

    rot = RotaryEmbedding(16, 10000.0)
    cos, sin = rot(torch.arange(6)[None], torch.float64)
    qv, kv = q._version, k._version
    q0, k0 = q.detach().clone(), k.detach().clone()
    apply_rotary(q, k, cos, sin)
    assert q._version == qv and k._version == kv
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0)
    assert torch.autograd.gradcheck(lambda a, b: apply_rotary(a, b, cos, sin), (q, k))


def test_tr9_gradients_equal_with_checkpointing(fixture_m):
    m = fixture_m.double()
    x = torch.randint(0, 512, (2, 12))

    def grads(use_ckpt: bool):
        m.zero_grad(set_to_none=True)
        h = m.model.embed_tokens(x)
        cos, sin = m.model.rotary_emb(torch.arange(12)[None].expand(2, 12), h.dtype)
        for layer in m.model.layers:
            if use_ckpt:
                h = checkpoint(lambda t, layer=layer: layer(t, cos, sin, None, None)[0], h, use_reentrant=False)
            else:
                h = layer(h, cos, sin, None, None)[0]
        logits = m.lm_head(m.model.norm(h))
        causal_lm_loss(logits[:, :-1], x[:, 1:], reduction="mean").backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    a, b = grads(False), grads(True)
    assert all(torch.allclose(a[n], b[n], atol=1e-10, rtol=0) for n in a)


def test_tr6_rmsnorm_reduces_in_fp32():
    n = RMSNorm(64, eps=1e-5).half()
    out = n(torch.full((1, 64), 300.0, dtype=torch.float16))
    assert torch.isfinite(out).all() and torch.allclose(out.float(), torch.ones(1, 64), atol=1e-3)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(2, 4, 1, 32, generator=g) * 0.058
    ref = RMSNorm(32, eps=1e-5)(x)
    out = RMSNorm(32, eps=1e-5).to(torch.bfloat16)(x.to(torch.bfloat16)).float()
    assert torch.allclose(out, ref, atol=2e-2)


def test_tr1_accumulation_normalised_by_target_tokens(fixture_m):
    m = fixture_m
    torch.manual_seed(3)
    a = torch.randint(0, 512, (1, 8))
    b = torch.randint(0, 512, (1, 8))
    la = torch.full((1, 8), -100)
    la[0, 4] = 7
    lb = torch.full((1, 8), -100)
    lb[0, 1:4] = torch.tensor([1, 2, 3])
    empty = torch.full((1, 8), -100)

    def grads_accumulated():
        m.zero_grad(set_to_none=True)
        total = int((la != -100).sum() + (lb != -100).sum() + (empty != -100).sum())
        loss_sum = 0.0
        for x, y in ((a, la), (b, lb), (a, empty)):
            s = causal_lm_loss(m(x)[0], y, reduction="sum")
            (s / total).backward()
            loss_sum += float(s.detach())
        return loss_sum / total, {n: p.grad.clone() for n, p in m.named_parameters()}

    def grads_big_batch():
        m.zero_grad(set_to_none=True)
        loss = causal_lm_loss(m(torch.cat([a, b]))[0], torch.cat([la, lb]), reduction="mean")
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in m.named_parameters()}

    (l1, g1), (l2, g2) = grads_accumulated(), grads_big_batch()
    assert l1 == pytest.approx(l2, rel=1e-6)
    assert all(torch.allclose(g1[n], g2[n], atol=1e-6) for n in g1)
    # the toy arithmetic: token losses A=[4.0], B=[0,0,0] → 4/4 = 1.0, not the mean of means 2.0
    assert (4.0 + 0 + 0 + 0) / 4 == 1.0


def test_tr2_decay_groups(fixture_m):
    groups = param_groups(fixture_m, 0.1)
    decay, nodecay = groups[0], groups[1]
    assert decay["weight_decay"] == 0.1 and nodecay["weight_decay"] == 0.0
    assert "model.embed_tokens.weight" in nodecay["names"]
    assert all(n.endswith("norm.weight") or n == "model.embed_tokens.weight" for n in nodecay["names"])
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert sum(proj in n for n in decay["names"]) == 2
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(fixture_m.parameters()))
    # a norm gain does not shrink under steps with zero gradient
    opt = build_optimizer(fixture_m, lr=0.1, weight_decay=0.1, betas=(0.9, 0.95))
    norm = fixture_m.model.norm.weight
    before = norm.detach().clone()
    for _ in range(3):
        for p in fixture_m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    assert torch.equal(norm.detach(), before)


def _assert_tied(m):
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert sum(1 for n, _ in m.named_parameters() if n in ("lm_head.weight", "model.embed_tokens.weight")) == 1


def test_tr3_tied_through_every_load_path(fixture_m, tmp_path):
    m = fixture_m
    _assert_tied(m)
    sd = m.state_dict()
    for assign in (False, True):
        fresh = LlamaForCausalLM(m.config)
        fresh.load_state_dict(copy.deepcopy(sd), assign=assign)
        fresh.tie_weights()
        _assert_tied(fresh)
        assert torch.equal(fresh.lm_head.weight, m.lm_head.weight)
    with torch.device("meta"):
        meta = LlamaForCausalLM(m.config)
    meta.load_state_dict(copy.deepcopy(sd), assign=True)
    meta.tie_weights()
    _assert_tied(meta)
    save_weights(m, tmp_path / "model.safetensors")
    assert set(safetensors.torch.load_file(tmp_path / "model.safetensors")) == set(hf_state_dict(m))
    fresh = LlamaForCausalLM(m.config)
    load_weights(fresh, tmp_path / "model.safetensors")
    _assert_tied(fresh)
    m2 = copy.deepcopy(m).to(torch.bfloat16).to(torch.float32)
    _assert_tied(m2)


def test_tr3_optimizer_steps_tied_tensor_once(fixture_m):
    m = fixture_m
    opt = torch.optim.SGD([{"params": g["params"]} for g in param_groups(m, 0.0)], lr=0.1, momentum=0.0)
    w = m.model.embed_tokens.weight
    before = w.detach().clone()
    g = torch.randn_like(w)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    w.grad = g
    opt.step()
    assert torch.allclose(w.detach(), before - 0.1 * g, atol=1e-7)
    assert torch.equal(m.lm_head.weight.detach(), w.detach())


def test_x5_safetensors_tied_single_key_and_transformers_load(fixture_m, tmp_path):
    transformers = pytest.importorskip("transformers")
    import json

    m = fixture_m.eval()
    save_weights(m, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(m.config.hf_config()))
    keys = safetensors.torch.load_file(tmp_path / "model.safetensors").keys()
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, m(x)[0], atol=1e-6)


def test_num_params_and_flops(fixture_m):
    m = fixture_m
    c = m.config
    per_layer = (c.hidden_size * c.hidden_size * 2 + c.hidden_size * 32 * 2 + 3 * c.hidden_size * c.intermediate_size
                 + 2 * c.hidden_size)
    assert m.num_params() == c.vocab_size * c.hidden_size + 2 * per_layer + c.hidden_size
    assert m.num_params(non_embedding=True) == m.num_params() - c.vocab_size * c.hidden_size
    matmul = 2 * (per_layer - 2 * c.hidden_size) + c.vocab_size * c.hidden_size
    assert m.flops_per_token(128) == 6 * matmul + 12 * 2 * 64 * 128


def test_presets_param_counts():
    from train.config import load_config
    from train.run import model_config_for

    counts = {name: LlamaForCausalLM(model_config_for(load_config(name), 32000)).num_params()
              for name in ("tiny", "small")}
    assert 4.5e6 < counts["tiny"] < 5.5e6
    assert 30e6 < counts["small"] < 36e6
    # the main job's preset at its own 8k vocabulary: 8000·128 + 4·(128·(128 + 2·64 + 128) + 3·128·384 + 2·128) + 128
    cpu = load_config("cpu")
    assert LlamaForCausalLM(model_config_for(cpu, cpu.tokenizer.vocab_size)).num_params() == 1_811_584
    with torch.device("meta"):
        big = LlamaForCausalLM(model_config_for(load_config("base-400m"), 32000))
    # 32000·1024 + 24·(2·1024² + 2·1024·512 + 3·1024·4096 + 2·1024) + 1024
    assert big.num_params() == 410_305_536


def test_generate_greedy_matches_full_forward_argmax(fixture_m):
    m = fixture_m.eval()
    ids = [0, 5, 9, 13]
    out = m.generate_greedy(ids, 6)
    seq = list(ids)
    for _ in range(6):
        with torch.no_grad():
            seq.append(int(m(torch.tensor([seq]))[0][0, -1].argmax()))
    assert out == seq[len(ids):]


def test_serialisation_roundtrip_bitwise(fixture_m):
    buf = io.BytesIO()
    torch.save(fixture_m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert all(torch.equal(sd[k], v) for k, v in fixture_m.state_dict().items())


@pytest.mark.parametrize("mode,every,expected", [("selective", 2, {0, 2}), ("selective", 3, {0, 3}),
                                                 ("full", 2, {0, 1, 2, 3})])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(mode, every, expected):
    """float32 CPU, 4 layers: checkpointed layers recompute the same values, so the loss is bitwise the plain one
    and the gradients equal it to rounding."""
    cfg = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    x = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(4))

    def run(step: CausalLMLoss):
        m.zero_grad(set_to_none=True)
        loss = step(x[:, :-1], x[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    plain_loss, plain = run(CausalLMLoss(m))
    step = CausalLMLoss(m, activation_checkpoint=mode, checkpoint_every=every)
    assert step.checkpointed == expected
    assert [n for n, _ in step.named_parameters()] == [n for n, _ in CausalLMLoss(m).named_parameters()]
    loss, grads = run(step)
    assert torch.equal(loss, plain_loss)
    for n in plain:
        torch.testing.assert_close(grads[n], plain[n], rtol=1e-6, atol=1e-7, msg=n)


def test_activation_checkpoint_settings_are_checked():
    assert checkpointed_layers("none", 2, 24) == frozenset()
    assert sorted(checkpointed_layers("selective", 6, 24)) == [0, 6, 12, 18]
    assert checkpointed_layers("full", 6, 3) == {0, 1, 2}
    with pytest.raises(ValueError, match="activation_checkpoint: expected one of none, selective, full"):
        checkpointed_layers("some", 2, 4)
    with pytest.raises(ValueError, match="activation_checkpoint_every: expected an integer >= 1"):
        checkpointed_layers("selective", 0, 4)
