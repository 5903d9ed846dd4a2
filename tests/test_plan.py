"""train.plan: the fake-tensor memory model against a direct fake run and against the measured peak of tiny and
small on CPU (docs/design.md, "Training at scale")."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import ROOT
from train import plan as P
from train.config import ConfigError, load_config
from train.model import ModelConfig

FIXTURE = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
)


@pytest.mark.slow  # five fake runs: over 20 s on a loaded 2-core machine
def test_bilinear_memory_model_matches_a_direct_fake_run():
    mm = P.memory_model(FIXTURE, 128, torch.float32)  # activations dominate, as in any real config
    got = mm.plan(3, compiled=False)
    direct, param_bytes, opt_bytes = P._fake_peak(FIXTURE, 3, 128, torch.float32)
    assert got.peak_bytes == pytest.approx(direct, rel=0.03)
    n = sum(p.numel() for p in P._meta_model(FIXTURE).parameters())
    assert got.param_bytes == param_bytes == 4 * n
    assert got.optimizer_bytes == pytest.approx(8 * n, rel=0.001)  # AdamW: exp_avg + exp_avg_sq (+ step scalars)


@pytest.mark.slow
def test_plan_cli_prints_the_table(capsys):
    assert P.main(["--config", "tiny", "--gpu", "h200", "--set", "model.num_hidden_layers=2"]) == 0
    out = capsys.readouterr().out
    assert "H200" in out and "← config" in out and "largest micro-batch" in out and "CUDA ctx" in out


def _tiny_target(usable_gib: float) -> P.Target:
    return P.Target("cpu", "a test CPU", int(usable_gib * 2**30), 1e11, baseline_bytes=500 * 2**20)


def test_plan_cli_plans_for_this_cpu_by_default_and_counts_the_process(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(P, "cpu_target", lambda cfg, tokens: _tiny_target(64))
    sets = ["--set", "model.num_hidden_layers=2", "--set", f'data.cache_dir="{tmp_path}"', "--vocab-size", "3000"]
    assert P.main(["--config", "tiny", *sets]) == 0
    out = capsys.readouterr().out
    assert "a test CPU" in out and "float32" in out and "eager" in out and "runtime" in out and "malloc" in out
    row = next(line for line in out.splitlines() if line.endswith("← config")).split()
    # micro 16: tensors + the runtime's 500 MiB + malloc's 2.5 float32 [16 × 256 × 3000] buffers
    mm = P.memory_model(ModelConfig(vocab_size=3000, **{**dataclasses.asdict(load_config("tiny").model),
                                                        "num_hidden_layers": 2}), 256, torch.float32)
    want = mm.plan(16, False).peak_bytes + 500 * 2**20 + 2.5 * 16 * 256 * 3000 * 4
    assert float(row[-6]) == pytest.approx(want / 2**30, abs=0.051) and row[-5] == "yes"


def test_plan_cli_exits_1_naming_planned_and_usable_gib_when_the_micro_batch_does_not_fit(capsys, monkeypatch,
                                                                                           tmp_path):
    monkeypatch.setattr(P, "cpu_target", lambda cfg, tokens: _tiny_target(0.7))
    sets = ["--set", "model.num_hidden_layers=2", "--set", f'data.cache_dir="{tmp_path}"', "--vocab-size", "3000"]
    assert P.main(["--config", "tiny", *sets]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: the configured micro-batch 16 × 256 plans ")
    assert "over the 0.7 GiB usable on a test CPU" in err and "try micro-batch " in err


def test_step_time_and_mfu_follow_the_flops():
    pl = P.estimate(FIXTURE, 4, 32, torch.bfloat16, compiled=True)
    secs, mfu = P.step_time(pl, FIXTURE, P.GPUS["h100"], 4 * 32)
    assert P.step_time(pl, FIXTURE, _tiny_target(8), 4 * 32) == (pl.flops_per_token * 128 / 1e11, None)
    assert secs > 0 and 0 < mfu < P.ETA_MATMUL
    assert mfu == pytest.approx(pl.flops_per_token * 128 / (secs * 989e12))


@pytest.mark.slow  # six fake steps and a compiled layer trace
def test_the_chunked_loss_stops_growing_past_one_chunk():
    """bf16 computes the loss CHUNK_TOKENS rows at a time: at micro-batch 16 × 2048 (four chunks) the fit must
    not extrapolate the head's transient linearly from micro-batch 1 and 2 (that overestimated base-400m by 8.7
    GiB: 67.1 against the 58.4 of a direct fake run of the 24-layer step)."""
    cfg = dataclasses.replace(FIXTURE, vocab_size=32000)  # the head dominates, as it would unchecked
    mm = P.memory_model(cfg, 2048, torch.bfloat16)
    direct, _, _ = P._fake_peak(cfg, 16, 2048, torch.bfloat16)
    assert mm.plan(16, compiled=False).peak_bytes == pytest.approx(direct, rel=0.03)
    assert dataclasses.replace(mm, head_chunk_per_token=0.0).plan(16, compiled=False).peak_bytes > 1.2 * direct


@pytest.fixture(scope="module")
def fixture_fp32_model():
    return P.memory_model(FIXTURE, 128, torch.float32)


@pytest.mark.parametrize("mode,every", [("selective", 2), ("selective", 3), ("full", 1)])
def test_checkpointing_lowers_the_peak_as_a_direct_fake_run_does(fixture_fp32_model, mode, every):
    """The planner's peak with activation checkpointing against the fake run of the checkpointed step itself: it
    drops by what the checkpointed layers no longer save; with the top layer checkpointed ("full", or layer 3 of 4
    at every 3) the planner adds that layer's recompute, so it may exceed the run by at most one layer."""
    mm = fixture_fp32_model
    plain = mm.plan(3, compiled=False)
    got = mm.plan(3, compiled=False, activation_checkpoint=mode, checkpoint_every=every)
    direct, _, _ = P._fake_peak(FIXTURE, 3, 128, torch.float32, mode, every)
    one_layer = mm.layer_saved_eager * 3 * 128
    assert got.checkpointed_layers == {2: 2, 3: 2, 1: 4}[every]
    assert direct < plain.peak_bytes and got.peak_bytes < plain.peak_bytes
    if every == 2:  # layers 0 and 2: both recomputed after the layer above freed its activations
        assert got.peak_bytes == pytest.approx(direct, rel=0.03)
        assert plain.peak_bytes - got.peak_bytes == pytest.approx(2 * one_layer, rel=1e-6)
    else:
        assert direct * 0.97 <= got.peak_bytes <= direct + one_layer * 1.03


