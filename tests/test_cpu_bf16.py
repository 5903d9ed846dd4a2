"""``train.dtype = "auto"`` on CPU: bfloat16 autocast only on a CPU that computes it natively, after preflight's
precision check passed and its throughput check timed the gain; float32 otherwise, the reason in the run's log."""

from __future__ import annotations

import json
import platform

import pytest
import torch

import contract.cpu
import train.device as device
from tests.conftest import fast_config
from train.device import AUTO_BF16_MIN_GAIN, auto_cpu_dtype, native_cpu_bf16
from train.preflight.report import CheckResult
from train.run import Trainer

FLAGS = "fpu vme de pse avx2 avx512f avx512bw avx512_vnni"


def cpuinfo(tmp_path, monkeypatch, extra: str) -> None:
    """Point the detector at a /proc/cpuinfo with the given extra flags on both processors."""
    f = tmp_path / "cpuinfo"
    f.write_text("".join(f"processor\t: {i}\nmodel name\t: test\nflags\t\t: {FLAGS} {extra}\n\n" for i in range(2)))
    monkeypatch.setattr(contract.cpu, "CPUINFO", f)
    monkeypatch.delenv(device.BF16_ENV, raising=False)


@pytest.mark.parametrize(("extra", "want"), [("avx512_bf16", "avx512_bf16"), ("amx_tile amx_bf16 avx512_bf16", "amx_bf16"),
                                             ("amx_tile amx_int8", None), ("", None)])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, monkeypatch, extra, want):
    cpuinfo(tmp_path, monkeypatch, extra)
    assert native_cpu_bf16() == want


def test_cpuinfo_is_read_for_name_flags_and_clock(tmp_path):
    """contract.cpu, the one reader of /proc/cpuinfo: the first processor's name and flags, the highest clock; a
    missing file gives None, a file without the line gives an empty set / None."""
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\ncpu MHz\t\t: 2600.000\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                 "processor\t: 1\nmodel name\t: AMD EPYC 9B14\ncpu MHz\t\t: 3100.5\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert contract.cpu.cpu_name(f) == "AMD EPYC 9B14"
    assert contract.cpu.cpu_flags(f) == {"fpu", "avx2", "avx512_bf16"}
    assert contract.cpu.cpu_mhz(f) == 3100.5
    assert contract.cpu.cpu_label(f) == "AMD EPYC 9B14 (AVX2)"
    zen3 = tmp_path / "zen3"
    zen3.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n")
    assert contract.cpu.cpu_label(zen3) == "AMD EPYC (family 25 model 1; AVX2)"
    xeon = tmp_path / "xeon"
    xeon.write_text("processor\t: 0\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel Xeon\n"
                    "flags\t\t: avx2 avx512f amx_tile\n")
    assert contract.cpu.cpu_label(xeon) == "Intel Xeon (family 6 model 143; AMX)"
    bare = tmp_path / "bare"
    bare.write_text("processor\t: 0\n")
    assert (contract.cpu.cpu_name(bare), contract.cpu.cpu_flags(bare), contract.cpu.cpu_mhz(bare)) == (None, set(), None)
    absent = tmp_path / "absent"
    assert (contract.cpu.cpu_name(absent), contract.cpu.cpu_flags(absent), contract.cpu.cpu_mhz(absent)) == (None,) * 3
    assert contract.cpu.cpu_label(bare) == contract.cpu.cpu_label(absent) == (platform.processor() or "unknown CPU")


def test_the_environment_variable_masks_the_flag(tmp_path, monkeypatch):
    cpuinfo(tmp_path, monkeypatch, "avx512_bf16")
    monkeypatch.setenv(device.BF16_ENV, "0")
    assert native_cpu_bf16() is None
    monkeypatch.setenv(device.BF16_ENV, "1")  # anything else leaves the detection alone
    assert native_cpu_bf16() == "avx512_bf16"


def test_the_decision_needs_the_flag_the_precision_check_and_the_gain():
    assert auto_cpu_dtype(True, 1.3, "avx512_bf16")[0] == torch.bfloat16
    assert auto_cpu_dtype(True, AUTO_BF16_MIN_GAIN, "amx_bf16")[0] == torch.bfloat16
    for args, why in [((True, 1.3, None), "no native bfloat16"), ((False, 1.3, "avx512_bf16"), "precision check"),
                      ((True, 1.05, "avx512_bf16"), "1.05×"), ((None, None, "avx512_bf16"), "did not run")]:
        dtype, reason = auto_cpu_dtype(*args)
        assert dtype == torch.float32 and reason.startswith("float32: ") and why in reason, reason


def fake_throughput(gain: float, asked: list):
    """A stand-in for preflight's throughput check that reports ``gain`` for the dtype it is asked to compare."""
    def check(model, big, ctx, dev, dtype, factory, iters=2, compare_dtype=None):
        asked.append(compare_dtype)
        values = {"tokens_per_s": 1000.0}
        if compare_dtype is not None:
            values.update(bfloat16_tokens_per_s=1000.0 * gain, bfloat16_gain=gain)
        return CheckResult("throughput", True, detail="stand-in", values=values)
    return check


