"""The export's quality gate at load (serve.verdict, rust_runtime's integrity.rs) and the manifest's version with any
``verify``: a quantized form the gate failed, or never measured, is refused naming the form, the figure and the
threshold unless ``allow_ungated``, which logs what it overrides; a bundle of a newer major version is refused by
``serve.load``, the server and ``rust_runtime.Model.load`` with ``verify=False`` too. Also how the gate's table
prints its figures (at the rule's precision) and what it measures beside them (greedy continuations)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from contract.bundle import MANIFEST, BundleError, read_manifest, update_manifest
from serve import load
from serve.http.lifecycle import ServerState
from serve.http.settings import Settings, SettingsError
from serve.verdict import UngatedError, check_form, fmt_figure, fmt_limit, verdict

rust_runtime = pytest.importorskip("rust_runtime")

TH8 = {"val_nll_delta_max": 0.05, "top1_agreement_min": 0.85, "mean_abs_top_logprob_delta_max": 0.1}


def figs(delta=0.0, top1=0.99, lp=0.01, tokens=100):
    return {"nll_f32": 4.0, "nll": 4.0 + delta, "delta": delta, "top1_agreement": top1,
            "mean_abs_top_logprob_delta": lp, "tokens": tokens}


def form(runtime: str, ok, bn=None, en=None, note=None):
    by = {"bn": {**(bn or figs()), "ok": ok is not False}, "en": {**(en or figs()), "ok": True}}
    entry = {"scheme": "q8_0", "bits": 8, "block": 32, "keep_8bit": [], "summary": "", "runtime": runtime,
             "file": None, "thresholds": TH8, "all": {**figs(), "ok": True}, "by_lang": by, "ok": ok}
    return {k: v for k, v in entry.items() if ok is not None or k not in ("all", "by_lang")} | (
        {"note": note} if note else {})


@pytest.fixture
def gated(bundle, tmp_path):
    """A copy of the fixture bundle whose gate failed q8_0 in both runtimes (Bangla top-1 0.737 < 0.85)."""
    d = tmp_path / "bundle"
    shutil.copytree(bundle, d)
    bad = figs(top1=0.737)
    update_manifest(d, quantization={"data": "val", "tokens": 200, "reference": "onnx float32 (model.onnx)", "forms": {
        "onnx q8_0": form("onnx", False, bn=bad), "rust q8_0": form("rust", False, bn=bad),
        "rust q4_mix": form("rust", None, note="step 0 (random init)")}})
    return d


FAILED = r"q8_0 failed the export's quality gate \(bn: top-1 agreement with fp32 0\.737 < 0\.85\)"


def test_a_failed_form_is_refused_in_every_loader_naming_the_form_the_figure_and_the_threshold(gated):
    with pytest.raises(UngatedError, match=rf"onnx {FAILED}; serve a form that passed \(none passed.*allow_ungated"):
        load(gated, backend="onnx", quantize="q8_0")
    for call in (lambda: load(gated, backend="rust", quantize="q8_0"),
                 lambda: load(gated, backend="rust", quantize="q8_0", verify=False),
                 lambda: rust_runtime.Model.load(str(gated), quantize="q8_0"),
                 lambda: rust_runtime.Model.load(str(gated), quantize="q8_0", verify=False)):
        with pytest.raises(ValueError, match=rf"rust {FAILED}; .*allow_ungated=True \(--allow-ungated, SHALIK_ALLOW_UNGATED=1\)"):
            call()
    # float32 needs no verdict
    assert load(gated, backend="rust").backend.quantize == "none"


def test_allow_ungated_loads_it_and_logs_what_it_overrides(gated, caplog):
    with caplog.at_level(logging.WARNING):
        assert load(gated, backend="onnx", quantize="q8_0", allow_ungated=True).backend.quantize == "q8_0"
        assert load(gated, backend="rust", quantize="q8_0", allow_ungated=True).backend.quantize == "q8_0"
        m = rust_runtime.Model.load(str(gated), quantize="q8_0", allow_ungated=True)
    assert m.quantize == "q8_0"
    logged = [(r.name, r.getMessage()) for r in caplog.records]
    assert [n for n, msg in logged if "allow_ungated overrides the gate" in msg] == [
        "shalik.serve", "rust_runtime", "rust_runtime"], logged
    assert all(f"serving {rt} q8_0 failed the export's quality gate (bn: top-1 agreement with fp32 0.737 < 0.85)"
               in msg for (n, msg), rt in zip(logged, ("onnx", "rust", "rust")))


def test_a_form_without_a_verdict_is_refused_saying_how_to_get_one(gated):
    with pytest.raises(ValueError, match=r"rust q4_mix has no quality-gate verdict \(not measured: step 0 "
                                           r"\(random init\)\); export the bundle again .*python -m export.onnx"):
        load(gated, backend="rust", quantize="q4_mix")
    with pytest.raises(ValueError, match=r"rust q4_0 has no quality-gate verdict \(manifest.json records no "
                                           r"quality-gate verdict for it\)"):
        rust_runtime.Model.load(str(gated), quantize="q4_0")
    (gated / MANIFEST).unlink()   # a hand-made folder, loaded unverified: no verdict either
    with pytest.raises(ValueError, match=r"rust q8_0 has no quality-gate verdict \(the bundle has no manifest.json\)"):
        load(gated, backend="rust", quantize="q8_0", verify=False)
    with pytest.raises(UngatedError, match=r"onnx q8_0 has no quality-gate verdict \(the bundle has no manifest"):
        load(gated, backend="onnx", quantize="q8_0", verify=False)
    assert load(gated, backend="onnx", quantize="q8_0", verify=False, allow_ungated=True).backend.quantize == "q8_0"


def test_the_server_refuses_an_ungated_form_unless_allowed_and_health_lists_the_verdicts(gated):
    env = {"SHALIK_MODEL": str(gated), "SHALIK_BACKEND": "rust", "SHALIK_QUANTIZE": "q8_0"}
    state = ServerState(Settings.from_env(env), None)
    state._load()
    assert state.lm is None and "rust q8_0 failed the export's quality gate (bn: top-1 agreement" in state.problem
    assert state.health()[0] == 503
    state = ServerState(Settings.from_env({**env, "SHALIK_ALLOW_UNGATED": "1"}), None)
    state._load()
    code, health = state.health()
    assert code == 200 and health.quantize == "q8_0" and health.ungated is True
    assert health.quantized_forms == {"onnx q8_0": False, "rust q8_0": False, "rust q4_mix": None}
    with pytest.raises(SettingsError, match="SHALIK_ALLOW_UNGATED='maybe': expected 1 or 0"):
        Settings.from_env({"SHALIK_ALLOW_UNGATED": "maybe"})


def test_the_fixture_export_gates_every_rust_form_and_a_passed_form_loads(bundle):
    forms = read_manifest(bundle)["quantization"]["forms"]
    assert {"onnx q8_0", "rust q8_0", "rust q4_0", "rust q4_mix"} <= set(forms)
    assert forms["rust q8_0"]["ok"] is True and forms["onnx q8_0"]["ok"] is True
    assert load(bundle, backend="rust", quantize="q8_0").backend.quantize == "q8_0"
    for name in ("rust q4_0", "rust q4_mix"):
        v = verdict(read_manifest(bundle), *name.split())
        assert v.ok is forms[name]["ok"] is not None
        c = forms[name]["continuations"]
        assert c["prompt_tokens"] >= 1 and c["new_tokens"] >= 1
        assert all(0 <= x["identical"] <= x["prompts"] == 10 for x in c["by_lang"].values()), c


def test_newer_major_version_is_refused_with_any_verify(bundle, tmp_path):
    d = tmp_path / "newer"
    shutil.copytree(bundle, d)
    m = json.loads((d / MANIFEST).read_text())
    m["format_version"] += 1
    (d / MANIFEST).write_text(json.dumps(m))
    newer = rf"format_version {m['format_version']} is newer than this reader's {m['format_version'] - 1}"
    for verify in (True, False):
        for backend in ("onnx", "rust"):
            with pytest.raises(BundleError, match=newer):
                load(d, backend=backend, verify=verify)
        with pytest.raises(RuntimeError, match=newer):
            rust_runtime.Model.load(str(d), verify=verify)
    state = ServerState(Settings.from_env({"SHALIK_MODEL": str(d), "SHALIK_VERIFY": "0"}), None)
    state._load()
    assert state.lm is None and "is newer than this reader's" in state.problem


def test_check_form_passes_float32_and_a_passed_form_silently(caplog):
    m = {"quantization": {"forms": {"onnx q8_0": form("onnx", True)}}}
    with caplog.at_level(logging.WARNING):
        assert check_form(m, "b", "onnx", None) is None
        assert check_form(m, "b", "onnx", "q8_0").ok is True
    assert not caplog.records


def test_figures_print_at_the_precision_of_the_rule():
    assert [fmt_limit(x) for x in (0.85, 0.1, 0.25, 0.05)] == ["0.85", "0.10", "0.25", "0.05"]
    assert fmt_figure(0.853, 0.85) == "0.853" and fmt_figure(0.112, 0.1, signed=True) == "+0.112"
    assert fmt_figure(0.8496, 0.85) == "0.8496"   # three decimals would read as the threshold
    assert fmt_figure(0.85, 0.85) == "0.850"


def test_the_gate_table_shows_each_rule_and_figure_as_the_rule_states_it():
    from export import gate as G
    from export.card import _quantization_section
    from export.parity import format_table

    entry = {"tokens": 200, "forms": {"rust q4_0": {**form("rust", False, bn=figs(0.112, 0.737, 0.064)), "bits": 4,
                                                    "thresholds": {**TH8, "val_nll_delta_max": 0.1,
                                                                   "mean_abs_top_logprob_delta_max": 0.25}}}}
    table = format_table(G.cases(entry))
    assert "e-01" not in table and "e-02" not in table
    row = next(line for line in table.splitlines() if "bn: top-1" in line)
    assert "0.737" in row and "≥ 0.85" in row and "FAIL" in row
    row = next(line for line in table.splitlines() if "bn: val NLL change" in line)
    assert "0.112" in row and "≤ 0.10" in row
    card = "\n".join(_quantization_section(entry))
    assert "Δ NLL ≤ 0.10 nats/token, top-1 agreement ≥ 0.85, mean abs Δ log p ≤ 0.25 nats" in card
    assert "| rust q4_0 | quantized at load | bn | +0.112 | 0.737 | 0.064 |" in card
    assert "**No 4-bit form passes the gate for this model** (rust q4_0)" in card
    with pytest.raises(G.QualityGateError, match=r"no 4-bit form passes the gate on this model \(rust q4_0\)"):
        G.enforce(entry, "no bundle was written", log=lambda m: None)


class _Seq:
    """A KV cache whose next token is ``f(ids so far)``."""

    def __init__(self, f):
        self.f, self.ids = f, []

    def _logits(self):
        out = np.zeros(16, np.float32)
        out[self.f(self.ids)] = 1
        return out

    def prefill(self, ids):
        self.ids += list(ids)
        return self._logits()

    def decode(self, t):
        self.ids.append(t)
        return self._logits()


def test_continuations_count_the_greedy_continuations_identical_to_float32():
    from contract.quant import SCHEMES
    from export import gate as G
    from export.valdata import ValData

    val = ValData({"bn": [np.arange(200) % 16], "en": [np.arange(200) % 7]}, "test")
    ref = lambda: _Seq(lambda ids: (ids[-1] + 1) % 16)   # noqa: E731
    same = G.Form("rust", SCHEMES["q8_0"], None, None, ref)
    # differs only once the continuation passes 40 ids: every continuation of 64 tokens differs
    late = G.Form("rust", SCHEMES["q4_0"], None, None,
                  lambda: _Seq(lambda ids: 0 if len(ids) > 40 else (ids[-1] + 1) % 16))
    out = G.continuations(ref, [same, late], val)
    assert out["rust q8_0"] == {"prompt_tokens": 32, "new_tokens": 64,
                                "by_lang": {"bn": {"identical": 10, "prompts": 10},
                                            "en": {"identical": 10, "prompts": 10}}}
    assert [v["identical"] for v in out["rust q4_0"]["by_lang"].values()] == [0, 0]
