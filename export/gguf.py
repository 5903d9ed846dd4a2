"""``python -m export.gguf BUNDLE [--out FILE] [--type f32|f16|q8_0|q4_0|q4_k_m] [--val-data PATH] [--force]``

Writes a bundle's weights and tokenizer as one GGUF file for llama.cpp (architecture ``llama``), with the ``gguf``
package (its writer, its Q8_0 / Q4_0 quantizers for q8_0 and q4_0, and its ``SpecialVocab`` for merges and special
ids); ``q4_k_m`` is llama.cpp's own quantizer (llama-cpp-python). The quantized types pass the quality gate through
llama.cpp and are recorded in the bundle's manifest (:mod:`export.gguf_quant`). Default output:
``BUNDLE/model-<type>.gguf``. Running the same command again does nothing when the file is the GGUF the bundle's
manifest records (written from this bundle, its gate passed); any other existing file is refused unless
``--force``. The file is written under a temporary
name in the same folder, fsynced and renamed into place, so a crash, Ctrl-C or a failed gate never leaves a
half-written GGUF.

What goes in (names as in llama.cpp's ``convert_hf_to_gguf.py``):

* tensors ``token_embd``, ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
  ffn_down}``, ``output_norm``, and ``output`` only when the bundle's embeddings are untied (llama.cpp falls back
  to ``token_embd`` otherwise). Norms stay float32; 2-D weights take ``--type`` (the tensors a 4-bit scheme keeps at
  8 bits, :mod:`contract.quant`: Q8_0); a matrix whose rows do not fill the type's blocks is refused, naming it (no
  silent fallback).
* q and k are permuted from the Hugging Face rotate-half layout to llama.cpp's interleaved-pair RoPE layout:
  ``attn_q`` with ``num_attention_heads``, ``attn_k`` with ``num_key_value_heads`` (case X7: using the query head
  count for k is wrong under GQA and shows only past position 0). :func:`unpermute_qk` is the exact inverse.
* keys ``llama.context_length, embedding_length, block_count, feed_forward_length, attention.head_count,
  attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon, rope.dimension_count, vocab_size``.
  ``rope.freq_base`` is config.json's ``rope_theta`` (top level, else ``rope_parameters.rope_theta``); a config
  with neither is an error, never a silent 10000 (case X6).
* tokenizer ``gpt2`` (byte-level BPE): tokens, merges, token types (specials CONTROL), bos/eos/pad ids,
  ``add_bos_token`` true (the bos id is ``<|endoftext|>``, which began every training document: llama.cpp then
  prepends it to a prompt as ``serve`` does), ``add_eos_token`` false, and
  ``tokenizer.ggml.pre``: the llama.cpp name of the bundle's split, found by comparing tokenizer.json's
  pre-tokenizer with the one table ``train.tokenizer.pretokenizers`` (tokenizer format 3 splits exactly as one
  of those names; ``shalik.pretokenizer`` = ``exact:<name>``). llama.cpp applies no NFC, so its ids equal the
  bundle's for NFC text (the model card says what users of other runtimes must do). A bundle made with tokenizer
  format 2 (ZWJ/ZWNJ inside words, 128-character pieces) has no equal: it is refused unless
  ``--approximate-pretokenizer`` writes the nearest, ``qwen35`` (digits one per token, words broken at
  ZWJ/ZWNJ), recorded as ``shalik.pretokenizer`` = ``approximate:qwen35``; users must then feed llama.cpp the
  token ids of the bundle's tokenizer.json. A split or normalizer llama.cpp has no name for is refused.
* for a chat model (``train.hf_files.is_chat_bundle``: a chat template and the chat tokens of
  ``contract.chat_format``): ``tokenizer.chat_template`` (ChatML, which llama.cpp's built-in template list detects
  without ``--jinja``) and ``tokenizer.ggml.eot_token_id`` = ``<|im_end|>`` (an end-of-generation token, as
  ``<|endoftext|>`` is); for a base model neither.
* beside the GGUF, an Ollama ``Modelfile`` (``export.modelfile``: ``FROM`` it, a raw template or the chat template,
  the ``<|endoftext|>`` (and ``<|im_end|>``) stop, the bundle's default sampling from generation_config.json, the context length) when the tokenizer is exact; an existing
  Modelfile Shalik did not write is left alone.
* :func:`write_vocab_gguf` writes the tokenizer alone (llama.cpp loads it with ``vocab_only``), to check llama.cpp's
  tokenization without a model.

Exit codes: 0 done, 1 the quality gate refused the quantized GGUF, 2 bad input (not a bundle, an unknown ``--type``,
a type whose quantizer is not installed, a tensor its blocks do not fit, an existing output that is not the
recorded GGUF, without ``--force``, a config or weights that do not describe a plain Llama, a tokenizer whose split or normalizer llama.cpp has no name
for, a format-2 tokenizer without ``--approximate-pretokenizer``), 130 interrupted.

Running a GGUF through llama.cpp (a benchmark and test peer) is :mod:`serve.backends.llamacpp`.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import TokenType
from safetensors import safe_open

from contract.atomic import atomic_path, clean_stale, tmp_prefix
from contract.bundle import CONFIG, TOKENIZER, WEIGHTS, file_entry, gguf_file
from contract.chat_format import CHAT_TEMPLATE, IM_END
from contract.cli import HelpFormatter
from contract.quant import role_of
from export import gguf_quant as GQ
from export.bundle import read_manifest
from export.errors import ExportError, run_cli
from export.modelfile import MODELFILE, write_modelfile
from train.hf_files import is_chat_bundle
from train.tokenizer import PRETOKENIZER
from train.tokenizer.pretokenizers import LEGACY, PRETOKENIZERS, identify

__all__ = ["TYPES", "APPROXIMATE_PRE", "PRETOKENIZER_KEY", "PretokenizerError", "GgufConfig", "export_gguf",
           "llama_cpp_pre", "permute_qk", "unpermute_qk", "write_gguf", "write_vocab_gguf", "main"]

TYPES = GQ.TYPES
APPROXIMATE_PRE = "qwen35"   # the nearest llama.cpp split to tokenizer format 2's
PRETOKENIZER_KEY = "shalik.pretokenizer"   # our own GGUF key: "exact:<name>" or "approximate:qwen35"


class PretokenizerError(ExportError):
    """llama.cpp would tokenize text differently from the bundle's tokenizer (exit code 2)."""


