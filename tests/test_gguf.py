"""export.gguf: keys (case X6), the q/k permutation (case X7), tensor types, tying, bad input, and — when
llama-cpp-python is importable — llama.cpp's logits and greedy continuations against ours.

Everything but the llama.cpp tests reads the GGUF back with the ``gguf`` package's reader; no llama.cpp needed.
The llama.cpp tests are ``slow``: they need the ``bench`` extra (llama-cpp-python, a source build), so the default
suite does not run them (``pip install -e ".[bench]" && pytest -m slow tests/test_gguf.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, LlamaFileType, TokenType
from gguf.quants import dequantize
from safetensors.numpy import load_file, save_file

from export import gguf as G
from export.errors import ExportError
from serve.backends.llamacpp import LlamaCppBackend

THETA = 50000.0


# ---------------------------------------------------------------- fixtures and helpers

def _copy_bundle(src: Path, dst: Path, **config) -> Path:
    """A copy of ``src`` (graphs left out) with config.json keys replaced by ``config``."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and not (p.name.startswith("model.") and p.name.endswith(".onnx")) and p.suffix != ".data":
            shutil.copyfile(p, dst / p.name)
    c = json.loads((dst / "config.json").read_text())
    c.update(config)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.fixture(scope="module")
def theta_bundle(bundle, tmp_path_factory) -> Path:
    """The trained tiny bundle with rope_theta 50000 (top level and rope_parameters), X6's non-default theta."""
    return _copy_bundle(bundle, tmp_path_factory.mktemp("theta") / "bundle", rope_theta=THETA,
                        rope_parameters={"rope_type": "default", "rope_theta": THETA})


@pytest.fixture(scope="module")
def untied_bundle(bundle, tmp_path_factory) -> Path:
    """The tiny bundle untied: its own lm_head.weight (the embedding plus noise)."""
    out = _copy_bundle(bundle, tmp_path_factory.mktemp("untied") / "bundle", tie_word_embeddings=False)
    sd = load_file(out / "model.safetensors")
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = (emb + np.random.default_rng(0).normal(0, 0.01, emb.shape)).astype(np.float32)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def gguf_files(theta_bundle, tmp_path_factory) -> dict[str, Path]:
    """The theta bundle exported at every --type that gguf-py writes (its rows of 64 are too short for q4_k_m's
    super-blocks of 256: see test_k_quant_blocks_and_missing_quantizer_are_clear_errors)."""
    d = tmp_path_factory.mktemp("gguf")
    return {t: G.export_gguf(theta_bundle, d / f"m-{t}.gguf", t, log=lambda m: None, approximate_pretokenizer=True)
            for t in G.TYPES if t != "q4_k_m"}


@pytest.fixture(scope="module")
def wide_bundle(bundle, tmp_path_factory) -> Path:
    """A random-init bundle whose rows fill llama.cpp's super-blocks of 256 (hidden 256, intermediate 512, one
    layer, the tiny bundle's tokenizer and vocabulary); no ONNX graph, no validation data."""
    out = _copy_bundle(bundle, tmp_path_factory.mktemp("wide") / "bundle", hidden_size=256, intermediate_size=512,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    c = json.loads((out / "config.json").read_text())
    v, h, kv, i = c["vocab_size"], 256, 2 * 64, 512
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (h, h), "model.layers.0.self_attn.k_proj.weight": (kv, h),
              "model.layers.0.self_attn.v_proj.weight": (kv, h), "model.layers.0.self_attn.o_proj.weight": (h, h),
              "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
              "model.layers.0.mlp.down_proj.weight": (h, i)}
    sd = {k: (np.ones(s) if len(s) == 1 else rng.normal(0, 0.05, s)).astype(np.float32) for k, s in shapes.items()}
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def read(path: Path) -> tuple[dict, dict]:
    """({key: value} without the token arrays' contents, {tensor name: ReaderTensor})."""
    r = GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}, {t.name: t for t in r.tensors}


def f32(t) -> np.ndarray:
    """A float32/float16 ReaderTensor as a float32 ``[out, in]`` (or ``[n]``) array."""
    return np.asarray(t.data, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))


@pytest.fixture(scope="module")
def weights(theta_bundle) -> dict[str, np.ndarray]:
    return load_file(theta_bundle / "model.safetensors")


