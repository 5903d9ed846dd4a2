"""Shalik's quantization schemes, with one owner: their names, the block type of their weights, the tensors that
stay at 8 bits, the quality gate's thresholds, and the form each runtime gives them. Torch- and numpy-free, so that
``export``, ``serve`` (``serve.load(quantize=...)``, ``SHALIK_QUANTIZE``), the benchmarks and the test that holds
``rust_runtime`` to the same list (tests/test_quant.py: ``rust_runtime.QUANTIZE_NAMES`` / ``QUANTIZE_PLAN``) all
read it.

==========  =====  =====  ===========================  =====================  ===========  =====================
name        bits   block  kept at 8 bits (q8_0)        ONNX form (bundle)     Rust         GGUF (``export.gguf``)
==========  =====  =====  ===========================  =====================  ===========  =====================
``none``    32     —      —                            ``model.onnx``         f32          ``f32`` / ``f16``
``q8_0``    8      32     (every matrix is 8-bit)      ``model.q8_0.onnx``    q8_0         ``q8_0``
``q4_0``    4      32     none: every matrix q4_0      ``model.q4_0.onnx``    q4_0         ``q4_0``
``q4_mix``  4      32     embed_tokens / lm_head,      ``model.q4_mix.onnx``  q4_mix       — (``q4_k_m`` is
                          v_proj, down_proj                                                llama.cpp's mix)
==========  =====  =====  ===========================  =====================  ===========  =====================

* ``q8_0``: ggml's ``block_q8_0`` (32 weights, one float16 scale d = max|w| / 127, q = round(w / d) in
  [−127, 127]) for every matrix, the head included — the same blocks, number for number, in every runtime.
  ``int8`` is its old name, still accepted (:data:`ALIASES`: :func:`parse` logs that it is deprecated); before
  format minor 1 a bundle's 8-bit ONNX graph was ``model.int8.onnx``, onnxruntime's dynamic quantization with one
  scale per row (per channel), which such a bundle still serves as its ``q8_0`` graph
  (:func:`contract.bundle.onnx_graph`).
* ``q4_0``: llama.cpp's format (ggml ``block_q4_0``: 32 weights, one scale d = the weight of largest |w| / −8,
  q = round(w / d) + 8 in [0, 15]), for every matrix — the head too (what a "pure" GGUF Q4_0 holds).
* ``q4_mix``: q4_0 where 4 bits cost least and q8_0 where they cost most, in the spirit of llama.cpp's Q4_K_M
  (which keeps attn_v, ffn_down and the output at more bits); the same blocks as q4_0 and q8_0, so every runtime
  computes it from the same numbers.
* ONNX forms: onnxruntime's ``MatMulNBits`` (blocks of 32 along the input features, ``accuracy_level`` 4 — int8
  activations per block, int32 sums): the 4-bit matrices quantized by its ``MatMulNBitsQuantizer`` (symmetric,
  q4_0's numbers), the 8-bit ones holding q8_0's blocks as gguf-py writes them (``export.quantize``). ONNX's
  embedding ``Gather`` always stays float32 (an exact lookup).
* GGUF types (``export.gguf --type``) are llama.cpp's: ``f32``, ``f16``, ``q8_0``, ``q4_0`` and ``q4_k_m``
  (:data:`GGUF_ONLY`): llama.cpp's own ``Q4_K_M`` mix made by llama.cpp's quantizer (Q4_K, Q6_K for the output and
  half of attn_v / ffn_down; super-blocks of 256) — the reference people compare against (and ``q4_mix``'s peer),
  served by llama.cpp alone, so not a name of :data:`NAMES`.
* Rows (a weight's input features) must be a multiple of the block: :func:`check_shape` refuses the rest, naming
  the tensor (nothing is padded silently).

Quality gate (``export``: every quantized form against the bundle's float32 ``model.onnx``, per language, on the
run's validation text; a form outside any threshold is not written): :data:`GATE` by bit width. Measurements
behind the numbers: ``benchmarks/results/nll_quant.md`` (``python benchmarks/nll_quant.py``).

Adding a runtime's form of a scheme is one entry here (``rust=True`` when ``rust_runtime`` quantizes to it at
load, ``onnx=True`` when the bundle holds its graph): the export gate, ``serve.load``, ``SHALIK_QUANTIZE`` and
tests/test_quant.py follow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

NONE = "none"
log = logging.getLogger("shalik.quant")

# Tensor roles, by their Hugging Face Llama names (model.layers.N.self_attn.q_proj.weight → "q_proj").
ROLES = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
Q8_BLOCK = 32  # the block of a tensor kept at 8 bits (q8_0; MatMulNBits bits=8)


class QuantizeError(ValueError):
    """A quantization name or a weight shape that a scheme cannot take (the message names it and what is allowed)."""


@dataclass(frozen=True)
class Thresholds:
    """The gate's limits for one bit width, per language (and over all): NLL change against float32 (nats/token,
    at most), top-1 agreement with float32's argmax (share of positions, at least), mean |Δ log p| of float32's
    top token (nats, at most)."""

    val_nll_delta_max: float
    top1_agreement_min: float
    mean_abs_top_logprob_delta_max: float

    def as_dict(self) -> dict[str, float]:
        return {"val_nll_delta_max": self.val_nll_delta_max, "top1_agreement_min": self.top1_agreement_min,
                "mean_abs_top_logprob_delta_max": self.mean_abs_top_logprob_delta_max}


# By bit width, per language. The measurements behind them: benchmarks/results/nll_quant.md (every form of the
# trained small) and benchmarks/results/int8_agreement.md (the old per-channel 8-bit graph on random-init models,
# near-flat logits full of near-ties). The |Δ log p| limits sit a few times above the worst measured, where a broken form (wrong scales, a
# dropped matrix) lands far outside.
GATE = {
    8: Thresholds(val_nll_delta_max=0.05, top1_agreement_min=0.85, mean_abs_top_logprob_delta_max=0.1),
    4: Thresholds(val_nll_delta_max=0.10, top1_agreement_min=0.85, mean_abs_top_logprob_delta_max=0.25),
}


BLOCK_TYPES = {"q8_0": (8, Q8_BLOCK), "q4_0": (4, 32), "q4_k": (4, 256)}  # ggml block type → (bits, weights a block)


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme: ``name`` (the one spelling every runtime accepts), ``weight_type`` (the ggml block
    type of its bulk matrices, a key of :data:`BLOCK_TYPES`, as ``rust_runtime.QUANTIZE_PLAN`` spells it),
    ``keep_8bit`` (roles of :data:`ROLES` stored at q8_0 instead), ``onnx`` (the bundle holds an ONNX graph of it:
    its file name is ``contract.bundle.ONNX_GRAPHS[name]``), ``rust`` (``rust_runtime`` quantizes to it at load),
    ``gguf`` (the ``export.gguf --type`` that writes it, or None) and ``gguf_by`` (who quantizes the GGUF:
    "gguf-py" or "llama.cpp")."""

    name: str
    weight_type: str
    keep_8bit: frozenset[str]
    onnx: bool
    rust: bool
    gguf: str | None
    gguf_by: str | None
    summary: str

    @property
    def bits(self) -> int:
        """Bit width of the bulk weights: the gate's :data:`GATE` entry."""
        return BLOCK_TYPES[self.weight_type][0]

    @property
    def block(self) -> int:
        """Weights per (super-)block of the bulk weights."""
        return BLOCK_TYPES[self.weight_type][1]

    @property
    def thresholds(self) -> Thresholds:
        return GATE[self.bits]

    def storage(self, role: str) -> str:
        """The ggml block type a tensor of ``role`` (:data:`ROLES`) is stored as: "q8_0" when kept, else
        ``weight_type`` (``rust_runtime.QUANTIZE_PLAN[name][role]``)."""
        if role not in ROLES:
            raise QuantizeError(f"tensor role {role!r}: expected one of {', '.join(ROLES)}")
        return "q8_0" if role in self.keep_8bit else self.weight_type

    def bits_of(self, role: str) -> int:
        """Bit width of a tensor of ``role`` (:data:`ROLES`) under this scheme."""
        return BLOCK_TYPES[self.storage(role)][0]

    def block_of(self, role: str) -> int:
        """Weights per block of a tensor of ``role`` (32 for q8_0 / q4_0, 256 for q4_K)."""
        return BLOCK_TYPES[self.storage(role)][1]


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("q8_0", "q8_0", frozenset(), onnx=True, rust=True, gguf="q8_0", gguf_by="gguf-py",
           summary="8-bit weights in blocks of 32 (ggml's q8_0), every matrix"),
    Scheme("q4_0", "q4_0", frozenset(), onnx=True, rust=True, gguf="q4_0", gguf_by="gguf-py",
           summary="4-bit weights in blocks of 32 (llama.cpp's q4_0), every matrix"),
    Scheme("q4_mix", "q4_0", frozenset({"embed_tokens", "lm_head", "v_proj", "down_proj"}), onnx=True, rust=True,
           gguf=None, gguf_by=None,
           summary="q4_0, with the embedding / head, v and down projections at q8_0 (in the spirit of Q4_K_M)"),
)}
GGUF_ONLY: dict[str, Scheme] = {s.name: s for s in (
    Scheme("q4_k_m", "q4_k", frozenset(), onnx=False, rust=False, gguf="q4_k_m", gguf_by="llama.cpp",
           summary="llama.cpp's Q4_K_M mix (Q4_K, Q6_K for the output and half of attn_v / ffn_down)"),
)}
NAMES = (NONE, *SCHEMES)   # the one list of names: SHALIK_QUANTIZE, serve.load, rust_runtime, export
#: Old spellings still accepted, each the same numeric form as the scheme it names (:func:`parse` logs a
#: deprecation line; ``rust_runtime.QUANTIZE_ALIASES`` is the same table).
ALIASES = {"int8": "q8_0"}
BACKEND_NAMES = {          # what each serving backend offers
    "onnx": (NONE, *(n for n, s in SCHEMES.items() if s.onnx)),
    "rust": (NONE, *(n for n, s in SCHEMES.items() if s.rust)),
}


