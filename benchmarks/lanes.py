"""The lanes a benchmark can time: one runtime at one quantization kind, loaded from a bundle as serving loads it.

A lane is a row of :data:`LANES`: its runtime (``rust``: rust_runtime through serve's RustBackend; ``onnx``:
onnxruntime through serve's OnnxBackend; ``torch``: this repository's PyTorch model, eager, with its KV cache;
``llama``: llama.cpp on ``export.gguf``'s GGUF, a peer only), its kind (serve's ``quantize`` setting for rust and
onnx, the GGUF type for llama) and the bytes each matmul weight costs a decoded token (the decode roofline;
:func:`weight_bytes` per matrix for the mixes of 4 and 8 bits).
:func:`load` returns an object with ``new_sequence()`` whose sequences have ``prefill(ids)`` / ``decode(id)`` →
float32 logits; :func:`unavailable` says why a lane cannot run here; :func:`export_quantize` is the quantized ONNX
graph a set of lanes needs in the bundle.

Adding a quantization kind is one row here (say ``Lane("rust-q4_0", "rust", "q4_0", "rust q4_0", None)``), then
naming it where a script pairs lanes: ``decode.py``'s ``TARGETS``, ``prefill.py``'s ``PAIRS``,
``serve_batching.py``'s ``ENGINES`` / ``PEERS``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bundles import gguf_path
from contract.quant import parse


@dataclass(frozen=True)
class Lane:
    """One runtime at one kind: ``name`` (the command-line name), ``runtime`` (rust, onnx, torch, llama),
    ``kind`` (None = float32, else serve's quantize setting, or the GGUF type for llama), ``label`` (for tables)
    and ``bytes_per_weight`` (bytes read per matmul weight per decoded token; None: it differs by matrix, see
    :func:`weight_bytes`)."""

    name: str
    runtime: str
    kind: str | None
    label: str
    bytes_per_weight: float | None


LANES: dict[str, Lane] = {lane.name: lane for lane in (
    Lane("rust-f32", "rust", None, "rust f32", 4.0),
    Lane("rust-q8_0", "rust", "q8_0", "rust q8_0", 34 / 32),  # q8_0: a float16 scale per 32 int8s
    Lane("rust-q4_0", "rust", "q4_0", "rust q4_0", None),  # rust_runtime.QUANTIZE_PLAN says each matrix's type
    Lane("rust-q4_mix", "rust", "q4_mix", "rust q4_mix", None),
    Lane("ort-fp32", "onnx", None, "onnxruntime fp32", 4.0),
    Lane("ort-q8_0", "onnx", "q8_0", "onnxruntime q8_0", 36 / 32),  # MatMulNBits: a float32 scale per 32 int8s
    Lane("torch", "torch", None, "PyTorch eager fp32", 4.0),
    Lane("llama-f32", "llama", "f32", "llama.cpp f32", 4.0),
    Lane("llama-q8_0", "llama", "q8_0", "llama.cpp q8_0", 34 / 32),
    Lane("llama-q4_0", "llama", "q4_0", "llama.cpp Q4_0", None),  # llama.cpp's quantizer (bundles.gguf)
    Lane("llama-q4_k_m", "llama", "q4_k_m", "llama.cpp Q4_K_M", None),
)}

# bytes per weight of a block type: 34 a q8_0 block of 32, 18 a q4_0 block; ggml's Q4_K 144 per 256, Q6_K 210 per 256
TYPE_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32, "Q4_K": 144 / 256, "Q6_K": 210 / 256}

_LIBRARY = {"rust": "rust_runtime", "onnx": "onnxruntime", "torch": "torch", "llama": "llama_cpp"}


class TorchBackend:
    """The bundle's ``model.safetensors`` in this repository's PyTorch model (train.model, eager, its KV cache)
    behind serve's backend protocol, on ``threads`` intra-op threads (set at every new sequence, so one process
    can time several counts over one ``model``)."""

    name = "torch"

    def __init__(self, bundle: Path, threads: int, model=None):
        from train.components.checkpoint import load_model

        if model is None:
            model = load_model(bundle)[0].eval()
        self.model, self.threads = model, threads
        self.vocab_size = model.config.vocab_size
        self.max_position_embeddings = model.config.max_position_embeddings

    def new_sequence(self):
        import torch

        from export.parity import TorchSequence

        torch.set_num_threads(self.threads)
        return TorchSequence(self.model)


def role_weights(cfg: dict) -> dict[str, list[int]]:
    """Weights of each matrix role (contract.quant's names: q_proj, ..., lm_head), one entry per layer (lm_head:
    one); the embedding lookup reads one row, not counted."""
    h, nh, inter, layers = (cfg[k] for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                                             "num_hidden_layers"))
    nkv = cfg.get("num_key_value_heads") or nh
    hd = h // nh
    per = {"q_proj": nh * hd * h, "k_proj": nkv * hd * h, "v_proj": nkv * hd * h, "o_proj": h * nh * hd,
           "gate_proj": inter * h, "up_proj": inter * h, "down_proj": h * inter}
    return {**{r: [n] * layers for r, n in per.items()}, "lm_head": [cfg["vocab_size"] * h]}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the attn_v / ffn_down layers (of ``n``) that its Q4_K_M gives Q6_K
    (src/llama-quant.cpp, use_more_bits)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def weight_bytes(lane: Lane, cfg: dict) -> float:
    """Bytes of matmul weights one decoded token reads on ``lane`` (lm_head included): weights × its
    ``bytes_per_weight``, or per matrix — Rust as ``rust_runtime.QUANTIZE_PLAN`` stores each role, llama.cpp's Q4_0
    with the output at Q6_K, its Q4_K_M with the output and the use_more_bits layers of attn_v / ffn_down at Q6_K."""
    roles = role_weights(cfg)
    if lane.bytes_per_weight is not None:
        return sum(map(sum, roles.values())) * lane.bytes_per_weight
    if lane.runtime == "rust":
        import rust_runtime

        plan = rust_runtime.QUANTIZE_PLAN[lane.kind]
        return sum(n * TYPE_BYTES[plan[r]] for r, ns in roles.items() for n in ns)
    total = 0.0
    for r, ns in roles.items():
        for i, n in enumerate(ns):
            if r == "lm_head":
                t = "Q6_K"
            elif lane.kind == "q4_0":
                t = "q4_0"
            else:
                t = "Q6_K" if r in ("v_proj", "down_proj") and use_more_bits(i, len(ns)) else "Q4_K"
            total += n * TYPE_BYTES[t]
    return total


def unavailable(lane: Lane, bundle: Path) -> str | None:
    """None when ``lane`` can run on ``bundle`` here, else why not: its library does not import, or the bundle
    lacks its graph (a q8_0 ONNX graph comes from ``export.onnx --quantize q8_0``; a missing GGUF is made by
    :func:`benchmarks.bundles.gguf`, so it is not a reason)."""
    module = _LIBRARY[lane.runtime]
    try:
        __import__(module)
    except ImportError as e:
        return f"{module} not importable ({e})"
    if lane.runtime == "onnx":
        from contract.bundle import ONNX_GRAPHS, onnx_graph

        if lane.kind not in ONNX_GRAPHS:
            return f"serve's OnnxBackend has no graph for quantize={lane.kind!r}"
        graph = Path(bundle) / onnx_graph(bundle, lane.kind)
        if not graph.is_file():
            return f"no {graph.name} in {bundle} (python -m export.onnx RUN --quantize {lane.kind} --out {bundle} --force)"
    return None


def export_quantize(names: Iterable[str]) -> str | None:
    """The ``export.onnx --quantize`` kind the ONNX lanes among ``names`` need (None: float32 only). Raises
    ValueError when they need two kinds (export writes one quantized graph)."""
    kinds = {LANES[n].kind for n in names if LANES[n].runtime == "onnx" and LANES[n].kind}
    if len(kinds) > 1:
        raise ValueError(f"the onnx lanes need graphs of {sorted(kinds)}; export.onnx writes one quantized graph")
    return next(iter(kinds), None)


def load(lane: Lane, bundle: Path, threads: int, n_ctx: int | None = None, extra_bufts: bool = False):
    """``lane``'s backend over ``bundle`` on ``threads`` threads. ``n_ctx`` (llama only): the KV cache positions
    llama.cpp allocates up front; ``extra_bufts`` (llama only): its extra weight buffer types (AMX, repacking).
    Raises ImportError when the lane's library is absent, and the backend's own error for a bad bundle."""
    if lane.runtime == "rust":
        from serve.backends.rust import RustBackend

        # speed, not quality: the presets' untrained twins have no gate verdict (export records them unmeasured)
        return RustBackend(bundle, quantize=parse(lane.kind), threads=threads, allow_ungated=True)
    if lane.runtime == "onnx":
        from serve.backends.onnx import OnnxBackend

        return OnnxBackend(bundle, quantize=parse(lane.kind), threads=threads)
    if lane.runtime == "torch":
        return TorchBackend(bundle, threads)
    from serve.backends.llamacpp import LlamaCppBackend

    # llama.cpp's default f16 KV cache, as users run it; a context just large enough (it is allocated up front)
    return LlamaCppBackend(gguf_path(bundle, lane.kind), threads=threads, n_ctx=n_ctx, f32_cache=False,
                           extra_bufts=extra_bufts)