def llama_cpp_pre(tokenizer_json: Path, approximate: bool = False) -> tuple[str, str]:
    """(``tokenizer.ggml.pre``, ``shalik.pretokenizer``) for a tokenizer.json: ``(name, "exact:name")`` when its
    split is one of ``train.tokenizer.pretokenizers.PRETOKENIZERS``; for a tokenizer of format 2 ``("qwen35",
    "approximate:qwen35")`` when ``approximate``. Raises PretokenizerError naming the file for a normalizer other
    than NFC or none, for a split llama.cpp has no name for, and for format 2 without ``approximate``."""
    try:
        t = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{tokenizer_json}: unreadable ({e})") from None
    norm = (t.get("normalizer") or {}).get("type")
    if norm not in (None, "NFC"):
        raise PretokenizerError(f"{tokenizer_json}: normalizer {norm!r} has no llama.cpp equivalent (llama.cpp "
                                "applies none; expected NFC, which NFC input makes a no-op, or none)")
    split = identify(t)
    if split is LEGACY:
        if not approximate:
            raise PretokenizerError(
                f"{tokenizer_json}: made with Shalik's tokenizer format 2, whose split llama.cpp has no name for "
                f"(the nearest, {APPROXIMATE_PRE!r}, splits digits one per token and breaks words at ZWJ/ZWNJ). "
                f"Retrain (tokenizer format 3 splits as llama.cpp's {PRETOKENIZER.name}), or pass "
                "--approximate-pretokenizer and feed llama.cpp the token ids of the bundle's tokenizer.json")
        return APPROXIMATE_PRE, f"approximate:{APPROXIMATE_PRE}"
    if split is None:
        raise PretokenizerError(f"{tokenizer_json}: its pre-tokenizer has no llama.cpp equivalent (expected the "
                                f"split of one of {', '.join(PRETOKENIZERS)}; see train/tokenizer/pretokenizers.py)")
    return split.name, f"exact:{split.name}"