def test_recomputation_costs_step_time_and_mfu(fixture_fp32_model):
    mm = fixture_fp32_model
    gpu, tokens = P.GPUS["h100"], 8 * 128
    plain = mm.plan(8, compiled=True)
    ckpt = mm.plan(8, compiled=True, activation_checkpoint="selective", checkpoint_every=2)
    (s0, m0), (s1, m1) = P.step_time(plain, FIXTURE, gpu, tokens), P.step_time(ckpt, FIXTURE, gpu, tokens)
    h, s = FIXTURE.hidden_size, 128
    weights = 4 * h * h - 2 * h * (h - FIXTURE.num_key_value_heads * FIXTURE.head_dim) + 3 * h * 128
    forward = 2 * (2.0 * weights / (989e12 * P.ETA_MATMUL) + 2.0 * h * s / (989e12 * P.ETA_ATTENTION))
    assert s1 - s0 >= tokens * forward * 0.999  # two layers' forward again (plus their activations' traffic)
    assert m1 == pytest.approx(m0 * s0 / s1)  # MFU counts model FLOPs only: recomputation lowers it


def test_the_fit_is_cached_by_model_torch_and_source(tmp_path, monkeypatch):
    first = P.memory_model(FIXTURE, 32, torch.float32, cache_dir=tmp_path)
    assert len(list((tmp_path / "plan").glob("*.json"))) == 1

    def no_fake_runs(*a, **k):
        raise AssertionError("a cache hit runs no fake step")

    monkeypatch.setattr(P, "_fake_peaks", no_fake_runs)
    again = P.memory_model(FIXTURE, 32, torch.float32, cache_dir=tmp_path)
    assert again.plan(4, False).to_dict() == first.plan(4, False).to_dict()
    with pytest.raises(AssertionError, match="a cache hit"):  # another sequence length is another key
        P.memory_model(FIXTURE, 64, torch.float32, cache_dir=tmp_path)