@pytest.fixture(scope="module")
def cfg(theta_bundle) -> dict:
    return json.loads((theta_bundle / "config.json").read_text())


# ---------------------------------------------------------------- permutation

def test_permute_qk_moves_rows_into_interleaved_pairs():
    w = np.arange(8, dtype=np.float32)[:, None]  # 2 heads of head_dim 4: rows (0 1 | 2 3), (4 5 | 6 7)
    assert G.permute_qk(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert G.permute_qk(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    rng = np.random.default_rng(0).normal(size=(24, 5))
    for n in (1, 2, 3, 6, 12):
        np.testing.assert_array_equal(G.unpermute_qk(G.permute_qk(rng, n), n), rng)
    with pytest.raises(ValueError, match="heads of even size"):
        G.permute_qk(rng, 5)


# ---------------------------------------------------------------- keys (X6) and tokenizer

def test_keys_x6(gguf_files, cfg, theta_bundle):
    kv, _ = read(gguf_files["f32"])
    assert kv["general.architecture"] == "llama"
    assert kv["llama.rope.freq_base"] == THETA  # X6: the config's theta, not 10000
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5, rel=1e-6)
    expect = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
              "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
              "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16,
              "vocab_size": cfg["vocab_size"]}
    assert {k: kv[f"llama.{k}"] for k in expect} == expect
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["hidden_size"] == 64
    assert kv["general.file_type"] == LlamaFileType.ALL_F32

    tok = json.loads((theta_bundle / "tokenizer.json").read_text())
    by_id = {i: s for s, i in tok["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tok["added_tokens"]}
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "deepseek-v3"
    assert kv[G.PRETOKENIZER_KEY] == "exact:deepseek-v3"
    assert kv["tokenizer.ggml.tokens"] == [by_id[i] for i in range(cfg["vocab_size"])]
    types = kv["tokenizer.ggml.token_type"]
    control = [TokenType.CONTROL, TokenType.CONTROL]
    assert types[:2] == control and types[-2:] == control and set(types[2:-2]) == {TokenType.NORMAL}
    assert kv["tokenizer.ggml.tokens"][:2] == ["<|endoftext|>", "<|pad|>"]
    assert kv["tokenizer.ggml.tokens"][-2:] == ["<|im_start|>", "<|im_end|>"]  # the chat tokens, the last ids
    # a base model: its tokenizer reserves the chat tokens, but it gets no chat template and no end-of-turn token
    # (a chat model's GGUF: test_chat_clients.py::test_gguf_and_modelfile_carry_the_chat_format)
    assert "tokenizer.ggml.eot_token_id" not in kv and "tokenizer.chat_template" not in kv
    merges = tok["model"]["merges"]
    assert len(kv["tokenizer.ggml.merges"]) == len(merges)
    assert kv["tokenizer.ggml.merges"][0] == " ".join(merges[0])
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"],
            kv["tokenizer.ggml.padding_token_id"]) == (0, 0, 1)
    assert kv["tokenizer.ggml.add_bos_token"] is True  # llama.cpp prepends <|endoftext|> as serve does


def test_missing_rope_theta_is_an_error_not_10000(bundle, tmp_path):
    b = _copy_bundle(bundle, tmp_path / "b")
    c = json.loads((b / "config.json").read_text())
    c.pop("rope_theta")
    c.pop("rope_parameters")
    (b / "config.json").write_text(json.dumps(c))
    with pytest.raises(ExportError, match="no rope_theta"):
        G.export_gguf(b, tmp_path / "x.gguf", log=lambda m: None, approximate_pretokenizer=True)
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------- tensors (X7)

def test_f32_tensors_roundtrip_bitwise_x7(gguf_files, weights, cfg):
    _, ts = read(gguf_files["f32"])
    n_head, n_kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    assert set(ts) == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(layers) for n in G.LAYER_TENSORS.values()}  # tied: no output
    for i in range(layers):
        q, k = f32(ts[f"blk.{i}.attn_q.weight"]), f32(ts[f"blk.{i}.attn_k.weight"])
        hf_q, hf_k = weights[f"model.layers.{i}.self_attn.q_proj.weight"], weights[f"model.layers.{i}.self_attn.k_proj.weight"]
        np.testing.assert_array_equal(G.unpermute_qk(q, n_head), hf_q)
        np.testing.assert_array_equal(G.unpermute_qk(k, n_kv), hf_k)
        assert not np.array_equal(G.unpermute_qk(k, n_head), hf_k)  # X7: the query head count does not round-trip
        assert not np.array_equal(q, hf_q)  # it is permuted at all
        for hf, gg in G.LAYER_TENSORS.items():
            if gg not in ("attn_q", "attn_k"):
                np.testing.assert_array_equal(f32(ts[f"blk.{i}.{gg}.weight"]), weights[f"model.layers.{i}.{hf}.weight"])
    np.testing.assert_array_equal(f32(ts["token_embd.weight"]), weights["model.embed_tokens.weight"])
    np.testing.assert_array_equal(f32(ts["output_norm.weight"]), weights["model.norm.weight"])