ARCH = "llama"
LAYER_TENSORS = {  # HF name inside model.layers.N → GGUF name inside blk.N
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
BUNDLE_FILES = (CONFIG, WEIGHTS, TOKENIZER)  # what the GGUF is made from


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half (HF) → interleaved-pair (llama.cpp) row order of a q or k projection.

    ``w``: ``[n_head * head_dim, in]`` (any dtype); within each head, output row ``2i`` takes HF row ``i`` and row
    ``2i+1`` takes HF row ``i + head_dim/2``. Same shape and dtype out. Raises ValueError when the rows do not
    split into ``n_head`` heads of even size. (llama.cpp's ``LlamaModel.permute``.)
    """
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The exact inverse of :func:`permute_qk` (llama.cpp layout → HF layout), same shapes and errors."""
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GgufConfig:
    """The model hyper-parameters the GGUF needs, read from a bundle's config.json (see :meth:`from_json`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, d: dict, where: str = CONFIG) -> GgufConfig:
        """Build from config.json's dict. Raises ExportError naming a missing or bad key, a missing rope_theta
        (X6), a ``head_dim`` other than hidden/heads, a non-default rope type, biases or a non-SiLU activation
        (none of which this converter writes)."""
        rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        theta = d.get("rope_theta", rp.get("rope_theta"))
        if theta is None:
            raise ExportError(f"{where}: no rope_theta (top level or rope_parameters); refusing to default to 10000")
        if rp.get("rope_type", "default") != "default" or (d.get("rope_scaling") or {}) not in ({}, None):
            raise ExportError(f"{where}: rope scaling {rp.get('rope_type') or d.get('rope_scaling')!r} is not supported")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ExportError(f"{where}: biases are not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ExportError(f"{where}: hidden_act {d.get('hidden_act')!r}, expected silu")
        try:
            cfg = cls(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                      num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=int(d["num_attention_heads"]),
                      num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                      intermediate_size=int(d["intermediate_size"]),
                      max_position_embeddings=int(d["max_position_embeddings"]), rope_theta=float(theta),
                      rms_norm_eps=float(d["rms_norm_eps"]), tie_word_embeddings=bool(d["tie_word_embeddings"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(f"{where}: missing or invalid key {e}") from None
        if cfg.hidden_size % cfg.num_attention_heads or cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ExportError(f"{where}: hidden_size {cfg.hidden_size} / heads {cfg.num_attention_heads} / "
                              f"kv heads {cfg.num_key_value_heads} do not divide")
        if d.get("head_dim") not in (None, cfg.head_dim):
            raise ExportError(f"{where}: head_dim {d['head_dim']} != hidden_size / num_attention_heads = {cfg.head_dim}")
        return cfg


def check_bundle(bundle: Path) -> GgufConfig:
    """Validate that ``bundle`` is a Shalik bundle folder (manifest, config.json, model.safetensors,
    tokenizer.json) and return its config. Raises ExportError saying what is missing."""
    if not bundle.is_dir():
        raise ExportError(f"{bundle}: not a folder (expected a bundle written by python -m export.onnx)")
    missing = [f for f in BUNDLE_FILES if not (bundle / f).is_file()]
    if missing:
        raise ExportError(f"{bundle}: not a bundle ({', '.join(missing)} missing; export one with python -m export.onnx)")
    read_manifest(bundle)
    try:
        d = json.loads((bundle / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"{bundle / CONFIG}: unreadable ({e})") from None
    if d.get("model_type", "llama") != "llama":
        raise ExportError(f"{bundle / CONFIG}: model_type {d.get('model_type')!r}, expected llama")
    return GgufConfig.from_json(d, str(bundle / CONFIG))


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor: its name, the safetensors tensor it comes from, its shape (numpy order: ``[out, in]`` or
    ``[n]``) and the head count to permute its rows with (q: num_attention_heads, k: num_key_value_heads)."""

    name: str
    source: str
    shape: tuple[int, ...]
    permute_heads: int | None = None

    @property
    def role(self) -> str | None:
        """The weight's role (:data:`contract.quant.ROLES`; a tied ``token_embd`` is also the lm_head), None for a norm."""
        return role_of(self.source) if len(self.shape) == 2 else None


def tensor_plan(cfg: GgufConfig, shapes: dict[str, tuple[int, ...]]) -> list[TensorSpec]:
    """Every GGUF tensor in llama.cpp's order, checked against ``shapes`` ({safetensors name: shape}).

    Raises ExportError for a missing tensor, a shape other than config.json implies, or a tensor this converter
    would silently drop (a bias, say). A tied bundle's stray ``lm_head.weight`` is ignored, as transformers does.
    """
    h, hd, kv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size
    layer = {"input_layernorm": (h,), "self_attn.q_proj": (h, h), "self_attn.k_proj": (kv * hd, h),
             "self_attn.v_proj": (kv * hd, h), "self_attn.o_proj": (h, h), "post_attention_layernorm": (h,),
             "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    plan = [TensorSpec("token_embd.weight", "model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        plan += [TensorSpec(f"blk.{i}.{gg}.weight", f"model.layers.{i}.{hf}.weight", layer[hf], heads.get(gg))
                 for hf, gg in LAYER_TENSORS.items()]
    plan.append(TensorSpec("output_norm.weight", "model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        plan.append(TensorSpec("output.weight", "lm_head.weight", (cfg.vocab_size, h)))
    used = {t.source for t in plan}
    absent = sorted(used - set(shapes))
    lost = sorted(set(shapes) - used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if absent or lost:
        raise ExportError(f"{WEIGHTS} does not match {CONFIG}: "
                          + (f"missing {absent[:3]}{' …' if len(absent) > 3 else ''} " if absent else "")
                          + (f"unexpected {lost[:3]}{' …' if len(lost) > 3 else ''}" if lost else ""))
    for t in plan:
        if tuple(shapes[t.source]) != t.shape:
            raise ExportError(f"{WEIGHTS}: {t.source} has shape {tuple(shapes[t.source])}, "
                              f"{CONFIG} implies {t.shape}")
    return plan


def load_tensor(spec: TensorSpec, weights: Callable[[str], np.ndarray]) -> np.ndarray:
    """``spec``'s float32 array in GGUF layout (q/k permuted) from ``weights(name)`` (shapes checked by
    :func:`tensor_plan`)."""
    w = np.ascontiguousarray(weights(spec.source), dtype=np.float32)
    return permute_qk(w, spec.permute_heads) if spec.permute_heads else w


def vocab_arrays(bundle: Path, n_vocab: int) -> tuple[list[str], list[int]]:
    """(tokens by id, token types) from tokenizer.json: byte-level BPE strings, specials CONTROL, other added
    tokens USER_DEFINED, ids up to ``n_vocab`` that the tokenizer lacks ``[PADn]`` UNUSED. Raises ExportError for
    a tokenizer that is not byte-level BPE, has holes in its ids, or is larger than the model's vocabulary."""
    t = json.loads((bundle / TOKENIZER).read_text(encoding="utf-8"))
    model = t.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or (t.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError(f"{bundle / TOKENIZER}: not a byte-level BPE tokenizer (llama.cpp's gpt2 model)")
    by_id: dict[int, tuple[str, int]] = {i: (s, TokenType.NORMAL) for s, i in model["vocab"].items()}
    for a in t.get("added_tokens", []):
        by_id[int(a["id"])] = (a["content"], TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED)
    n = max(by_id) + 1
    if n > n_vocab:
        raise ExportError(f"{TOKENIZER} has ids up to {n - 1}, the model's vocab_size is {n_vocab}")
    holes = [i for i in range(n) if i not in by_id]
    if holes:
        raise ExportError(f"{TOKENIZER}: no token with id {holes[0]} (ids must be contiguous)")
    by_id.update({i: (f"[PAD{i}]", TokenType.UNUSED) for i in range(n, n_vocab)})
    return [by_id[i][0] for i in range(n_vocab)], [int(by_id[i][1]) for i in range(n_vocab)]


def file_type(type: str) -> gguf.LlamaFileType:
    """``general.file_type`` of a GGUF written as ``type`` by gguf-py (llama.cpp sets its own for ``q4_k_m``)."""
    return getattr(gguf.LlamaFileType, GQ.FILE_TYPES[type])


def export_gguf(bundle: str | Path, out: str | Path | None = None, type: str = "f32", force: bool = False,
                log: Callable[[str], None] = print, *, approximate_pretokenizer: bool = False,
                val_data: str | Path | None = None) -> Path:
    """Write ``bundle`` as a GGUF file and return its path (default ``bundle/model-<type>.gguf``).

    ``type``: "f32", "f16", "q8_0", "q4_0" or "q4_k_m" for the 2-D weights (norms stay f32;
    :mod:`export.gguf_quant`). A quantized type passes the quality gate through llama.cpp on the bundle's validation
    text (its run's val shards, or ``val_data``) before it is put in place, and is recorded in the bundle's
    manifest; an ``out`` the manifest already records (same sha256) is left as it is ("nothing to do") unless
    ``force`` or ``val_data``. ``tokenizer.ggml.pre`` is the llama.cpp name of the bundle's split (:func:`llama_cpp_pre`);
    ``approximate_pretokenizer`` allows the ``qwen35`` approximation for a bundle made with tokenizer format 2 and
    changes nothing for a newer one. Raises PretokenizerError (an ExportError, exit code 2) for a tokenizer
    llama.cpp would split differently, ExportError for a folder that is not a bundle, an unknown type, a type whose
    quantizer is not installed, a tensor whose rows do not fill the type's blocks, an existing ``out`` that is not
    the recorded GGUF, without ``force``, a ``val_data`` that does not exist or is given for an unquantized type, weights/config/tokenizer that cannot be represented, or a failed write (naming the errno);
    QualityGateError (exit code 1) when the quantized GGUF fails its gate; nothing is left at ``out`` then.
    """
    s = GQ.scheme_of(type)
    bundle = Path(bundle)
    cfg = check_bundle(bundle)
    out = Path(out) if out is not None else bundle / gguf_file(type)
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder; give a file name")
    if val_data is not None and s is None:
        raise ExportError(f"--val-data {val_data}: --type {type} is not quantized, so it has no quality gate to "
                          "measure on it (drop --val-data, or choose a quantized --type)")
    if val_data is not None and not Path(val_data).exists():
        raise ExportError(f"--val-data {val_data}: no such file or directory")
    pre, record = llama_cpp_pre(bundle / TOKENIZER, approximate_pretokenizer)
    exact = record.startswith("exact:")
    if out.exists() and not force and val_data is None and _recorded(bundle, out, type):
        log(f"gguf: {out} is already the recorded {type} GGUF of {bundle}; nothing to do (use --force to rebuild it)")
    else:
        if out.exists() and not force:
            raise ExportError(f"{out} already exists and is not a GGUF recorded in {bundle}'s manifest "
                              "(use --force to replace it)")
        clean_stale(out.parent)
        try:
            with atomic_path(out) as tmp:
                write_gguf(bundle, tmp, type, approximate_pretokenizer=approximate_pretokenizer)
                entry = GQ.gate_gguf(bundle, tmp, s, out.name, val_data, log) if s is not None else None
        except OSError as e:
            raise ExportError(f"cannot write {out}: {e.strerror or e} ({errno.errorcode.get(e.errno, '?')}); "
                              "no GGUF was written") from None
        GQ.record(bundle, out, entry)
        log(f"gguf: wrote {out} ({type}, {out.stat().st_size / 1e6:.1f} MB, rope.freq_base {cfg.rope_theta:g}, "
            f"tokenizer.ggml.pre {pre}, " + ("exact for NFC text)" if exact
                                             else "an approximation: feed llama.cpp our token ids)"))
    if exact:
        try:
            mf = write_modelfile(out, bundle, cfg.max_position_embeddings, log)
        except OSError as e:
            raise ExportError(f"wrote {out}, but cannot write its {MODELFILE}: {e.strerror or e}") from None
        if mf is not None:
            log(f"gguf: wrote {mf} (FROM ./{out.name}): ollama create NAME -f {mf}")
    return out


def _recorded(bundle: Path, out: Path, type: str) -> bool:
    """True when ``out`` lies in ``bundle``, the manifest lists it with this very sha256 and size, and its
    ``general.file_type`` is ``type``'s: a GGUF that :func:`export_gguf` wrote from this bundle as this type (it
    records one only after the quality gate passed), so running the same command again has nothing to do. A
    re-export replaces the bundle and its manifest, so a GGUF of older weights is never listed."""
    if out.resolve().parent != bundle.resolve():
        return False
    try:
        entry = read_manifest(bundle)["files"].get(out.name)
    except ExportError:
        return False
    if entry is None or entry.get("bytes") != out.stat().st_size or entry != file_entry(out):
        return False
    try:
        field = gguf.GGUFReader(out).fields["general.file_type"]
        written = int(field.parts[field.data[0]][0])
    except (KeyError, IndexError, ValueError, OSError):
        return False
    want = gguf.LlamaFileType.MOSTLY_Q4_K_M if type == "q4_k_m" else file_type(type)
    return written == int(want)


def write_gguf(bundle: str | Path, path: str | Path, type: str, *, approximate_pretokenizer: bool = False) -> None:
    """Write ``bundle`` as a GGUF of ``type`` to ``path`` as it is — no quality gate, no manifest record, not atomic
    (:func:`export_gguf` puts all three around it; benchmarks/nll_quant.py uses it to measure a form the gate would
    refuse). ``q4_k_m`` goes through a float32 GGUF written beside ``path`` and removed after. Raises ExportError for
    a bundle, type, tokenizer or tensor shape it cannot take (the shapes are checked before anything is written) or
    a missing quantizer, OSError for a failed write."""
    s = GQ.scheme_of(type)
    bundle, path = Path(bundle), Path(path)
    cfg = check_bundle(bundle)
    with safe_open(str(bundle / WEIGHTS), framework="np") as st:
        plan = tensor_plan(cfg, {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    GQ.check_plan(type, [(t.source, t.role, t.shape) for t in plan])
    quantize = GQ.llama_quantizer(type) if s is not None and s.gguf_by == "llama.cpp" else None
    pre, record = llama_cpp_pre(bundle / TOKENIZER, approximate_pretokenizer)
    tok = (*vocab_arrays(bundle, cfg.vocab_size), pre, record)
    logging.getLogger("gguf").setLevel(logging.WARNING)  # the writer logs every step at INFO
    if quantize is None:
        _write(bundle, path, cfg, type, tok)
        return
    fd, name = tempfile.mkstemp(prefix=tmp_prefix(path.name + ".f32"), dir=path.parent)
    os.close(fd)
    try:
        _write(bundle, Path(name), cfg, "f32", tok)
        quantize(Path(name), path)
    finally:
        os.unlink(name)


def _description(record: str) -> str:
    if record.startswith("exact:"):
        return ("Shalik Llama-style model. llama.cpp tokenizes NFC text exactly as training did; normalise "
                "input to Unicode NFC first (Bangla nukta letters and vowel signs have two spellings)")
    return (f"Shalik Llama-style model. Pre-tokenizer {record}: llama.cpp splits text differently from training "
            "(digits, ZWJ/ZWNJ, no NFC); feed it the token ids of the bundle's tokenizer.json")


def _add_tokenizer(w: gguf.GGUFWriter, folder: Path, n_vocab: int, tok: tuple[list[str], list[int], str, str]) -> None:
    """The tokenizer keys (module doc) from ``folder``'s tokenizer files; ``tok`` = (tokens, token types,
    tokenizer.ggml.pre, shalik.pretokenizer). Raises ExportError when tokenizer.json has no merges."""
    tokens, toktypes, pre, record = tok
    w.add_string(PRETOKENIZER_KEY, record)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ExportError(f"{folder / TOKENIZER}: no BPE merges")
    # every training document and every prompt Shalik serves starts with <|endoftext|> (the bos id): llama.cpp,
    # Ollama and LM Studio prepend it themselves when add_bos_token is true
    special.add_special_token["bos"] = special.special_token_ids.get("bos") is not None
    special.add_special_token["eos"] = False
    # the chat format follows the bundle: a chat model (a chat template in tokenizer_config.json, and the tokens)
    # gets the template (llama.cpp detects ChatML from it without --jinja) and <|im_end|> as the end-of-turn
    # (end-of-generation) token; a base model, whose tokenizer reserves the tokens untrained, neither
    chat = is_chat_bundle(folder)
    special.chat_template = CHAT_TEMPLATE if chat else None
    special.add_to_gguf(w, quiet=True)
    if chat:
        w.add_eot_token_id(tokens.index(IM_END))


def _write(bundle: Path, path: Path, cfg: GgufConfig, type: str, tok: tuple[list[str], list[int], str, str]) -> None:
    """Write the GGUF to ``path`` (the caller makes it atomic), 2-D weights as :func:`export.gguf_quant.ggml_type`
    says; ``tok`` as :func:`_add_tokenizer` takes it. Raises OSError for a failed write."""
    with safe_open(str(bundle / WEIGHTS), framework="np") as st:
        w = gguf.GGUFWriter(path, ARCH)
        w.add_name(bundle.resolve().parent.name if bundle.name == "bundle" else bundle.resolve().name)
        w.add_description(_description(tok[3]))
        w.add_file_type(int(file_type(type)))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_vocab_size(cfg.vocab_size)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_dimension_count(cfg.head_dim)
        _add_tokenizer(w, bundle, cfg.vocab_size, tok)
        plan = tensor_plan(cfg, {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        qtypes = [GQ.ggml_type(type, t.role, t.shape) for t in plan]
        for t, q in zip(plan, qtypes):
            nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(t.shape, q)))
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=q)
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for t, q in zip(plan, qtypes):  # one tensor in memory at a time
                w.write_tensor_data(gguf.quants.quantize(load_tensor(t, st.get_tensor), q))
        finally:
            w.close()


def write_vocab_gguf(tokenizer_dir: str | Path, out: str | Path, *, approximate_pretokenizer: bool = False) -> Path:
    """Write a tokenizer folder (tokenizer.json, tokenizer_config.json) as a vocabulary-only GGUF and return ``out``.

    llama.cpp loads it with ``vocab_only`` (``llama_cpp.Llama(path, vocab_only=True)``; its own tokenizer tests
    use such files) to tokenize and detokenize without a model; the ``llama.*`` hyper-parameters are placeholders
    and there are no tensors. Same tokenizer keys and errors as :func:`export_gguf`; written atomically.
    """
    folder = Path(tokenizer_dir)
    if not (folder / TOKENIZER).is_file():
        raise ExportError(f"{folder}: no tokenizer.json")
    pre, record = llama_cpp_pre(folder / TOKENIZER, approximate_pretokenizer)
    t = json.loads((folder / TOKENIZER).read_text(encoding="utf-8"))
    n_vocab = 1 + max([*t.get("model", {}).get("vocab", {}).values(), *(a["id"] for a in t.get("added_tokens", []))])
    tokens, toktypes = vocab_arrays(folder, n_vocab)
    logging.getLogger("gguf").setLevel(logging.WARNING)
    out = Path(out)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_description(f"vocabulary only: {_description(record)}")
        w.add_vocab_size(n_vocab)
        for add in (w.add_context_length, w.add_embedding_length, w.add_feed_forward_length):
            add(64)
        w.add_block_count(1)
        w.add_head_count(1)
        w.add_head_count_kv(1)
        w.add_rope_dimension_count(64)
        w.add_layer_norm_rms_eps(1e-5)
        _add_tokenizer(w, folder, n_vocab, (tokens, toktypes, pre, record))
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
        finally:
            w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0 done, 1 the quality gate refused it, 2 bad input, 130 interrupted)."""
    p = argparse.ArgumentParser(prog="python -m export.gguf", description=__doc__.split("\n\n")[1],
                                formatter_class=HelpFormatter,
                                epilog="exit codes: 0 done, 1 the quality gate refused it, 2 bad input, 130 interrupted")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle folder written by python -m export.onnx")
    p.add_argument("--out", default=None, help="output file (default: BUNDLE/model-<type>.gguf)")
    p.add_argument("--type", default="f32", metavar="|".join(TYPES),  # checked by export_gguf: a one-line error
                   help="2-D weight type (default: f32; norms stay f32); q8_0 / q4_0 by gguf-py, q4_k_m by llama.cpp's "
                        "quantizer (llama-cpp-python); the quantized ones pass the quality gate through llama.cpp")
    p.add_argument("--val-data", default=None, metavar="PATH",
                   help="validation shards folder or text for the quality gate (default: the run's val shards, "
                        "found through the bundle's parent run folder)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--approximate-pretokenizer", action="store_true",
                   help=f"only for a bundle made with tokenizer format 2, which llama.cpp cannot split exactly: write "
                        f"tokenizer.ggml.pre = {APPROXIMATE_PRE} anyway (digits one per token, words broken at "
                        "ZWJ/ZWNJ; recorded in the GGUF) instead of refusing. A newer bundle needs no flag")
    a = p.parse_args(argv)
    return run_cli(lambda: export_gguf(a.bundle, a.out, a.type, a.force, val_data=a.val_data,
                                       approximate_pretokenizer=a.approximate_pretokenizer), "no GGUF was written")


if __name__ == "__main__":
    sys.exit(main())