def test_activation_checkpoint_config_is_checked():
    with pytest.raises(ConfigError, match=r'train.activation_checkpoint: expected "none", "selective" or "full"'):
        load_config("tiny", ["train.activation_checkpoint=some"])
    with pytest.raises(ConfigError, match=r"train.activation_checkpoint_every: expected an integer >= 1"):
        load_config("tiny", ["train.activation_checkpoint_every=0"])
    assert load_config("tiny").train.activation_checkpoint == "none"  # the golden losses' path is unchanged


@pytest.mark.slow  # the real base-400m fit: about 10 s of CPU
def test_base_400m_fits_45_gib_at_50_percent_mfu():
    cfg = load_config("base-400m")
    t = cfg.train
    mcfg = ModelConfig(vocab_size=cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model))
    mm = P.memory_model(mcfg, t.seq_len, torch.bfloat16)
    tokens = t.micro_batch_size * t.grad_accum * t.seq_len
    for ac in ((t.activation_checkpoint, t.activation_checkpoint_every), ("selective", 4)):
        pl = mm.plan(t.micro_batch_size, True, *ac)
        _, mfu = P.step_time(pl, mcfg, P.GPUS["h100"], tokens)
        assert pl.peak_bytes <= 45 * 2**30 and mfu >= 0.50, (ac, pl.peak_bytes / 2**30, mfu)
    plain, sel = mm.plan(16, True), mm.plan(16, True, "selective", 4)
    assert plain.peak_bytes - sel.peak_bytes == pytest.approx(6 * mm.layer_saved_compiled * 16 * 2048, rel=1e-6)


MEASURE = textwrap.dedent("""
    import dataclasses, json, sys, torch
    from pathlib import Path
    from train.config import load_config
    from train.device import peak_memory_bytes, reset_peak_memory, setup_cpu_allocator
    from train.model import CausalLMLoss, LlamaForCausalLM, ModelConfig
    from train.optim import build_optimizer_for
    cfg = load_config(sys.argv[1])
    mcfg = ModelConfig(vocab_size=cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model))
    t, cpu = cfg.train, torch.device("cpu")
    setup_cpu_allocator()  # as train.run does on CPU
    rss = next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
               if l.startswith("VmRSS:"))
    reset_peak_memory(cpu)
    m = LlamaForCausalLM(mcfg)
    step, opt = CausalLMLoss(m), build_optimizer_for(m, t)
    for _ in range(4):
        x = torch.randint(0, mcfg.vocab_size, (t.micro_batch_size, t.seq_len + 1))
        step(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(json.dumps([rss, peak_memory_bytes(cpu)]))
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak resident set is reset through /proc")
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_estimate_matches_the_measured_cpu_peak(name):
    """Measured: the peak resident set of a fresh process that trains as train.run does on CPU (glibc's raised mmap
    threshold, the config's optimizer, four steps). The plan's process peak — tensors, the runtime baseline
    (measured in that process before the model existed) and malloc's reserve — must lie within 25 % of it."""
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    baseline, measured = json.loads(res.stdout.strip().splitlines()[-1])
    cfg = load_config(name)
    mcfg = ModelConfig(vocab_size=cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model))
    mm = P.memory_model(mcfg, cfg.train.seq_len, torch.float32, optimizer=cfg.train.optimizer)
    target = P.Target("cpu", "this CPU", 2**40, 1e11, baseline_bytes=baseline)
    est = target.plan(mm, cfg.train.micro_batch_size, compiled=False).process_bytes
    assert 0.75 * measured <= est <= 1.25 * measured, (est / 2**30, measured / 2**30)


def test_newton_schulz_flops_equal_torch_muons_own_count():
    """The planner's Muon cost equals what torch.utils.flop_counter counts for torch.optim.Muon's own Newton–Schulz
    on every hidden matrix of the model."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    from torch.utils.flop_counter import FlopCounterMode

    from train.optim import is_muon_matrix

    model = P._meta_model(FIXTURE)
    with FlopCounterMode(display=False) as counter:
        for name, p in model.named_parameters():
            if is_muon_matrix(name, p):
                _zeropower_via_newtonschulz(torch.zeros(p.shape), (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert P.newton_schulz_flops(FIXTURE) == counter.get_total_flops() > 0
