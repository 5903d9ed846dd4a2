"""export.onnx: the bundle, its parity gate, serve's OnnxBackend, bad input, and cases X1–X6 of docs/cases.md.

One full export (CLI, gate on, q8_0 and q4_mix; the tiny model's q4_0, every matrix at 4 bits, fails the gate) of the trained tiny run is shared by most tests; the failure tests fail
before exporting or swap the exporter for a copy of that graph, so the file stays around a minute and a half.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.bundle import ONNX_GRAPHS
from contract.quant import BACKEND_NAMES, GATE, SCHEMES
from export import graph as G
from export import onnx as E
from export import pipeline as PL
from export.errors import ExportError
from export.parity import PROMPTS, compare_greedy, max_diff
from export.source import resolve_checkpoint
from serve.backends.base import BackendError
from serve.backends.onnx import OnnxBackend
from train.components.checkpoint import find_checkpoint, load_model, write_sums

TOL = 1e-4


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def ckpt(trained_run) -> Path:
    return find_checkpoint(trained_run)


@pytest.fixture(scope="module")
def ref(ckpt):
    model, _ = load_model(ckpt)
    return model.eval()


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory) -> Path:
    """The trained tiny run through the CLI: gate on, q8_0 and q4_mix (its pure q4_0, measured unasked for Rust —
    hidden 64, the tied head at 4 bits too — is near the 4-bit gate's top-1 limit, so its verdict depends on the
    data: the tests check the rule on the verdict the manifest records)."""
    out = tmp_path_factory.mktemp("export") / "bundle"
    assert E.main([str(trained_run), "--out", str(out), "--quantize", "q8_0", "q4_mix"]) == 0
    return out


@pytest.fixture(scope="module")
def backend(exported) -> OnnxBackend:
    return OnnxBackend(exported, threads=1)


def torch_logits(model, ids, mask=None, pos=None, past=None):
    """Our model's logits (numpy) and presents for numpy inputs."""
    def t(a):
        return None if a is None else torch.as_tensor(np.array(a))

    pkv = None if past is None else [(t(k), t(v)) for k, v in past]
    with torch.no_grad():
        logits, presents = model(t(ids), t(mask), t(pos), pkv, True)
    return logits.numpy(), [(k.numpy(), v.numpy()) for k, v in presents]


def copy_ckpt(ckpt: Path, dst: Path) -> Path:
    """A copy of the checkpoint folder inside ``dst/checkpoints`` (so it is a run of its own)."""
    out = dst / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, out)
    return out


def run_cli(args, capsys) -> tuple[int, str, str]:
    rc = E.main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".tmp-")]


