"""train/optim.py: the optimizer choice (AdamW, Muon + AdamW), the three schedules, their config errors, and that
preflight and gradient accumulation work with Muon."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from train.model import LlamaForCausalLM, ModelConfig
from train.optim import (
    MUON_MATRICES,
    Muon,
    MuonAdamW,
    build_optimizer,
    is_muon_matrix,
    lr_at,
    newton_schulz,
    newton_schulz_dtype,
)
from train.preflight import run_preflight

CFG = ModelConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=64)


def model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(CFG)


def windows(seed: int = 0, b: int = 4, s: int = 17) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def loss_of(m, w):
    out = m(w[:, :-1])
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))


# ------------------------------------------------------------------------------------------------ schedules

@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_every_schedule_warms_up_then_ends_at_min_lr(schedule):
    lrs = [lr_at(s, 1.0, 0.0, 10, 100, schedule, 0.2) for s in range(101)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[100] == 0.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])), "non-increasing after warmup"


def test_schedule_values():
    assert lr_at(55, 1.0, 0.1, 10, 100, "cosine") == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(55, 1.0, 0.0, 10, 100, "linear") == pytest.approx(0.5)
    # wsd: held at lr until step 80 (the last 20 % cool down), then linear to min_lr at 100
    assert [lr_at(s, 1.0, 0.0, 10, 100, "wsd", 0.2) for s in (11, 79, 80, 90, 99)] == pytest.approx(
        [1.0, 1.0, 1.0, 0.5, 0.05])
    assert lr_at(50, 1.0, 0.0, 10, 100, "wsd", 0.0) == 1.0  # no cooldown: constant, then min_lr at the end
    assert lr_at(10, 1.0, 0.0, 10, 100, "wsd", 1.0) == pytest.approx(1.0)  # cooldown starts after the warmup


@pytest.mark.parametrize("kw, match", [({"schedule": "step"}, "train.schedule: expected one of"),
                                       ({"cooldown_frac": 1.5}, r"train.cooldown_frac: expected a number in \[0, 1\]")])
def test_lr_at_refuses_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        lr_at(5, 1.0, 0.0, 2, 10, **{"schedule": "wsd", **kw})


# ------------------------------------------------------------------------------------------------ config errors

@pytest.mark.parametrize("setting, message", [
    ("train.optimizer=sgd", "train.optimizer: expected adamw or muon, got \"sgd\""),
    ("train.schedule=step", "train.schedule: expected cosine, linear or wsd, got \"step\""),
    ("train.cooldown_frac=1.5", "train.cooldown_frac: expected a number in [0, 1], got 1.5"),
    ("train.cooldown_frac=-0.1", "train.cooldown_frac: expected a number in [0, 1], got -0.1"),
])
def test_cli_refuses_bad_optimizer_settings_with_exit_2(setting, message, capsys, tmp_path):
    from train.run import main

    assert main(["--config", "tiny", "--name", "x", "--set", setting,
                 "--set", f'run.out_dir="{tmp_path.as_posix()}/runs"']) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_cli_refuses_a_muon_learning_rate_of_zero(capsys, tmp_path):
    from train.run import main

    assert main(["--config", "tiny", "--name", "x", "--set", "train.optimizer=muon", "--set", "train.lr=0",
                 "--set", "train.min_lr=0", "--set", f'run.out_dir="{tmp_path.as_posix()}/runs"']) == 2
    assert "train.lr" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------------ Muon + AdamW

def test_muon_owns_exactly_the_hidden_matrices():
    m = model()
    opt = build_optimizer(m, 1e-2, 0.1, (0.9, 0.95), optimizer="muon")
    assert isinstance(opt, MuonAdamW)
    by_opt = {"muon": [], "adamw": []}
    for g in opt.param_groups:
        by_opt[g["optimizer"]] += g["names"]
    assert len(by_opt["muon"]) == 7 * CFG.num_hidden_layers
    assert all(n.split(".")[-2] in MUON_MATRICES for n in by_opt["muon"])
    assert any("embed_tokens" in n for n in by_opt["adamw"]) and any("norm" in n for n in by_opt["adamw"])
    every = {n for n, p in m.named_parameters() if p.requires_grad}
    assert sorted(by_opt["muon"] + by_opt["adamw"]) == sorted(every), "each trainable tensor exactly once"


def test_muon_state_is_one_buffer_per_matrix_adamw_two():
    m = model()
    opt = build_optimizer(m, 1e-2, 0.1, (0.9, 0.95), optimizer="muon")
    loss_of(m, windows()).backward()
    opt.step()
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    for p, st in opt.state.items():
        tensors = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        assert len(tensors) == (1 if id(p) in muon_ids else 2), (tuple(p.shape), sorted(st))


def test_muon_state_dict_round_trip_continues_bit_identically():
    ma, mb = model(), model()
    oa = build_optimizer(ma, 1e-2, 0.1, (0.9, 0.95), optimizer="muon")
    for k in range(3):
        oa.zero_grad()
        loss_of(ma, windows(k)).backward()
        oa.step()
    mb.load_state_dict(ma.state_dict())
    ob = build_optimizer(mb, 1e-2, 0.1, (0.9, 0.95), optimizer="muon")
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # as torch.save + torch.load would (no shared tensors)
    for m, o in ((ma, oa), (mb, ob)):
        o.zero_grad()
        loss_of(m, windows(9)).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(ma.state_dict().values(), mb.state_dict().values()))


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_newton_schulz_in_bfloat16_is_torchs_bit_for_bit(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz as torchs

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coeffs = (3.4445, -4.7750, 2.0315)
    ours = newton_schulz(g, coeffs, 5, 1e-7, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, torchs(g, coeffs, 5, 1e-7))
    # in float32 the same iteration: near-orthogonal rows (singular values in Muon's ~[0.5, 1.5] band), and within
    # bfloat16's rounding of torch's
    f32 = newton_schulz(g, coeffs, 5, 1e-7, torch.float32)
    s = torch.linalg.svdvals(f32)
    assert f32.dtype == torch.float32 and 0.5 < float(s.min()) and float(s.max()) < 1.5
    assert float((f32 - ours.float()).abs().max()) < 0.05


def test_muon_in_float32_is_torchs_update_with_a_float32_iteration():
    """Muon._step_in is torch's step: in bfloat16 it gives torch.optim.Muon's parameters and momentum bit for bit;
    the float32 iteration (a CPU without native bfloat16) moves them by bfloat16's rounding only."""
    ref, ours, f32 = model(), model(), model()
    for m in (ours, f32):
        m.load_state_dict(ref.state_dict())
    kw = dict(lr=1e-2, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")

    def mats(m):
        return [p for n, p in m.named_parameters() if is_muon_matrix(n, p)]

    o_ref, o_ours, o_f32 = (torch.optim.Muon(mats(ref), **kw), Muon(mats(ours), **kw),
                            Muon(mats(f32), ns_dtype=torch.float32, **kw))
    for k in range(2):
        for m, o in ((ref, o_ref), (ours, o_ours), (f32, o_f32)):
            o.zero_grad()
            loss_of(m, windows(k)).backward()
        o_ref.step()
        o_ours._step_in(torch.bfloat16)
        o_f32.step()
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), ours.state_dict().values()))
    assert all(torch.equal(o_ref.state[a]["momentum_buffer"], o_ours.state[b]["momentum_buffer"])
               for a, b in zip(mats(ref), mats(ours)))
    moved = max(float((a - b).abs().max()) for a, b in zip(ref.state_dict().values(), f32.state_dict().values()))
    one_update = 1e-2 * 0.2 * math.sqrt(max(CFG.hidden_size, CFG.intermediate_size))  # lr × match_rms_adamw scale
    assert 0 < moved < 0.2 * one_update, (moved, one_update)