def plan(name: str) -> dict[str, str | None]:
    """``{role: ggml block type or None (float32)}`` for every role of :data:`ROLES` under quantization ``name``
    (a name of :data:`NAMES`): the form of ``rust_runtime.QUANTIZE_PLAN[name]``."""
    s = parse(name)
    return {r: (s.storage(r) if s else None) for r in ROLES}


def parse(value: Any, name: str = "quantize") -> Scheme | None:
    """The one parser of a quantization, at each boundary that takes one (``serve.load``, ``SHALIK_QUANTIZE``,
    ``export``'s ``--quantize``): ``None`` / ``"none"`` → None (float32); a name of :data:`NAMES` (any case,
    surrounding blanks ignored) → its :class:`Scheme`, which is what flows further down (the backends take a
    Scheme); an old name of :data:`ALIASES` → the scheme it names, logging one warning line on the
    ``shalik.quant`` logger ("quantize 'int8' is deprecated: use 'q8_0'", the argument named as ``name``); a
    Scheme is returned as it is (parsed already). QuantizeError (a ValueError) naming ``name`` (the argument,
    option or variable) and the allowed names for anything else."""
    if value is None or isinstance(value, Scheme):
        return value
    v = value.strip().lower() if isinstance(value, str) else None
    if v in ALIASES:
        log.warning("%s %r is deprecated: use %r", name, v, ALIASES[v])
        v = ALIASES[v]
    if v not in NAMES:
        hint = (f" ({v} is llama.cpp's GGUF mix: python -m export.gguf BUNDLE --type {v})" if v in GGUF_ONLY else "")
        raise QuantizeError(f"{name} is {value!r}; expected one of {', '.join(NAMES)}{hint}")
    return None if v == NONE else SCHEMES[v]