def tokens(bundle: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return [0] + Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(text).ids


# ---------------------------------------------------------------- the bundle

def test_bundle_files_and_manifest(exported, ckpt):
    names = {p.name for p in exported.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.onnx", "model.onnx.data", "model.q8_0.onnx", "model.q4_mix.onnx", "README.md",
            "manifest.json"} <= names
    m = json.loads((exported / "manifest.json").read_text())
    assert m["format"] == "shalik-bundle" and m["format_version"] == 1
    assert m["exporter"] in ("dynamo", "torchscript") and m["opset"] == G.OPSET
    # no machine-specific absolute path in a bundle: relative to the working directory, else the last three parts
    assert m["source"]["step"] == 40 and m["source"]["checkpoint"] == str(Path(*ckpt.resolve().parts[-3:]))
    assert m["params"] == load_model(ckpt)[0].num_params()
    assert set(m["versions"]) >= {"torch", "onnx", "onnxruntime", "transformers"}
    from contract.atomic import sha256_file

    assert m["source"]["sha256"] == sha256_file(ckpt / "model.safetensors")
    assert set(m["files"]) == names - {"manifest.json"}
    for name, f in m["files"].items():
        assert f["sha256"] == sha256_file(exported / name) and f["bytes"] == (exported / name).stat().st_size
    assert no_leftovers(exported.parent)


def test_parity_table_covers_every_case(exported):
    p = json.loads((exported / "manifest.json").read_text())["parity"]
    assert p["ok"] is True and all(c["ok"] for c in p["cases"])
    names = [(c["runtime"].split(" ")[0], c["case"]) for c in p["cases"]]
    onnx = [n for r, n in names if r == "onnx"]
    for want in ("prefill 1 (past 0)", "prefill 7 (past 0)", "prefill 64 (past 0)",
                 "prefill 128 (past 0, full context)", "decode past 1", "decode past 17",
                 "decode positions 125..127 (context end)"):
        assert want in onnx
    assert any(n.startswith("batch 2, left padding") for n in onnx)
    assert sum(n.startswith("greedy") for n in onnx) == len(PROMPTS) == 5
    logit_cases = [c for c in p["cases"] if c["runtime"].startswith("onnx (") and not c["case"].startswith("greedy")]
    assert all(0 <= c["value"] <= TOL for c in logit_cases)
    assert {r for r, _ in names} >= {"onnx", "safetensors", "transformers"}
    for form, bits in (("onnx q8_0", 8), ("onnx q4_mix", 4), ("rust q8_0", 8)):  # quality gate
        th = GATE[bits]
        rows = {c["case"]: c for c in p["cases"] if c["runtime"] == form}
        assert rows["all: val NLL change, nats/token"]["value"] <= th.val_nll_delta_max
        for lang in ("bn", "en", "all"):            # per language and over all: NLL change, top-1, |Δ log p|
            assert rows[f"{lang}: top-1 agreement with fp32"]["value"] >= th.top1_agreement_min
            lp = rows[f"{lang}: mean |Δ log p| of fp32's top token, nats"]
            assert 0 < lp["value"] <= th.mean_abs_top_logprob_delta_max == lp["tol"]
        assert len(rows) == 9 and all(r["ok"] for r in rows.values())
    # a Rust form the gate measures unasked and fails is recorded and kept out of the parity table; whether this
    # tiny model's q4_0 passes depends on its data, so the rule is checked on whatever the manifest records
    q = json.loads((exported / "manifest.json").read_text())["quantization"]["forms"]
    failed = {n for n, r in q.items() if r["ok"] is False}
    assert failed <= {"rust q4_0"}   # the asked-for forms passed (else the export exits 1); q4_mix passes here
    assert not any(c["runtime"] in failed for c in p["cases"])
    assert all(any(c["runtime"] == n for c in p["cases"]) for n, r in q.items() if r["ok"] is True and n != "rust q4_0")


def test_quality_gate_recorded(exported):
    m = json.loads((exported / "manifest.json").read_text())
    q = m["quantization"]
    assert q["tokens"] > 0 and q["reference"] == "onnx float32 (model.onnx)"
    rust = {f"rust {n}" for n in BACKEND_NAMES["rust"] if n != "none"}   # every Rust form, asked for or not
    assert set(q["forms"]) == {"onnx q8_0", "onnx q4_mix"} | rust
    for name, r in q["forms"].items():
        if name == "rust q4_0" and r["ok"] is False:   # not asked for; may fail on this model: recorded as failed
            assert not r["all"]["ok"]
            continue
        c = r["continuations"]   # measured, not gated
        assert all(0 <= v["identical"] <= v["prompts"] == 10 for v in c["by_lang"].values()) and c["new_tokens"] > 0
        s = SCHEMES[r["scheme"]]
        assert name == f"{r['runtime']} {s.name}" and r["bits"] == s.bits and r["ok"] is True
        assert r["thresholds"] == GATE[s.bits].as_dict() and r["file"] == (ONNX_GRAPHS[s.name] if r["runtime"] == "onnx" else None)
        assert set(r["by_lang"]) == {"bn", "en"} and r["all"]["tokens"] == q["tokens"]
        assert r["all"]["nll"] == pytest.approx(r["all"]["nll_f32"] + r["all"]["delta"])
        for v in r["by_lang"].values():
            assert v["ok"] and abs(v["delta"]) <= GATE[s.bits].val_nll_delta_max
            assert GATE[s.bits].top1_agreement_min <= v["top1_agreement"] <= 1 and v["mean_abs_top_logprob_delta"] > 0
    f = OnnxBackend(exported, threads=1)
    ids = tokens(exported, "আমি বাংলায় গান গাই")
    ref = f.logits(ids)
    kinds = ("q8_0", "q4_mix")
    err = {k: np.abs(OnnxBackend(exported, quantize=SCHEMES[k], threads=1).logits(ids) - ref).max() for k in kinds}
    assert 0 < err["q8_0"] < err["q4_mix"] < 2.0   # really quantized, fewer bits further, still close
    lp = [q["forms"][f"onnx {k}"]["all"]["mean_abs_top_logprob_delta"] for k in kinds]
    assert lp == sorted(lp)


@pytest.mark.parametrize("scheme", [n for n, s in SCHEMES.items() if s.onnx])
def test_quantized_graphs_keep_at_8_bits_what_the_scheme_says(exported, scheme, tmp_path):
    """model.q8_0.onnx / model.q4_0.onnx / model.q4_mix.onnx: every weight matmul is MatMulNBits in blocks of 32,
    accuracy level 4; q8_0: 8 bits everywhere; a 4-bit scheme: 4 bits, except the roles contract.quant keeps at 8 bits (q4_mix: the tied lm_head — the only [hidden, vocab]
    weight — v_proj and down_proj); no float MatMul by a weight is left. A graph the export did not keep (q4_0,
    refused by the gate) is written here without it."""
    import onnx
    from onnx import helper

    from contract.quant import role_of
    from export.quantize import matmul_weights, write_onnx_form

    cfg = json.loads((exported / "config.json").read_text())
    pre = {n: role_of(t) for n, t in matmul_weights(_float_graph_preprocessed(exported), exported / "model.safetensors").items()}
    graph = exported / ONNX_GRAPHS[scheme]
    if not graph.is_file():
        graph = tmp_path / graph.name
        write_onnx_form(SCHEMES[scheme], exported / "model.onnx", graph, exported / "model.safetensors")
    g = onnx.load(str(graph)).graph
    nbits = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in g.node
             if n.op_type == "MatMulNBits"}
    assert len(nbits) == len(pre) == 7 * cfg["num_hidden_layers"] + 1
    by_role: dict[str, set] = {}
    for name, a in nbits.items():
        assert (a["block_size"], a["accuracy_level"]) == (32, 4)
        role = pre[name.rsplit("_Q", 1)[0]]
        by_role.setdefault(role, set()).add(a["bits"])
    assert by_role == {r: {SCHEMES[scheme].bits_of(r)} for r in by_role}
    assert by_role["lm_head" if "lm_head" in by_role else "embed_tokens"] == ({4} if scheme == "q4_0" else {8})
    inits = {t.name for t in g.initializer}
    assert not [n for n in g.node if n.op_type == "MatMul" and n.input[1] in inits]