ROLE = {"token_embd": "embed_tokens", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
        "ffn_down": "down_proj", "ffn_gate": "gate_proj"}


@pytest.mark.parametrize("kind,qtype,ftype", [("f16", Q.F16, LlamaFileType.MOSTLY_F16),
                                              ("q8_0", Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
                                              ("q4_0", Q.Q4_0, LlamaFileType.MOSTLY_Q4_0)])
def test_reduced_types_and_shapes(gguf_files, weights, cfg, kind, qtype, ftype):
    """Every 2-D weight at the type's ggml type (q4_0: every matrix, the tied token_embd too), norms F32, shapes in
    ggml order, values close to the weights."""
    kv, ts = read(gguf_files[kind])
    assert kv["general.file_type"] == ftype
    h, kvh, inter = cfg["hidden_size"], cfg["num_key_value_heads"] * 16, cfg["intermediate_size"]
    shapes = {"token_embd": [h, cfg["vocab_size"]], "blk.0.attn_q": [h, h], "blk.0.attn_k": [h, kvh],
              "blk.0.attn_v": [h, kvh], "blk.0.ffn_down": [inter, h], "blk.1.ffn_gate": [h, inter]}
    for name, shape in shapes.items():
        t = ts[f"{name}.weight"]
        assert t.tensor_type == qtype and t.shape.tolist() == shape  # ggml order: [in, out]
    assert ts["token_embd.weight"].tensor_type == qtype
    for name in ("blk.0.attn_norm", "blk.1.ffn_norm", "output_norm"):
        assert ts[f"{name}.weight"].tensor_type == Q.F32
    v = weights["model.layers.0.self_attn.v_proj.weight"]
    t = ts["blk.0.attn_v.weight"]
    got = dequantize(t.data, t.tensor_type).reshape(v.shape)
    rel = np.abs(got - v).max() / np.abs(v).max()
    assert rel < {Q.F16: 1e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15}[t.tensor_type] and rel > 0
    q = dequantize(ts["blk.1.attn_q.weight"].data, ts["blk.1.attn_q.weight"].tensor_type).reshape(h, h)
    hf_q = weights["model.layers.1.self_attn.q_proj.weight"]
    assert np.abs(G.unpermute_qk(q, 4) - hf_q).max() < {"f16": 1e-3, "q8_0": 2e-2}.get(kind, 0.15 * np.abs(hf_q).max())
    if kind == "q8_0":
        assert t.data.dtype == np.uint8 and t.data.shape == (v.shape[0], v.shape[1] // 32 * 34)
    if qtype == Q.Q4_0 and t.tensor_type == Q.Q4_0:
        assert t.data.shape == (v.shape[0], v.shape[1] // 32 * 18)     # 16 bytes of nibbles + an f16 scale


def test_untied_has_output(untied_bundle, tmp_path):
    out = G.export_gguf(untied_bundle, tmp_path / "u.gguf", log=lambda m: None, approximate_pretokenizer=True)
    _, ts = read(out)
    lm = load_file(untied_bundle / "model.safetensors")["lm_head.weight"]
    np.testing.assert_array_equal(f32(ts["output.weight"]), lm)
    assert not np.array_equal(f32(ts["token_embd.weight"]), lm)


# ---------------------------------------------------------------- bad input, default path, atomicity

def test_bad_input_and_overwrite(bundle, tmp_path, capsys):
    b = _copy_bundle(bundle, tmp_path / "b")
    with pytest.raises(ExportError, match="not a bundle"):
        G.export_gguf(tmp_path, log=lambda m: None, approximate_pretokenizer=True)
    with pytest.raises(ExportError, match="not a folder"):
        G.export_gguf(tmp_path / "nope", log=lambda m: None, approximate_pretokenizer=True)
    with pytest.raises(ExportError, match="--type 'q4_1': expected one of f32, f16, q8_0, q4_0, q4_k_m"):
        G.export_gguf(b, type="q4_1", log=lambda m: None, approximate_pretokenizer=True)
    assert G.main([str(tmp_path)]) == 2
    capsys.readouterr()
    assert G.main([str(b), "--type", "q4"]) == 2   # one line naming the type (issue 28), not argparse's usage
    assert capsys.readouterr().err.strip().splitlines() == ["error: --type 'q4': expected one of f32, f16, q8_0, q4_0, q4_k_m"]
    # --val-data that cannot be used is refused before anything is written (it was accepted silently)
    with pytest.raises(ExportError, match="--val-data .*nope: no such file or directory"):
        G.export_gguf(b, type="q8_0", val_data=tmp_path / "nope", log=lambda m: None, approximate_pretokenizer=True)
    with pytest.raises(ExportError, match="--type f32 is not quantized, so it has no quality gate"):
        G.export_gguf(b, type="f32", val_data=b, log=lambda m: None, approximate_pretokenizer=True)
    assert not list(b.glob("*.gguf"))

    out = G.export_gguf(b, type="q8_0", log=lambda m: None, approximate_pretokenizer=True)
    assert out == b / "model-q8_0.gguf" and out.stat().st_size > 0
    first = out.stat().st_mtime_ns
    # the same command again: the manifest records this very file, so there is nothing to do (it exited 2)
    said = []
    assert G.export_gguf(b, type="q8_0", log=said.append, approximate_pretokenizer=True) == out
    assert "nothing to do" in said[0] and out.stat().st_mtime_ns == first
    assert G.main([str(b), "--type", "q8_0", "--approximate-pretokenizer"]) == 0 and out.stat().st_mtime_ns == first
    # the recorded q8_0 file asked for as another type is not "nothing to do" (it said so, and stayed q8_0)
    with pytest.raises(ExportError, match="already exists and is not a GGUF recorded"):
        G.export_gguf(b, out=out, type="f32", log=lambda m: None, approximate_pretokenizer=True)
    # a file the manifest does not vouch for (changed since, or never written by export.gguf) needs --force
    with out.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ExportError, match="already exists and is not a GGUF recorded in .*manifest.*--force"):
        G.export_gguf(b, type="q8_0", log=lambda m: None, approximate_pretokenizer=True)
    other = b / "model-f16.gguf"
    other.write_bytes(b"not written by export.gguf")
    assert G.main([str(b), "--type", "f16", "--approximate-pretokenizer"]) == 2
    assert other.read_bytes() == b"not written by export.gguf"
    other.unlink()
    assert G.main([str(b), "--type", "q8_0", "--force", "--approximate-pretokenizer"]) == 0
    assert sorted(p.name for p in b.iterdir() if p.name.startswith(".")) == []  # no temporary leftovers
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_k_quant_blocks_and_missing_quantizer_are_clear_errors(bundle, wide_bundle, tmp_path, monkeypatch, capsys):
    """q4_k_m: rows of 64 cannot fill super-blocks of 256 (refused, naming the tensor and the types that fit); without
    llama-cpp-python the error names what to install; q4_0 without it is written and recorded as not measured."""
    import builtins

    b = _copy_bundle(bundle, tmp_path / "b")
    before = (b / "manifest.json").read_bytes()
    with pytest.raises(ExportError, match=r"model.embed_tokens.weight \[600, 64\]: --type q4_k_m .* super-blocks of "
                                          r"256 .* 64 input features; types that fit: f32, f16, q8_0, q4_0; no GGUF"):
        G.export_gguf(b, type="q4_k_m", log=lambda m: None, approximate_pretokenizer=True)
    real_import = builtins.__import__

    def no_llama(name, *a, **k):
        if name.startswith("llama_cpp"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    w = _copy_bundle(wide_bundle, tmp_path / "w")
    assert G.main([str(w), "--type", "q4_k_m", "--approximate-pretokenizer"]) == 2
    err = capsys.readouterr().err
    assert "--type q4_k_m needs llama.cpp's quantizer" in err and "pip install llama-cpp-python" in err
    assert "Traceback" not in err and [p.name for p in w.iterdir() if "gguf" in p.name] == []
    assert (b / "manifest.json").read_bytes() == before
    msgs: list[str] = []
    out = G.export_gguf(b, type="q4_0", log=msgs.append, approximate_pretokenizer=True)
    m = json.loads((b / "manifest.json").read_text())
    r = m["quantization"]["forms"]["llama.cpp q4_0"]
    assert r["ok"] is None and "llama-cpp-python is not importable" in r["note"] and r["file"] == out.name
    assert m["files"][out.name]["bytes"] == out.stat().st_size and any("not measured" in x for x in msgs)


def test_failed_write_leaves_nothing(bundle, tmp_path):
    b = _copy_bundle(bundle, tmp_path / "b")
    sd = load_file(b / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, b / "model.safetensors")
    with pytest.raises(ExportError, match="missing.*up_proj"):
        G.export_gguf(b, log=lambda m: None, approximate_pretokenizer=True)
    assert [p.name for p in b.iterdir() if "gguf" in p.name] == []


def test_format_2_bundle_exports_only_as_the_approximation(bundle, tmp_path, capsys):
    """A bundle made with tokenizer format 2 (tests/test_llamacpp_tokenizer.py covers format 3 and the refusals)."""
    from train.tokenizer.pretokenizers import LEGACY, pre_tokenizer_json

    b = _copy_bundle(bundle, tmp_path / "b")
    t = json.loads((b / "tokenizer.json").read_text())
    t["pre_tokenizer"] = pre_tokenizer_json(LEGACY)
    (b / "tokenizer.json").write_text(json.dumps(t, ensure_ascii=False))
    with pytest.raises(G.PretokenizerError, match="format 2.*digits.*ZWJ/ZWNJ.*--approximate-pretokenizer"):
        G.export_gguf(b, log=lambda m: None)
    assert G.main([str(b)]) == 2
    err = capsys.readouterr().err
    assert "llama.cpp has no name for" in err and "Traceback" not in err
    assert [p.name for p in b.iterdir() if "gguf" in p.name] == []
    assert G.main([str(b), "--approximate-pretokenizer"]) == 0
    r = GGUFReader(str(b / "model-f32.gguf"))
    assert r.fields["tokenizer.ggml.pre"].contents() == G.APPROXIMATE_PRE
    assert r.fields[G.PRETOKENIZER_KEY].contents() == "approximate:qwen35"
    assert "approximate:qwen35" in r.fields["general.description"].contents()


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


# ---------------------------------------------------------------- llama.cpp (optional)

@pytest.mark.slow
def test_quantized_gguf_passes_or_fails_the_quality_gate(bundle, tmp_path, monkeypatch, mini_corpus):
    """q4_0 through llama.cpp on validation text: within the 4-bit thresholds and recorded in the manifest (its
    figures and the file's sha256); with thresholds no 4-bit form can meet, refused (exit 1), nothing written and
    the manifest unchanged."""
    _llama_cpp()
    from contract import quant

    b = Path(shutil.copytree(bundle, tmp_path / "b"))   # with model.onnx: the gate's float32 reference
    out = G.export_gguf(b, type="q4_0", log=lambda m: None, approximate_pretokenizer=True, val_data=mini_corpus)
    m = json.loads((b / "manifest.json").read_text())
    r = m["quantization"]["forms"]["llama.cpp q4_0"]
    assert r["ok"] is True and r["bits"] == 4 and set(r["by_lang"]) == {"bn", "en"} and m["quantization"]["tokens"] > 0
    assert 0 < r["all"]["mean_abs_top_logprob_delta"] <= quant.GATE[4].mean_abs_top_logprob_delta_max
    from contract.atomic import sha256_file

    assert m["files"][out.name]["sha256"] == sha256_file(out)
    before = (b / "manifest.json").read_bytes()
    monkeypatch.setitem(quant.GATE, 4, quant.Thresholds(0.1, 0.85, 1e-6))
    assert G.main([str(b), "--type", "q4_0", "--out", str(b / "again.gguf"), "--approximate-pretokenizer",
                   "--val-data", str(mini_corpus)]) == 1
    assert not (b / "again.gguf").exists() and not [p for p in b.iterdir() if p.name.startswith(".tmp-")]
    assert (b / "manifest.json").read_bytes() == before


@pytest.mark.slow
def test_q4_k_m_is_llama_cpps_mix(wide_bundle, tmp_path):
    """--type q4_k_m through llama.cpp's quantizer: K-quant tensors (Q4_K, and Q6_K for the tied output and
    attn_v / ffn_down of the layers that get more bits), norms F32, no temporary left; llama.cpp's logits stay
    close to the float32 GGUF's."""
    _llama_cpp()
    from export.parity import probe_ids

    out = G.export_gguf(wide_bundle, tmp_path / "k.gguf", "q4_k_m", log=lambda m: None, approximate_pretokenizer=True)
    ref = G.export_gguf(wide_bundle, tmp_path / "f.gguf", "f32", log=lambda m: None, approximate_pretokenizer=True)
    kv, ts = read(out)
    assert kv["general.file_type"] == LlamaFileType.MOSTLY_Q4_K_M
    types = {n: t.tensor_type for n, t in ts.items()}
    assert types["blk.0.attn_q.weight"] == Q.Q4_K and types["token_embd.weight"] == Q.Q6_K
    assert types["blk.0.attn_norm.weight"] == Q.F32 and set(types.values()) <= {Q.Q4_K, Q.Q6_K, Q.F32}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if "gguf" in n or n.startswith(".")] == ["f.gguf", "k.gguf"]   # no float32 scratch left
    ids = probe_ids(json.loads((wide_bundle / "config.json").read_text())["vocab_size"], 32, seed=1)
    got = []
    for path in (ref, out):
        lc = LlamaCppBackend(path, threads=1, logits_all=True)
        try:
            got.append(lc.new_sequence().prefill(ids, all_logits=True))
        finally:
            lc.close()
    err = np.abs(got[0] - got[1]).max()
    assert 0 < err < 0.25 * np.abs(got[0]).max()

def _llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        pytest.skip(f"llama-cpp-python is not installed ({e}); it is a benchmark dependency "
                    "(pip install -e '.[bench]', a source build), not a CI one")


@pytest.mark.slow
def test_llama_cpp_logits_match_torch(gguf_files, theta_bundle, bundle):
    """f32 GGUF in llama.cpp (f32 KV cache) vs PyTorch at positions 1..31, theta 50000 (X6 + X7 end to end)."""
    _llama_cpp()
    import torch

    from export.parity import probe_ids, reference_logits
    from train.components.checkpoint import load_model

    model, mcfg = load_model(theta_bundle)
    assert mcfg.rope_theta == THETA
    ids = probe_ids(mcfg.vocab_size, 32, seed=1)
    with torch.no_grad():
        ref = reference_logits(model.eval(), ids)
    lc = LlamaCppBackend(gguf_files["f32"], threads=1, logits_all=True)
    try:
        got = lc.new_sequence().prefill(ids, all_logits=True)
    finally:
        lc.close()
    diff = np.abs(got[1:] - ref[1:]).max()
    assert diff < 1e-3, f"llama.cpp vs torch max |Δlogit| {diff:.2e} at positions 1..31"
    theta10k, _ = load_model(bundle)  # the same weights at theta 10000: the test can see a wrong theta
    assert np.abs(reference_logits(theta10k.eval(), ids)[1:] - ref[1:]).max() > 1e-3


@pytest.mark.slow
def test_llama_cpp_greedy_matches_onnx(bundle, tmp_path):
    """Greedy continuations of our token ids: llama.cpp (f32 GGUF) equals serve's OnnxBackend, a mismatch allowed
    only at a near-tie of the reference (top-2 gap < 1e-3)."""
    _llama_cpp()
    from tokenizers import Tokenizer

    from export.parity import NEAR_TIE, PROMPTS, compare_greedy, greedy
    from serve.backends.onnx import OnnxBackend

    path = G.export_gguf(bundle, tmp_path / "m.gguf", log=lambda m: None, approximate_pretokenizer=True)
    onnx = OnnxBackend(bundle, threads=1)
    lc = LlamaCppBackend(path, threads=1)
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    compared = 0
    try:
        for _lang, text in PROMPTS:
            prompt = [onnx.eot_id] + tok.encode(text).ids
            ref, gaps = greedy(onnx.new_sequence(), prompt, 24)
            got, _ = greedy(lc.new_sequence(), prompt, 24)
            ok, n, detail = compare_greedy(ref, gaps, got, NEAR_TIE)
            assert ok, f"{text!r}: {detail}"
            compared += n
    finally:
        lc.close()
    assert compared >= 24