def test_the_newton_schulz_dtype_follows_native_bfloat16(monkeypatch):
    monkeypatch.setenv("SHALIK_CPU_BF16", "0")
    assert newton_schulz_dtype("cpu") == torch.float32 and newton_schulz_dtype("cuda") == torch.bfloat16
    opt = build_optimizer(model(), 1e-2, 0.1, (0.9, 0.95), optimizer="muon")
    assert opt.muon.ns_dtype == torch.float32
    monkeypatch.setattr("train.optim.native_cpu_bf16", lambda: "avx512_bf16")
    assert newton_schulz_dtype("cpu") == torch.bfloat16


def test_muon_refuses_an_adamw_checkpoint_state():
    m = model()
    adamw_state = build_optimizer(m, 1e-2, 0.1, (0.9, 0.95)).state_dict()
    with pytest.raises(ValueError, match="expected a Muon\\+AdamW state"):
        build_optimizer(m, 1e-2, 0.1, (0.9, 0.95), optimizer="muon").load_state_dict(adamw_state)


def test_muon_with_gradient_accumulation_equals_one_big_batch():
    """Two half-batches accumulated (each loss scaled by 1/2) step Muon as the whole batch does: the update depends
    on the summed gradient only."""
    ma, mb = model(), model()
    oa = build_optimizer(ma, 1e-2, 0.0, (0.9, 0.95), optimizer="muon")
    ob = build_optimizer(mb, 1e-2, 0.0, (0.9, 0.95), optimizer="muon")
    w = windows(3, b=4)
    loss_of(ma, w).backward()
    for half in (w[:2], w[2:]):
        (loss_of(mb, half) / 2).backward()
    oa.step()
    ob.step()
    for (n, a), b in zip(ma.named_parameters(), mb.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)


def test_muon_learns_faster_than_nothing():
    m = model()
    opt = build_optimizer(m, 1e-2, 0.0, (0.9, 0.95), optimizer="muon")
    w = windows(5)
    first = float(loss_of(m, w).detach())
    for _ in range(30):
        opt.zero_grad()
        loss_of(m, w).backward()
        opt.step()
    assert float(loss_of(m, w).detach()) < 0.5 * first


def test_preflight_passes_with_muon_and_names_it():
    m = model()
    report = run_preflight(m, windows(0, b=2, s=33), device=torch.device("cpu"), dtype=torch.float32,
                           vocab_size=CFG.vocab_size, model_config=CFG, lr=1e-2, log=lambda s: None,
                           optimizer_factory=lambda mm: build_optimizer(mm, 1e-2, 0.1, (0.9, 0.95), optimizer="muon"))
    assert report.ok, report.table()
    upd = next(c for c in report.checks if c.name == "update_flow")
    assert "(adamw+muon)" in upd.detail


def test_resume_with_another_optimizer_is_refused(tmp_path, session_cache):
    from tests.conftest import fast_config
    from train.run import Trainer, TrainError

    Trainer(fast_config(tmp_path, session_cache, **{"run.name": "o", "train.max_steps": 2, "train.optimizer": "adamw"}),
            log=lambda m: None).train()
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "o", "train.max_steps": 4, "train.optimizer": "muon"})
    with pytest.raises(TrainError, match=r"trained with train.optimizer = 'adamw', the config says 'muon'"):
        Trainer(cfg, resume=True, log=lambda m: None).train()
