"""contract.quant, the one owner of the quantization schemes: its names are the ones rust_runtime, serve.load, the
server's SHALIK_QUANTIZE and the export command lines accept; bad names, backends and shapes are clear errors."""

from __future__ import annotations

import pytest

from contract import quant as Q

# Spellings that are not names: each must be refused by Python, and if rust_runtime accepts one it must come back
# as one of Python's names (never as a name of its own).
PROBES = ("q8", "int8_0", "f32", "float32", "int4", "q4-0", "q4", "q4_k_m", "q4_k", "fp8", "")


def test_one_list_of_names_and_what_each_backend_offers():
    assert Q.NAMES == ("none", "q8_0", "q4_0", "q4_mix")
    assert Q.BACKEND_NAMES["onnx"] == Q.NAMES
    assert Q.BACKEND_NAMES["rust"] == Q.NAMES   # rust_runtime quantizes to every scheme at load (issue 27)
    assert {n: (s.bits, s.block, s.onnx, s.gguf, s.gguf_by) for n, s in {**Q.SCHEMES, **Q.GGUF_ONLY}.items()} == {
        "q8_0": (8, 32, True, "q8_0", "gguf-py"), "q4_0": (4, 32, True, "q4_0", "gguf-py"),
        "q4_mix": (4, 32, True, None, None), "q4_k_m": (4, 256, False, "q4_k_m", "llama.cpp")}
    from export.gguf_quant import TYPES  # GGUF types are llama.cpp's names

    assert TYPES == ("f32", "f16", "q8_0", "q4_0", "q4_k_m")
    from contract.bundle import ONNX_GRAPHS  # the file names are the bundle contract's

    assert ONNX_GRAPHS == {None: "model.onnx", "q8_0": "model.q8_0.onnx", "q4_0": "model.q4_0.onnx",
                           "q4_mix": "model.q4_mix.onnx"}
    for s in Q.SCHEMES.values():
        assert s.keep_8bit <= set(Q.ROLES) and s.thresholds is Q.GATE[s.bits]
        assert {r for r in Q.ROLES if s.bits_of(r) == 8} == (set(Q.ROLES) if s.bits == 8 else set(s.keep_8bit))
    # the plan in rust_runtime.QUANTIZE_PLAN's form (issue 27 part K, src/quant.rs)
    kept = {n: {r for r, k in Q.plan(n).items() if k == "q8_0"} for n in Q.NAMES}
    assert kept == {"none": set(), "q8_0": set(Q.ROLES), "q4_0": set(),                  # pure: the head too
                    "q4_mix": {"embed_tokens", "lm_head", "v_proj", "down_proj"}}
    assert set(Q.plan("q4_0").values()) == {"q4_0"} and Q.plan("q4_mix")["gate_proj"] == "q4_0"
    assert set(Q.plan("none").values()) == {None}
    assert Q.GGUF_ONLY["q4_k_m"].block_of("q_proj") == 256 and Q.SCHEMES["q4_mix"].block_of("down_proj") == 32
    # 4 bits are allowed more than 8, never less
    g8, g4 = Q.GATE[8], Q.GATE[4]
    assert g4.val_nll_delta_max >= g8.val_nll_delta_max and g4.top1_agreement_min <= g8.top1_agreement_min
    assert g4.mean_abs_top_logprob_delta_max >= g8.mean_abs_top_logprob_delta_max


@pytest.mark.parametrize("value,want", [(None, None), ("none", None), ("NONE", None), (" q8_0 ", "q8_0"),
                                        ("Q4_0", "q4_0"), ("q4_MIX", "q4_mix")])
def test_parse_gives_the_scheme_and_passes_a_parsed_one_through(value, want):
    s = Q.parse(value)
    assert s is (None if want is None else Q.SCHEMES[want]) and Q.name_of(s) == (want or "none")
    assert Q.parse(s) is s


@pytest.mark.parametrize("value", [*PROBES, 8, b"q8_0"])
def test_parse_refuses_what_is_not_a_name(value):
    with pytest.raises(Q.QuantizeError, match=r"SHALIK_QUANTIZE is .*; expected one of none, q8_0, q4_0, q4_mix"):
        Q.parse(value, "SHALIK_QUANTIZE")


def test_an_unknown_name_is_one_line_listing_the_names_not_the_aliases():
    with pytest.raises(Q.QuantizeError) as e:
        Q.parse("int4")
    assert str(e.value) == "quantize is 'int4'; expected one of none, q8_0, q4_0, q4_mix"