def test_q8_0_graph_holds_the_blocks_of_rust_and_gguf(exported):
    """Every 8-bit MatMulNBits of model.q8_0.onnx dequantizes ((stored - 128) x scale, its default zero point) to
    exactly what ggml's q8_0 of the safetensors weight dequantizes to (gguf-py's quantizer and dequantizer: the
    numbers the GGUF and rust_runtime hold)."""
    import gguf
    import onnx
    from gguf.quants import dequantize, quantize
    from onnx import numpy_helper
    from safetensors.numpy import load_file

    from export.quantize import matmul_weights

    weights = load_file(str(exported / "model.safetensors"))
    tensor_of = matmul_weights(_float_graph_preprocessed(exported), exported / "model.safetensors")
    m = onnx.load(str(exported / ONNX_GRAPHS["q8_0"]))
    inits = {t.name: t for t in m.graph.initializer}
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == len(tensor_of)
    for n in nodes:
        stored = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)   # [out, blocks, 32]
        scale = numpy_helper.to_array(inits[n.input[2]])                       # [out, blocks]
        w = weights[tensor_of[n.name.rsplit("_Q", 1)[0]]]
        ggml = dequantize(quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
        assert len(n.input) == 3 and np.array_equal(((stored - 128) * scale[..., None]).reshape(w.shape), ggml), n.name


def _float_graph_preprocessed(bundle: Path):
    """The bundle's float graph after onnxruntime's pre-processing (the graph the quantizers read)."""
    import tempfile

    import onnx
    from onnxruntime.quantization import quant_pre_process

    with tempfile.TemporaryDirectory() as td:
        quant_pre_process(str(bundle / "model.onnx"), f"{td}/pre.onnx", skip_symbolic_shape=True,
                          save_as_external_data=True, all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
        return onnx.load(f"{td}/pre.onnx")


def test_config_json_and_card(exported, ckpt):
    c = json.loads((exported / "config.json").read_text())
    src = json.loads((ckpt / "config.json").read_text())
    assert c["rope_theta"] == c["rope_parameters"]["rope_theta"] == src["rope_theta"]
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "head_dim"):
        assert c[k] == src[k], k
    assert c["tie_word_embeddings"] is True and c["torch_dtype"] == "float32" and c["model_type"] == "llama"
    card = (exported / "README.md").read_text()
    for needle in ("from serve import load", "uvicorn serve.app:app", "SHALIK_MODEL", "AutoModelForCausalLM",
                   "random-init", "licence", "prefill 1 (past 0)", "chars / token"):
        assert needle in card, needle
    for form, file in (("onnx q4_mix", "`model.q4_mix.onnx`"), ("rust q8_0", "quantized at load")):  # the gate
        assert all(f"| {form} | {file} | {lang} |" in card for lang in ("bn", "en", "all")), form
    assert "Gate at 8 bits: Δ NLL ≤ 0.05" in card and "Gate at 4 bits: Δ NLL ≤ 0.10" in card
    forms = json.loads((exported / "manifest.json").read_text())["quantization"]["forms"]
    for what, verdict in (("Passed", True), ("Failed", False)):
        names = [n for n, r in forms.items() if r["ok"] is verdict]
        assert (f"{what}: " + ", ".join(f"`{n}`" for n in names) + ".") in card if names else f"{what}: " not in card
    assert "Passed: `onnx q8_0`, `onnx q4_mix`" in card
    data = json.loads((exported / "manifest.json").read_text())["data"]
    assert data["sources"] and all("license" in s for s in data["sources"])
    assert all(s["source"] in card for s in data["sources"])


def test_transformers_loads_bundle_unchanged(exported, ref):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(2, ref.config.vocab_size, (2, 110), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        d = (hf(ids).logits - ref(ids)[0]).abs().max().item()
    assert d < TOL
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert tok("আমি বাংলায় গান গাই", add_special_tokens=False)["input_ids"] == tokens(exported, "আমি বাংলায় গান গাই")[1:]


def test_x5_tied_safetensors(exported, ckpt, ref):
    import safetensors.torch

    from train.components.checkpoint import load_weights
    from train.model import LlamaForCausalLM

    sd = safetensors.torch.load_file(str(exported / "model.safetensors"))
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    orig = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    assert set(sd) == set(orig) and all(torch.equal(sd[k], orig[k]) for k in sd)
    fresh = LlamaForCausalLM(ref.config).eval()
    load_weights(fresh, exported / "model.safetensors")
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    ids = torch.arange(2, 66)[None]
    with torch.no_grad():
        assert (fresh(ids)[0] - ref(ids)[0]).abs().max().item() <= 1e-6


# ---------------------------------------------------------------- serve's OnnxBackend

def test_backend_protocol(backend, ref, exported):
    assert backend.name == "onnx" and backend.vocab_size == ref.config.vocab_size
    assert backend.max_position_embeddings == 128 and backend.eot_id == 0
    ids = tokens(exported, "Once upon a time")
    seq = backend.new_sequence()
    assert seq.position == 0
    all_logits = seq.prefill(ids, all_logits=True)
    assert all_logits.shape == (len(ids), backend.vocab_size) and all_logits.dtype == np.float32
    assert seq.position == len(ids)
    nxt = seq.decode(5)
    assert nxt.shape == (backend.vocab_size,) and seq.position == len(ids) + 1
    want = torch_logits(ref, [ids + [5]])[0][0]
    assert max_diff(want[:-1], all_logits, TOL, TOL)[1] and max_diff(want[-1], nxt, TOL, TOL)[1]
    last = backend.new_sequence().prefill(ids)
    assert np.array_equal(last, all_logits[-1])


def test_backend_errors(backend, exported, tmp_path):
    seq = backend.new_sequence()
    with pytest.raises(BackendError, match="600"):
        seq.prefill([1, 600])
    with pytest.raises(BackendError, match="out of range"):
        seq.prefill([-1])
    with pytest.raises(BackendError, match="empty"):
        seq.prefill([])
    seq.prefill([3] * 127)
    seq.decode(4)                                   # position 127: the last one
    with pytest.raises(BackendError, match="128"):
        seq.decode(4)
    with pytest.raises(TypeError, match="quantize is 'q8_0'; expected a contract.quant.Scheme or None"):
        OnnxBackend(exported, quantize="q8_0")   # names are parsed at the boundary (serve.load), not here
    partial = tmp_path / "b"
    partial.mkdir()
    for f in ("config.json", "model.onnx", "model.onnx.data"):
        shutil.copy(exported / f, partial / f)
    with pytest.raises(BackendError, match="model.q8_0.onnx"):
        OnnxBackend(partial, quantize=SCHEMES["q8_0"])
    with pytest.raises(BackendError, match="config"):
        OnnxBackend(tmp_path / "nowhere")


def test_backend_does_not_import_torch():
    code = "import sys, serve.backends.onnx; sys.exit(1 if 'torch' in sys.modules else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- docs/cases.md X1–X4 on the exported graph

def test_x1_every_position(backend, ref):
    ids = np.random.default_rng(1).integers(2, ref.config.vocab_size, 100)
    want = torch_logits(ref, ids[None])[0][0]
    one = backend.logits(ids.tolist())
    assert max_diff(want, one, TOL, TOL)[1]
    seq = backend.new_sequence()
    steps = [seq.prefill(ids[:8].tolist(), all_logits=True)] + [seq.decode(int(t))[None] for t in ids[8:]]
    got = np.concatenate(steps)
    assert got.shape == want.shape
    d, ok = max_diff(want, got, TOL, TOL)
    assert ok, d


def test_x2_empty_past_then_steps(backend, ref):
    kv, hd = ref.config.num_key_value_heads, ref.config.head_dim
    assert (kv, hd) == (2, 16)
    past = [(np.zeros((1, kv, 0, hd), np.float32),) * 2 for _ in range(ref.config.num_hidden_layers)]
    ids = np.array([[0, 17, 250, 9, 33]])
    logits, past = backend.forward(ids, np.ones((1, 5), np.int64), np.arange(5)[None], past)
    assert all(k.shape == v.shape == (1, kv, 5, hd) for k, v in past)
    seq_ids = ids[0].tolist()
    out = []
    for step in range(9):
        tok = int(np.argmax(logits[0, -1]))
        out.append(tok)
        seq_ids.append(tok)
        n = len(seq_ids)
        logits, past = backend.forward(np.array([[tok]]), np.ones((1, n), np.int64), np.array([[n - 1]]), past)
        assert all(k.shape == (1, kv, n, hd) for k, _ in past), step
        want = torch_logits(ref, [seq_ids])[0][0, -1]
        assert max_diff(want, logits[0, -1], TOL, TOL)[1]
    out.append(int(np.argmax(logits[0, -1])))
    assert out == ref.generate_greedy(ids[0].tolist(), 10)


def test_x3_dynamic_axes(exported, backend, ref):
    import onnx

    mp = onnx.load(str(exported / "model.onnx"), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(mp.graph.input) + list(mp.graph.output)}
    assert dims["input_ids"] == ["batch", "sequence_length"]
    assert dims["attention_mask"] == ["batch", "total_sequence_length"]
    assert dims["position_ids"] == ["batch", "sequence_length"]
    assert dims["past_key_values.0.key"] == ["batch", 2, "past_sequence_length", 16]
    assert dims["logits"] == ["batch", "sequence_length", ref.config.vocab_size]
    assert dims["present.1.value"] == ["batch", 2, "total_sequence_length", 16]
    assert len(dims) == 3 + 4 * ref.config.num_hidden_layers + 1
    rng = np.random.default_rng(2)
    for b, s, p in [(1, 1, 0), (3, 5, 4), (2, 16, 0)]:
        ids = rng.integers(2, ref.config.vocab_size, (b, s))
        mask = np.ones((b, p + s), np.int64)
        pos = np.broadcast_to(np.arange(p, p + s), (b, s))
        past = [tuple(rng.standard_normal((b, 2, p, 16)).astype(np.float32) for _ in range(2))
                for _ in range(ref.config.num_hidden_layers)]
        got, pres = backend.forward(ids, mask, pos, past)
        want, wpres = torch_logits(ref, ids, mask, pos, past)
        assert got.shape == (b, s, ref.config.vocab_size)
        assert max_diff(want, got, TOL, TOL)[1], (b, s, p)
        assert max_diff(wpres[-1][1], pres[-1][1], TOL, TOL)[1]


def test_x4_left_padding(backend, ref, exported):
    rows = [tokens(exported, "আমি"), tokens(exported, "আমি বাংলায় গান গাই")]
    width = max(map(len, rows))
    x = np.array([[1] * (width - len(r)) + r for r in rows])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    logits, past = backend.forward(x, mask, pos, None)
    short = backend.logits(rows[0])[-1]
    assert max_diff(short, logits[0, -1], TOL, TOL)[1]
    gen = [[], []]
    for _ in range(8):
        nxt = logits[:, -1].argmax(-1)
        for r in range(2):
            gen[r].append(int(nxt[r]))
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        pos = pos[:, -1:] + 1
        logits, past = backend.forward(nxt[:, None], mask, pos, past)
    for r in range(2):
        assert gen[r] == ref.generate_greedy(rows[r], 8), r


# ---------------------------------------------------------------- X3 second export + X6 rope_theta

@pytest.fixture(scope="module")
def theta_bundle(ckpt, tmp_path_factory):
    """The trained checkpoint with rope_theta 50000, exported without the gate from example sizes (3, 7, 2)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("theta")
    c = copy_ckpt(ckpt, root)
    cfg = json.loads((c / "config.json").read_text())
    cfg["rope_theta"] = 50000.0
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    (c / "config.json").write_text(json.dumps(cfg))
    write_sums(c)
    mp.setattr(G, "EXAMPLE_SIZES", (3, 7, 2))
    try:
        out = E.export_bundle(c, root / "bundle", parity=False, exporter="dynamo", log=lambda m: None)
    finally:
        mp.undo()
    return out, c


def _int_constants(path: Path) -> list:
    import onnx
    from onnx import numpy_helper

    mp = onnx.load(str(path))
    tensors = list(mp.graph.initializer)
    tensors += [a.t for n in mp.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    return sorted(numpy_helper.to_array(t).tolist().__repr__() for t in tensors
                  if t.data_type == onnx.TensorProto.INT64)


def test_x3_second_export_same_shape_constants(theta_bundle, exported):
    m = json.loads((exported / "manifest.json").read_text())
    if m["exporter"] != "dynamo":
        pytest.skip("the main bundle fell back to TorchScript")
    assert _int_constants(theta_bundle[0] / "model.onnx") == _int_constants(exported / "model.onnx")


def test_x6_rope_theta_survives(theta_bundle, ref):
    bundle, c = theta_bundle
    cfg = json.loads((bundle / "config.json").read_text())
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert cfg["rms_norm_eps"] == 1e-5
    model50, _ = load_model(c)
    model50.eval()
    ids = np.random.default_rng(4).integers(2, ref.config.vocab_size, 101)
    want = torch_logits(model50, ids[None])[0][0]
    base = torch_logits(ref, ids[None])[0][0]
    assert np.abs(want[0] - base[0]).max() < 1e-5        # position 0 cannot tell thetas apart
    assert np.abs(want[100] - base[100]).max() > 1e-3    # position 100 can
    onnx_logits = OnnxBackend(bundle, threads=1).logits(ids.tolist())
    assert max_diff(want[100], onnx_logits[100], TOL, TOL)[1]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(bundle), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.as_tensor(ids)[None]).logits[0].numpy()
    assert max_diff(want[100], hf_logits[100], TOL, TOL)[1]
    card = (bundle / "README.md").read_text()
    assert "unchecked" in card
    assert json.loads((bundle / "manifest.json").read_text())["parity"]["ok"] is None


# ---------------------------------------------------------------- bad input: exit 2, no bundle, no traceback

def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    rc, _, err = run_cli([tmp_path, "--out", tmp_path / "b"], capsys)
    assert rc == 2 and "not a checkpoint" in err and str(tmp_path) in err and "Traceback" not in err
    rc, _, err = run_cli([tmp_path / "missing", "--out", tmp_path / "b"], capsys)
    assert rc == 2 and "no such file" in err
    rc, _, err = run_cli([tmp_path / "notes.txt", "--out", tmp_path / "b"], capsys)
    assert rc == 2 and "not a checkpoint" in err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_safetensors(ckpt, tmp_path, capsys, damage):
    c = copy_ckpt(ckpt, tmp_path / "run")
    f = c / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    else:
        f.write_bytes(bytes(data[: len(data) // 2]))
    out = tmp_path / "b"
    rc, _, err = run_cli([tmp_path / "run", "--out", out], capsys)   # the run folder: its latest checkpoint
    assert rc == 2 and "model.safetensors" in err and "sha256" in err and "Traceback" not in err
    assert not out.exists() and no_leftovers(tmp_path)
    if damage == "truncate":                        # sums rewritten to match: the file itself is refused
        write_sums(c)
        rc, _, err = run_cli([c, "--out", out], capsys)
        assert rc == 2 and "not a readable safetensors" in err and not out.exists()


def test_config_not_matching_weights(ckpt, tmp_path, capsys):
    c = copy_ckpt(ckpt, tmp_path)
    cfg = json.loads((c / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (c / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli([c, "--out", tmp_path / "b"], capsys)
    assert rc == 2 and "config.json" in err and "sha256" in err     # edited after SHA256SUMS
    write_sums(c)
    rc, _, err = run_cli([c, "--out", tmp_path / "b"], capsys)
    assert rc == 2 and "does not match" in err and "mlp" in err and "Traceback" not in err
    cfg["intermediate_size"], cfg["num_attention_heads"] = 128, 3
    (c / "config.json").write_text(json.dumps(cfg))
    write_sums(c)
    rc, _, err = run_cli([c, "--out", tmp_path / "b"], capsys)
    assert rc == 2 and "heads 3" in err and "config.json" in err
    assert not (tmp_path / "b").exists()


def test_weights_with_nan_are_refused_naming_the_tensor(ckpt, tmp_path, capsys):
    """A run that diverged (trained on with --no-preflight) leaves NaN weights; the export names the tensor at
    once instead of a traceback from the parity check's Rust loader."""
    from safetensors.torch import load_file, save_file

    c = copy_ckpt(ckpt, tmp_path)
    weights = load_file(c / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name][0, :3] = float("nan")
    save_file(weights, c / "model.safetensors", metadata={"format": "pt"})
    write_sums(c)
    rc, _, err = run_cli([c, "--out", tmp_path / "b"], capsys)
    assert rc == 2 and f"{name} holds 3 of " in err and "NaN or inf" in err and "Traceback" not in err, err
    assert not (tmp_path / "b").exists()


def test_existing_out_needs_force(ckpt, tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_cli([ckpt, "--out", out], capsys)
    assert rc == 2 and "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    c = copy_ckpt(ckpt, tmp_path / "run")
    rc, _, err = run_cli([c, "--out", c.parent, "--force"], capsys)      # would delete the checkpoint itself
    assert rc == 2 and "would replace the checkpoint" in err and (c / "model.safetensors").is_file()


def test_bad_val_data(ckpt, tmp_path, capsys):
    rc, _, err = run_cli([ckpt, "--out", tmp_path / "b", "--quantize", "q8_0", "--val-data", tmp_path / "x"], capsys)
    assert rc == 2 and "--val-data" in err and not (tmp_path / "b").exists()


def test_bad_quantize_names(ckpt, tmp_path, capsys):
    """An unknown name, or a scheme no bundle form exists of, is one line naming it and what is allowed."""
    rc, _, err = run_cli([ckpt, "--out", tmp_path / "b", "--quantize", "q8_0", "int3"], capsys)
    assert rc == 2 and "--quantize is 'int3'; expected one of none, q8_0, q4_0, q4_mix" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "b").exists()
    with pytest.raises(ExportError, match=r"--quantize is 'q4_k_m'; .*python -m export.gguf BUNDLE --type q4_k_m"):
        PL.parse_schemes(["q4_k_m"])             # llama.cpp's GGUF mix, not a bundle form
    assert PL.parse_schemes(["q4_0", "none", "Q8_0", "q4_0"]) == (SCHEMES["q8_0"], SCHEMES["q4_0"])


# ---------------------------------------------------------------- the gate and atomicity

def _copy_graph(src_bundle: Path):
    """An export_graph stand-in that writes ``src_bundle``'s graph (so the gate sees other weights)."""
    def fake(model, path, exporter="dynamo", dtype="float32", sizes=None, opset=G.OPSET):
        shutil.copyfile(src_bundle / "model.onnx", path)
        shutil.copyfile(src_bundle / "model.onnx.data", path.with_name(path.name + ".data"))
    return fake


def test_planted_parity_failure(ckpt, exported, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    c = copy_ckpt(ckpt, tmp_path / "run")
    sd = safetensors.torch.load_file(str(c / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"] * 1.05        # other weights, same shapes
    safetensors.torch.save_file(sd, str(c / "model.safetensors"), metadata={"format": "pt"})
    write_sums(c)
    monkeypatch.setattr(PL, "export_graph", _copy_graph(exported))   # a graph of the original weights
    out = tmp_path / "run" / "bundle"
    rc, stdout, err = run_cli([tmp_path / "run"], capsys)           # default out: <run>/bundle
    assert rc == 1 and "parity gate failed" in err and "no bundle was written" in err
    assert "FAIL" in stdout and "prefill 1 (past 0)" in stdout
    assert "onnx (dynamo)" in stdout and "onnx (torchscript)" in stdout   # both exporters were tried
    assert not out.exists() and no_leftovers(tmp_path / "run")


def test_dynamo_failure_falls_back_to_torchscript(ckpt, tmp_path, monkeypatch):
    real = G.export_graph

    def dynamo_breaks(model, path, exporter, *a, **kw):
        if exporter == "dynamo":
            raise RuntimeError("planted dynamo failure")
        return real(model, path, exporter, *a, **kw)

    monkeypatch.setattr(PL, "export_graph", dynamo_breaks)
    logs: list[str] = []
    out = E.export_bundle(ckpt, tmp_path / "b", log=logs.append)
    m = json.loads((out / "manifest.json").read_text())
    assert m["exporter"] == "torchscript" and m["parity"]["ok"] is True
    assert any("planted dynamo failure" in line for line in logs)
    assert all(c["runtime"] != "onnx (dynamo)" for c in m["parity"]["cases"])


def test_interrupt_and_force(ckpt, exported, tmp_path, monkeypatch, capsys):
    out = tmp_path / "b"
    shutil.copytree(exported, out)                                   # an existing bundle
    (out / "old.txt").write_text("old bundle")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(PL, "export_graph", interrupted)
    rc, _, err = run_cli([ckpt, "--out", out, "--force"], capsys)
    assert rc == 130 and "no bundle" in err
    assert (out / "old.txt").read_text() == "old bundle" and no_leftovers(tmp_path)
    monkeypatch.setattr(PL, "export_graph", _copy_graph(exported))
    rc, _, err = run_cli([ckpt, "--out", out, "--force", "--no-parity"], capsys)
    assert rc == 0, err
    assert not (out / "old.txt").exists() and (out / "manifest.json").is_file() and no_leftovers(tmp_path)
    assert "unchecked" in (out / "README.md").read_text()


# ---------------------------------------------------------------- the output target (issue: --force, OSError)

def test_force_refuses_what_is_not_a_bundle(ckpt, tmp_path, capsys):
    data = tmp_path / "photos"
    data.mkdir()
    (data / "holiday.jpg").write_bytes(b"\xff\xd8 mine")
    rc, _, err = run_cli([ckpt, "--out", data, "--force"], capsys)
    assert rc == 2 and "not a Shalik bundle" in err and str(data) in err and "Traceback" not in err
    assert (data / "holiday.jpg").read_bytes() == b"\xff\xd8 mine"
    (data / "manifest.json").write_text('{"format": "something-else"}')
    rc, _, err = run_cli([ckpt, "--out", data, "--force"], capsys)
    assert rc == 2 and "not a Shalik bundle" in err and (data / "holiday.jpg").is_file()
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    rc, _, err = run_cli([ckpt, "--out", f, "--force"], capsys)
    assert rc == 2 and "is a file" in err and f.read_text() == "mine" and no_leftovers(tmp_path)


@pytest.mark.parametrize("where", ["under a file", "proc", "read-only"])
def test_unwritable_target_is_a_clear_error(ckpt, tmp_path, capsys, monkeypatch, where):
    if where == "under a file":
        (tmp_path / "afile").write_text("x")
        out, want = tmp_path / "afile" / "b", "is a file, not a folder"
    elif where == "proc":
        out, want = Path("/proc") / "shalik-bundle-test", "cannot create a folder in /proc"
    else:                                 # a read-only file system, as statvfs reports it (root ignores modes)
        real = PL.check_target.__globals__["os"].statvfs

        class RO:
            def __init__(self, st):
                self.f_flag = st.f_flag | __import__("os").ST_RDONLY

        monkeypatch.setattr(PL.check_target.__globals__["os"], "statvfs", lambda p: RO(real(p)))
        out, want = tmp_path / "ro" / "b", "read-only file system (EROFS)"
    rc, _, err = run_cli([ckpt, "--out", out, "--no-parity"], capsys)
    assert rc == 2 and want in err and "Traceback" not in err, err
    assert no_leftovers(tmp_path)


@pytest.mark.parametrize("stage", ["graph", "weights"])
def test_full_disk_names_enospc(ckpt, tmp_path, capsys, monkeypatch, stage):
    import errno
    import os

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "b" / "model.onnx.data"))

    if stage == "graph":
        monkeypatch.setattr(PL, "export_graph", full)
    else:
        monkeypatch.setattr(PL.B.shutil, "copyfile", full)
    rc, _, err = run_cli([ckpt, "--out", tmp_path / "b", "--no-parity"], capsys)
    assert rc == 2 and "No space left on device (ENOSPC)" in err and "no exporter" not in err, err
    assert not (tmp_path / "b").exists() and no_leftovers(tmp_path)


def test_example_sizes_below_two_name_the_axis(ref, tmp_path):
    for sizes, axis in (((1, 5, 3), "batch"), ((2, 1, 3), "sequence_length"), ((2, 5, 0), "past_sequence_length")):
        with pytest.raises(ValueError, match=f"example {axis} = {sizes[G.AXES.index(axis)]}.*at least 2"):
            G.export_graph(ref, tmp_path / "m.onnx", "dynamo", sizes=sizes)
    assert not (tmp_path / "m.onnx").exists()


def test_quality_gate_fails_on_agreement_even_when_nll_is_fine():
    from export.gate import Form, cases, compare_logits, figures, judge, passes

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 50, 30)).astype(np.float32)
    targets = rng.integers(0, 30, size=(2, 50))
    same = compare_logits(ref, ref, targets)
    assert same["top1_agree"] == 100 and same["top_logprob_absdiff"] == 0 and same["nll_ref"] == same["nll_got"]
    swapped = ref[..., ::-1].copy()                 # another winner at every position, similar NLL on average
    v = figures(compare_logits(ref, swapped, targets))
    assert v["top1_agreement"] < 0.2 and not passes(v, SCHEMES["q8_0"]) and not passes(v, SCHEMES["q4_0"])
    fine = {"nll_f32": 1.0, "nll": 1.0, "delta": 0.0, "top1_agreement": 0.5, "mean_abs_top_logprob_delta": 0.01,
            "tokens": 100}
    entry = {"forms": {"onnx q4_0": judge(Form("onnx", SCHEMES["q4_0"], None, "model.q4_0.onnx"),
                                          {"all": fine, "by_lang": {"bn": fine}})}}
    assert entry["forms"]["onnx q4_0"]["ok"] is False
    # per language, then over all: NLL change, top-1 agreement, |Δ log p|
    assert [r.ok for r in cases(entry)] == [True, False, True, True, False, True]
    # between the 8- and 4-bit limits: passes at 4 bits, fails at 8
    mid = {**fine, "top1_agreement": 0.9, "delta": 0.07}
    assert passes(mid, SCHEMES["q4_0"]) and not passes(mid, SCHEMES["q8_0"])


def test_failing_quantized_form_is_not_written(trained_run, tmp_path, monkeypatch, capsys):
    """A form outside its thresholds fails the export (exit 1, its rows printed) and nothing is written, even with
    --no-parity; unmeasured (no validation data) is recorded as such."""
    from contract import quant

    monkeypatch.setitem(quant.GATE, 4, quant.Thresholds(val_nll_delta_max=0.1, top1_agreement_min=0.85,
                                                        mean_abs_top_logprob_delta_max=1e-6))
    rc, out, err = run_cli([trained_run, "--out", tmp_path / "b", "--quantize", "q4_0", "--no-parity",
                            "--exporter", "torchscript"], capsys)
    assert rc == 1 and "quality gate failed for onnx q4_0" in err and "mean |Δ log p|" in err
    assert "onnx q4_0" in out and not (tmp_path / "b").exists() and no_leftovers(tmp_path)


def test_untrained_checkpoint_writes_quantized_forms_unmeasured(ckpt, tmp_path, capsys):
    """A step-0 (random init) checkpoint: its quantized graphs are written for speed figures (benchmarks' init
    bundles) and recorded as not measured, with why; the gate says nothing about near-tied logits."""
    c = copy_ckpt(ckpt, tmp_path / "run")
    state_file = c / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    state_file.write_text(json.dumps({**state, "step": 0}))
    write_sums(c)
    rc, out, err = run_cli([c, "--out", tmp_path / "b", "--quantize", "q4_0", "--no-parity",
                            "--exporter", "torchscript"], capsys)
    assert rc == 0, err
    r = json.loads((tmp_path / "b" / "manifest.json").read_text())["quantization"]["forms"]["onnx q4_0"]
    assert r["ok"] is None and r["note"] == PL.UNTRAINED and "step 0 (random init)" in out
    assert (tmp_path / "b" / "model.q4_0.onnx").is_file()


def test_compare_greedy_near_tie():
    assert compare_greedy([1, 2, 3], [1, 1, 1], [1, 2, 3], 1e-3) == (True, 3, "")
    ok, n, detail = compare_greedy([1, 2, 3], [1, 5e-4, 1], [1, 7, 3], 1e-3)
    assert ok and n == 1 and "near-tie" in detail
    ok, n, detail = compare_greedy([1, 2, 3], [1, 0.5, 1], [1, 7, 3], 1e-3)
    assert not ok and n == 1 and "token 1" in detail
    assert max_diff(np.ones(3), np.ones(3) + 3e-4, 1e-4, 1e-4) == (pytest.approx(3e-4), False)
    assert max_diff(np.ones(3), np.ones(3) + 1e-4, 1e-4, 1e-4) == (pytest.approx(1e-4), True)
    assert max_diff(np.ones(3), np.array([1, np.nan, 1]), 1e-4, 1e-4)[1] is False


# ---------------------------------------------------------------- float16 (slow: a second full export)

@pytest.mark.slow
def test_float16_bundle(ckpt, tmp_path):
    from export.parity import FP16_TOL

    out = E.export_bundle(ckpt, tmp_path / "b16", dtype="float16", log=lambda m: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["dtype"] == "float16" and m["parity"]["ok"] and m["parity"]["tol"] == FP16_TOL
    be = OnnxBackend(out, threads=1)
    assert be.kv_dtype == np.float16
    assert (out / "model.onnx.data").stat().st_size < 0.6 * (out / "model.safetensors").stat().st_size


def test_existing_up_to_date_bundle_is_kept(trained_run, bundle, tmp_path):
    """Re-running the README's main job: an up-to-date bundle of the same checkpoint is not rebuilt; one that
    differs from what is asked (float16 here), or a base model's bundle that still carries a chat template (as
    exports did before base models lost it), is refused without --force, saying why."""
    from contract.bundle import has_chat_template, rehash
    from export.onnx import ExportError, export_bundle

    before = (bundle / "manifest.json").stat().st_mtime_ns
    msgs: list[str] = []
    assert export_bundle(trained_run, bundle, parity=False, log=msgs.append) == bundle
    assert any("up-to-date" in m for m in msgs)
    assert (bundle / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(ExportError, match=r"not an up-to-date bundle of .*: dtype float32, not float16 \(use --force"):
        export_bundle(trained_run, bundle, parity=False, dtype="float16", log=lambda m: None)
    old = tmp_path / "old-bundle"
    shutil.copytree(bundle, old)
    tc = json.loads((old / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": "{{ messages }}"}))
    rehash(old, ["tokenizer_config.json"])
    assert has_chat_template(old) and not has_chat_template(bundle)
    with pytest.raises(ExportError, match=r": a chat template, but the checkpoint is a base model \(use --force"):
        export_bundle(trained_run, old, parity=False, log=lambda m: None)
    assert export_bundle(trained_run, old, parity=False, force=True, log=lambda m: None) == old
    assert not has_chat_template(old)


def test_the_run_s_bundle_of_an_older_step_is_replaced_without_force(trained_run, bundle, tmp_path):
    """After a --resume the README's line exports the run again: its own bundle of an older checkpoint of the run is
    replaced (it was refused without --force); a bundle of a newer step, or one outside the run's default folder,
    still is refused."""
    from export.onnx import ExportError, export_bundle

    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("bundle"))
    step = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())["step"]

    def plant(where: Path, old_step: int, run_name: str = "run") -> None:
        shutil.copytree(bundle, where, dirs_exist_ok=True)
        m = json.loads((where / "manifest.json").read_text())
        m["source"] = {"checkpoint": f"runs/{run_name}/checkpoints/step-{old_step:06d}", "step": old_step,
                       "sha256": "0" * 64}
        (where / "manifest.json").write_text(json.dumps(m))

    plant(run / "bundle", step + 10)
    with pytest.raises(ExportError, match=r"not an up-to-date bundle .*: exported from another checkpoint"):
        export_bundle(run, parity=False, log=lambda m: None)
    plant(run / "bundle", step - 10, run_name="another-run")   # an older step, but of another run
    with pytest.raises(ExportError, match=r"not an up-to-date bundle .*: exported from another checkpoint"):
        export_bundle(run, parity=False, log=lambda m: None)
    plant(tmp_path / "elsewhere", step - 10)
    with pytest.raises(ExportError, match=r"elsewhere already exists and is not an up-to-date bundle"):
        export_bundle(run, tmp_path / "elsewhere", parity=False, log=lambda m: None)
    plant(run / "bundle", step - 10)
    msgs: list[str] = []
    assert export_bundle(run, parity=False, log=msgs.append) == run / "bundle"
    assert f"is this run's bundle of step {step - 10}; replacing it with step {step}" in msgs[0]
    assert json.loads((run / "bundle" / "manifest.json").read_text())["source"]["step"] == step


def test_damaged_latest_is_an_export_error_naming_it(tmp_path):
    """A run whose checkpoints/latest holds bytes that are not UTF-8: a clear ExportError, not a traceback."""
    root = tmp_path / "run" / "checkpoints"
    (root / "step-000001").mkdir(parents=True)
    (root / "latest").write_bytes(b"\xff\xfe step")
    with pytest.raises(ExportError, match="latest"):
        resolve_checkpoint(tmp_path / "run")


def test_the_export_s_modules_leave_dependency_info_records_unprinted():
    """onnxruntime's 4-bit quantizer configures the root logger at INFO on import; imported through export, it must
    not: the exporter's passes (onnx_ir, onnxscript) log hundreds of INFO records, and none may reach the user."""
    import subprocess
    import sys

    code = ("import logging, export.onnx, export.quantize\n"
            "logging.getLogger('onnx_ir.passes.common.initializer_deduplication').info('Replaced initializer a')\n"
            "logging.getLogger('onnx_ir').warning('a warning')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "a warning" in r.stderr and "Replaced initializer" not in r.stderr + r.stdout