def run_auto(tmp_path, session_cache, monkeypatch, name: str, gain: float, **extra) -> tuple[dict, list[str], list]:
    import train.preflight.runner as runner

    asked: list = []
    monkeypatch.setattr(runner, "check_throughput", fake_throughput(gain, asked))
    log: list[str] = []
    cfg = fast_config(tmp_path, session_cache, **{"run.name": name, "train.max_steps": 3, "train.preflight": True,
                                                  "train.device": "cpu", **extra})
    summary = Trainer(cfg, log=log.append).train()
    return summary, log, asked


def test_auto_takes_bfloat16_on_a_native_cpu_when_preflight_shows_the_gain(tmp_path, session_cache, monkeypatch):
    cpuinfo(tmp_path, monkeypatch, "avx512_bf16")
    summary, log, asked = run_auto(tmp_path, session_cache, monkeypatch, "bf16", 1.4)
    assert asked == [torch.bfloat16]
    assert summary["dtype"] == "bfloat16"
    line = next(m for m in log if m.startswith("dtype auto:"))
    assert "bfloat16 autocast" in line and "avx512_bf16" in line and "1.40×" in line, line
    state = json.loads((tmp_path / "runs/bf16/checkpoints/step-000003/trainer_state.json").read_text())
    assert state["dtype"] == "bfloat16"


def test_auto_stays_float32_without_the_gain_or_the_flag(tmp_path, session_cache, monkeypatch):
    cpuinfo(tmp_path, monkeypatch, "avx512_bf16")
    summary, log, asked = run_auto(tmp_path, session_cache, monkeypatch, "slow", 0.9)
    assert asked == [torch.bfloat16] and summary["dtype"] == "float32"
    assert any(m.startswith("dtype auto: float32") and "0.90×" in m for m in log), log

    monkeypatch.setenv(device.BF16_ENV, "0")  # the flag masked: nothing is compared
    summary, log, asked = run_auto(tmp_path, session_cache, monkeypatch, "masked", 1.4)
    assert asked == [None] and summary["dtype"] == "float32"
    assert any(m.startswith("dtype auto: float32: no native bfloat16") for m in log), log

    summary, log, _ = run_auto(tmp_path, session_cache, monkeypatch, "pinned", 1.4, **{"train.dtype": "float32"})
    assert summary["dtype"] == "float32" and not any(m.startswith("dtype auto:") for m in log)


def test_auto_without_preflight_is_float32_and_says_why(tmp_path, session_cache, monkeypatch):
    cpuinfo(tmp_path, monkeypatch, "amx_bf16")
    log: list[str] = []
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "nopf", "train.max_steps": 2, "train.device": "cpu"})
    assert Trainer(cfg, log=log.append).train()["dtype"] == "float32"
    assert any(m.startswith("dtype auto: float32") and "preflight did not run" in m for m in log), log


def test_a_resumed_auto_run_keeps_the_dtype_it_chose(tmp_path, session_cache, monkeypatch):
    cpuinfo(tmp_path, monkeypatch, "avx512_bf16")
    run_auto(tmp_path, session_cache, monkeypatch, "res", 1.4)
    # resumed to more steps on a machine where bfloat16 would now time slower: the checkpoint's dtype stays
    import train.preflight.runner as runner

    monkeypatch.setattr(runner, "check_throughput", fake_throughput(0.5, []))
    log: list[str] = []
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "res", "train.max_steps": 5, "train.preflight": True,
                                                  "train.device": "cpu"})
    summary = Trainer(cfg, resume=True, log=log.append).train()
    assert summary["dtype"] == "bfloat16" and summary["steps"] == 5
    assert any(m == "dtype auto: bfloat16 autocast: as the resumed checkpoint" for m in log), log


def test_the_whole_logits_head_computes_what_the_chunked_one_does_under_bf16():
    """The CPU step module's head + loss (``chunk_tokens=None``: whole logits, no checkpoint) against the chunked,
    checkpointed one under bfloat16 autocast: the same loss, and gradients within bfloat16 rounding (the tied
    embedding's lm_head share is rounded differently)."""
    from train.model import CausalLMLoss, LlamaForCausalLM, ModelConfig

    torch.manual_seed(0)
    m = LlamaForCausalLM(ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    x = torch.randint(0, 300, (3, 33))
    out = []
    for chunk in (None, 40):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = CausalLMLoss(m, chunk_tokens=chunk)(x[:, :-1], x[:, 1:])
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (whole, g_whole), (chunked, g_chunked) = out
    assert whole == pytest.approx(chunked, rel=1e-5) and whole == pytest.approx(96 * torch.log(torch.tensor(300.0)).item(), rel=0.05)
    for n, g in g_whole.items():
        assert torch.allclose(g, g_chunked[n], rtol=0, atol=1e-2 * float(g_chunked[n].abs().max())), n  # bf16: 2⁻⁸