@pytest.mark.parametrize("value", ["int8", " INT8 "])
def test_int8_is_q8_0_with_a_deprecation_line(value, caplog):
    """The old name gives the very scheme of its new one, and one warning line naming both."""
    with caplog.at_level("WARNING", logger="shalik.quant"):
        assert Q.parse(value) is Q.SCHEMES["q8_0"]
        assert Q.parse(value, "SHALIK_QUANTIZE").name == "q8_0"
    assert [r.getMessage() for r in caplog.records] == ["quantize 'int8' is deprecated: use 'q8_0'",
                                                        "SHALIK_QUANTIZE 'int8' is deprecated: use 'q8_0'"]
    assert set(Q.ALIASES) & set(Q.NAMES) == set() and set(Q.ALIASES.values()) <= set(Q.SCHEMES)
    caplog.clear()
    assert Q.parse("q8_0") is Q.SCHEMES["q8_0"] and not caplog.records   # the new name says nothing


def test_int8_serves_the_same_numbers_as_q8_0_in_every_backend(bundle, caplog):
    """serve.load (ONNX and Rust), the server's settings and rust_runtime.Model.load take the old name as q8_0,
    each saying so once, with logits bit-identical to the new name's."""
    import numpy as np

    import rust_runtime
    from serve import load
    from serve.http.settings import Settings

    ids = [0, 5, 9, 17, 33, 4]
    for backend in ("onnx", "rust"):
        new = load(bundle, backend=backend, quantize="q8_0")
        with caplog.at_level("WARNING", logger="shalik.quant"):
            old = load(bundle, backend=backend, quantize="int8")
        assert old.backend.quantize == "q8_0"
        assert np.array_equal(old.backend.logits(ids), new.backend.logits(ids)), backend
    assert [r.getMessage() for r in caplog.records] == ["quantize 'int8' is deprecated: use 'q8_0'"] * 2
    caplog.clear()
    with caplog.at_level("WARNING"):
        m = rust_runtime.Model.load(str(bundle), threads=1, quantize="int8")
    assert m.quantize == "q8_0"
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("rust_runtime", "quantize 'int8' is deprecated: use 'q8_0'")]
    q8 = rust_runtime.Model.load(str(bundle), threads=1, quantize="q8_0")
    assert np.array_equal(np.asarray(m.logits(ids)), np.asarray(q8.logits(ids)))
    caplog.clear()
    with caplog.at_level("WARNING", logger="shalik.quant"):
        s = Settings.from_env({"SHALIK_QUANTIZE": "int8", "SHALIK_BACKEND": "rust", "SHALIK_MODEL": str(bundle)})
    assert s.quantize is Q.SCHEMES["q8_0"]
    assert [r.getMessage() for r in caplog.records] == ["SHALIK_QUANTIZE 'int8' is deprecated: use 'q8_0'"]


def test_check_backend_names_what_is_offered_and_where(monkeypatch):
    """Every backend offers every name today; a backend without a scheme (as rust was before issue 27) is refused
    naming what it offers and which backend has the scheme."""
    monkeypatch.setitem(Q.BACKEND_NAMES, "rust", ("none", "q8_0"))
    Q.check_backend(None, "rust")
    Q.check_backend(Q.SCHEMES["q4_mix"], "onnx")
    with pytest.raises(Q.QuantizeError, match=r"quantize is 'Q4_K_M'; expected one of none, q8_0, q4_0, q4_mix "
                                              r"\(q4_k_m is llama.cpp's GGUF mix: python -m export.gguf BUNDLE --type "
                                              r"q4_k_m\)"):
        Q.parse("Q4_K_M")
    for name in ("q4_0", "q4_mix"):
        with pytest.raises(Q.QuantizeError, match=rf"'{name}' is not offered by the rust backend \(it offers "
                                                  r"none, q8_0\); use backend 'onnx'"):
            Q.check_backend(Q.SCHEMES[name], "rust")


def test_check_shape_refuses_rows_that_do_not_fill_blocks():
    q4, km = Q.SCHEMES["q4_0"], Q.GGUF_ONLY["q4_k_m"]
    Q.check_shape(q4, "model.layers.0.mlp.down_proj.weight", (64, 1280))
    Q.check_shape(q4, "model.norm.weight", (48,))                       # norms are never quantized
    with pytest.raises(Q.QuantizeError, match=r"model.layers.0.mlp.down_proj.weight \[64, 48\]: q4_0 quantizes it in "
                                              r"blocks of 32 .* 48 input features.*fit: none \(keep it float32\)"):
        Q.check_shape(q4, "model.layers.0.mlp.down_proj.weight", (64, 48))
    with pytest.raises(Q.QuantizeError, match=r"q_proj.weight \[64, 64\]: q4_k_m .* blocks of 256 .*fit: q8_0, q4_0, "
                                              r"q4_mix$"):
        Q.check_shape(km, "model.layers.1.self_attn.q_proj.weight", (64, 64))
    with pytest.raises(Q.QuantizeError, match="not a quantizable weight"):
        Q.role_of("model.layers.0.input_layernorm.weight")
    assert Q.role_of("lm_head.weight") == "lm_head" and Q.role_of("model.embed_tokens.weight") == "embed_tokens"