def name_of(s: Scheme | None) -> str:
    """The name of a parsed quantization: the scheme's, ``"none"`` for None (float32)."""
    return NONE if s is None else s.name


def scheme(value: Any, name: str = "quantize") -> Scheme:
    """The :class:`Scheme` of a quantization name (not ``none``). QuantizeError as :func:`parse`."""
    s = parse(value, name)
    if s is None:
        raise QuantizeError(f"{name} is {value!r}; expected a quantization, one of {', '.join(SCHEMES)}")
    return s


def check_backend(s: Scheme | None, backend: str, name: str = "quantize") -> None:
    """QuantizeError when ``backend`` ("onnx" or "rust") has no form of the parsed quantization ``s`` (None:
    float32, which every backend has), naming what it offers and which backend offers it."""
    offered = BACKEND_NAMES.get(backend)
    if offered is None or name_of(s) in offered:
        return
    others = [b for b, names in BACKEND_NAMES.items() if s.name in names]
    raise QuantizeError(f"{name} {s.name!r} is not offered by the {backend} backend (it offers "
                        f"{', '.join(offered)}); " + (f"use backend {others[0]!r}" if others else
                                                      "no serving backend offers it yet (python -m export.gguf "
                                                      f"--type {s.gguf} writes it for llama.cpp)"))


def role_of(tensor: str) -> str:
    """The role (:data:`ROLES`) of a Hugging Face Llama weight name, e.g. ``model.layers.3.mlp.down_proj.weight``
    → ``down_proj``. QuantizeError for a name that is none of them (a norm, say: norms are never quantized)."""
    parts = tensor.split(".")
    for role in ROLES:
        if role in parts:
            return role
    raise QuantizeError(f"{tensor}: not a quantizable weight (expected one of {', '.join(ROLES)})")


def check_shape(s: Scheme, tensor: str, shape: tuple[int, ...], role: str | None = None) -> None:
    """Refuse a weight ``shape`` (``[out, in]``, the nn.Linear / safetensors layout) whose rows scheme ``s`` cannot
    cut into whole blocks: QuantizeError naming the tensor, its shape, the block and the schemes that would take
    it. ``role`` defaults to :func:`role_of` of ``tensor``. 1-D tensors (norms) pass: they are never quantized."""
    if len(shape) != 2:
        return
    block = s.block_of(role or role_of(tensor))
    if shape[-1] % block:
        fits = [n for n, o in SCHEMES.items() if shape[-1] % o.block_of(role or role_of(tensor)) == 0]
        raise QuantizeError(
            f"{tensor} {list(shape)}: {s.name} quantizes it in blocks of {block} along its {shape[-1]} input "
            f"features, which are not a multiple of {block}; quantizations that fit: "
            f"{', '.join(fits) if fits else 'none (keep it float32)'}")