def test_rust_runtime_has_python_s_list_of_names(bundle):
    """Rust's list of quantization names is contract.quant's: rust_runtime.QUANTIZE_NAMES and QUANTIZE_PLAN equal
    NAMES and plan(); Model.load(quantize=...)
    takes exactly the names of BACKEND_NAMES["rust"] and reports each back, refuses every other name of NAMES naming
    it (so contract.quant says rust=True exactly where Rust has the scheme), and answers no spelling with a name of its
    own."""
    import rust_runtime  # built by `pip install -e ".[all]"` (README)
    assert tuple(rust_runtime.QUANTIZE_NAMES) == Q.NAMES
    assert {n: dict(p) for n, p in rust_runtime.QUANTIZE_PLAN.items()} == {n: Q.plan(n) for n in Q.NAMES}
    for name in Q.NAMES:
        if name in Q.BACKEND_NAMES["rust"]:
            m = rust_runtime.Model.load(str(bundle), threads=1, quantize=name, verify=False, allow_ungated=True)
            assert m.quantize == name
        else:
            with pytest.raises(ValueError, match=name):
                rust_runtime.Model.load(str(bundle), threads=1, quantize=name, verify=False)
    for probe in PROBES:
        try:
            m = rust_runtime.Model.load(str(bundle), threads=1, quantize=probe, verify=False, allow_ungated=True)
        except ValueError:
            continue
        assert m.quantize in Q.BACKEND_NAMES["rust"], f"rust_runtime accepts {probe!r} as {m.quantize!r}"


def test_serve_load_and_settings_refuse_a_scheme_the_backend_lacks(bundle, monkeypatch):
    from serve import load
    from serve.backends.base import BackendError
    from serve.http.settings import Settings, SettingsError

    assert load(bundle, backend="rust", quantize="Q4_MIX", verify=False,
                allow_ungated=True).backend.quantize == "q4_mix"   # names, not the gate, are what this test holds
    monkeypatch.setitem(Q.BACKEND_NAMES, "rust", ("none", "q8_0"))   # a backend without the 4-bit schemes
    for name in ("q4_0", "q4_mix"):
        with pytest.raises(ValueError, match=rf"quantize '{name}' is not offered by the rust backend"):
            load(bundle, backend="rust", quantize=name)
        with pytest.raises(SettingsError, match=rf"SHALIK_QUANTIZE '{name}' is not offered by the rust backend.*"
                                                r"SHALIK_BACKEND=rust"):
            Settings.from_env({"SHALIK_QUANTIZE": name, "SHALIK_BACKEND": "rust"})
    with pytest.raises(BackendError, match=r"model.q4_0.onnx: no such ONNX graph .*export with --quantize q4_0"):
        load(bundle, backend="onnx", quantize="q4_0", verify=False)   # the fixture bundle has q8_0 only
    with pytest.raises(SettingsError, match=r"SHALIK_QUANTIZE='q4_k_m': expected one of none, q8_0, q4_0, q4_mix"):
        Settings.from_env({"SHALIK_QUANTIZE": "q4_k_m"})
    assert Settings.from_env({"SHALIK_QUANTIZE": "Q4_0", "SHALIK_MODEL": str(bundle)}).quantize is Q.SCHEMES["q4_0"]


def test_serve_generate_parses_its_quantize_once(capsys, caplog):
    """python -m serve.generate --quantize: a name or an old name (with the deprecation line) becomes the Scheme that
    load() takes; an unknown name is argparse's one-line error, exit 2."""
    from serve.generate import parse_args

    assert parse_args(["b", "--quantize", "q4_mix"]).quantize is Q.SCHEMES["q4_mix"]
    assert parse_args(["b"]).quantize is None
    with caplog.at_level("WARNING", logger="shalik.quant"):
        assert parse_args(["b", "--quantize", "int8"]).quantize is Q.SCHEMES["q8_0"]
    assert [r.getMessage() for r in caplog.records] == ["--quantize 'int8' is deprecated: use 'q8_0'"]
    with pytest.raises(SystemExit) as e:
        parse_args(["b", "--quantize", "int4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.endswith("--quantize is 'int4'; expected one of none, q8_0, q4_0, q4_mix")
