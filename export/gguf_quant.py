"""The quantized GGUF types of ``python -m export.gguf`` (``--type q8_0 | q4_0 | q4_k_m``): which ggml type each
tensor gets, llama.cpp's quantizer for the K-quant mix, and the quality gate of a written GGUF.

The schemes are :mod:`contract.quant`'s (a GGUF type is a scheme's ``gguf``):

* ``q8_0`` and ``q4_0`` are written by gguf-py's quantizers, tensor by tensor: every 2-D weight
  at the scheme's type, norms F32.
* ``q4_k_m`` (:data:`contract.quant.GGUF_ONLY`) is llama.cpp's own ``Q4_K_M`` mix (Q4_K with Q6_K for the output and
  half of attn_v / ffn_down), made by ``llama_model_quantize`` — llama-cpp-python's binding to llama.cpp's quantizer
  (the ``bench`` extra; gguf-py has no K-quant quantizer) — from a float32 GGUF written first beside the output and
  removed after.

Every row (a weight's input features) must fill whole blocks: 32 for Q8_0 / Q4_0, 256 for the K-quants'
super-blocks; a tensor that does not is refused before anything is written (:func:`check_plan`).

The gate: llama.cpp (llama-cpp-python, float32 KV cache) reads the written GGUF and runs the bundle's validation
windows, compared with the bundle's float32 ``model.onnx`` per language (:mod:`export.gate`); a GGUF that fails
is removed, one that passes is recorded in the bundle's ``manifest.json`` (``quantization.forms["llama.cpp
<scheme>"]``, and the file in ``files`` when it lies in the bundle). Without llama-cpp-python or validation data
the GGUF is written and recorded as not measured, with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from contract import bundle as B
from contract.quant import GGUF_ONLY, SCHEMES, QuantizeError, Scheme, check_shape
from export.errors import ExportError

FLOAT_TYPES = ("f32", "f16")
BY_TYPE: dict[str, Scheme] = {s.gguf: s for s in (*SCHEMES.values(), *GGUF_ONLY.values()) if s.gguf}
TYPES = (*FLOAT_TYPES, *BY_TYPE)
GGML = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}   # gguf-py's quantizers, by contract.quant block type
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}   # general.file_type of what gguf-py writes ("mostly": the bulk's type)
K_SUPER_BLOCK = 256                    # llama.cpp's K-quants (Q4_K, Q6_K): 256 weights a super-block
# llama.h's file types of llama.cpp's quantizer: q4_k_m is only made by it (BY_TYPE's gguf_by); q4_0 is also its
# rule set (the output matrix kept at Q6_K), which the benchmarks compare against beside gguf-py's pure q4_0
LLAMA_FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
INSTALL_HINT = ("pip install llama-cpp-python (the bench extra: pip install -e \".[bench]\"; a source build of "
                "llama.cpp, minutes: benchmarks/README.md, Build and test times)")


def scheme_of(type: str) -> Scheme | None:
    """The :class:`contract.quant.Scheme` a GGUF ``--type`` writes (None for f32 / f16). ExportError for an unknown
    type, naming the allowed ones."""
    if type in FLOAT_TYPES:
        return None
    if type not in BY_TYPE:
        raise ExportError(f"--type {type!r}: expected one of {', '.join(TYPES)}")
    return BY_TYPE[type]


def ggml_type(type: str, role: str | None, shape: tuple[int, ...]) -> Q:
    """The ggml type gguf-py writes a tensor as: 1-D (norms) and ``f32`` F32, ``f16`` F16, else the scheme's bit
    type for ``role`` (:data:`contract.quant.ROLES`) — Q8_0 or Q4_0. Not for llama.cpp's types (``q4_k_m``)."""
    if len(shape) == 1 or type == "f32":
        return Q.F32
    if type == "f16":
        return Q.F16
    s = scheme_of(type)
    if s.gguf_by != "gguf-py":
        raise ExportError(f"--type {type}: written by llama.cpp's quantizer, not tensor by tensor")
    return GGML[s.storage(role)]


def check_plan(type: str, tensors: list[tuple[str, str | None, tuple[int, ...]]]) -> None:
    """Refuse the first 2-D tensor ``(name, role, shape)`` whose rows ``type`` cannot cut into whole blocks
    (ExportError naming the tensor, its shape, the block and the types that would take it)."""
    s = scheme_of(type)
    if s is None:
        return
    for name, role, shape in tensors:
        if len(shape) != 2:
            continue
        try:
            if s.gguf_by == "llama.cpp":   # every tensor of llama.cpp's K-quant mix is a K-quant (super-block 256)
                if shape[-1] % K_SUPER_BLOCK:
                    fits = [t for t, o in BY_TYPE.items() if o.gguf_by == "gguf-py" and shape[-1] % o.block == 0]
                    raise QuantizeError(
                        f"{name} {list(shape)}: --type {type} is llama.cpp's K-quant mix, whose super-blocks of "
                        f"{K_SUPER_BLOCK} must divide its {shape[-1]} input features; types that fit: "
                        f"{', '.join([*FLOAT_TYPES, *fits])}")
            else:
                check_shape(s, name, shape, role)
        except QuantizeError as e:
            raise ExportError(f"{e}; no GGUF was written") from None


def llama_quantizer(type: str, threads: int = 0) -> Callable[[Path, Path], None]:
    """``quantize(src, dst)``: llama.cpp's ``llama_model_quantize`` from a float32 GGUF ``src`` to ``dst`` as
    ``type`` (a key of :data:`LLAMA_FTYPES`) on ``threads`` threads (0: all cores). Raises ExportError for another
    type, naming what to install when llama-cpp-python is absent, and the status when llama.cpp fails."""
    if type not in LLAMA_FTYPES:
        raise ExportError(f"type is {type!r}; llama.cpp's quantizer makes here one of {', '.join(LLAMA_FTYPES)}")
    try:
        import llama_cpp.llama_cpp as C  # deferred: the optional bench extra
    except ImportError as e:
        raise ExportError(f"--type {type} needs llama.cpp's quantizer, which is not importable here ({e}): "
                          f"{INSTALL_HINT}; or choose --type {', '.join(t for t, s in BY_TYPE.items() if s.gguf_by != 'llama.cpp')}"
                          ) from None
    ftype = getattr(C, LLAMA_FTYPES[type])

    def quantize(src: Path, dst: Path) -> None:
        params = C.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = threads                # 0: llama.cpp's hardware_concurrency
        with _quiet_stderr():
            rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        if rc != 0:
            raise ExportError(f"llama.cpp's quantizer failed on {src.name} (status {rc}); no GGUF was written")
    return quantize


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 (llama.cpp's C logging) to /dev/null for the duration."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def gate_gguf(bundle: Path, path: Path, s: Scheme, name: str, val_data: str | Path | None,
              log: Callable[[str], None]) -> dict:
    """The ``quantization`` entry (:func:`export.gate.gate_entry`) of the GGUF at ``path`` (``name``: its final
    file name) through llama.cpp against ``bundle``'s float32 ``model.onnx``; its form recorded unmeasured, with
    the reason, when llama-cpp-python or validation data is missing. Raises QualityGateError when it fails."""
    from export import gate as G
    from export.valdata import bundle_val_data

    form = G.Form("llama.cpp", s, None, name)
    try:
        import llama_cpp  # noqa: F401 - deferred: the optional bench extra
    except ImportError as e:
        why = f"llama-cpp-python is not importable ({e}); {INSTALL_HINT} to measure it"
        log(f"gguf: quality gate not measured: {why}")
        return G.gate_entry(None, [form], None, why)
    val, why = bundle_val_data(bundle, val_data)
    if val is None:
        log(f"gguf: quality gate not measured: {why}")
        return G.gate_entry(None, [form], None, why)
    from serve.backends.llamacpp import LlamaCppBackend

    lc = LlamaCppBackend(path, logits_all=True)
    try:
        form = G.Form("llama.cpp", s, lambda ids: lc.new_sequence().prefill(ids, all_logits=True), name)
        entry = G.gate_entry(G.reference_logits(bundle), [form], val)
    finally:
        lc.close()
    r = entry["forms"][form.name]
    log(f"gguf: quality gate {'passed' if r['ok'] else 'FAILED'}: ΔNLL {r['all']['delta']:+.4f}, top-1 "
        f"{r['all']['top1_agreement']:.3f}, mean |Δ log p| {r['all']['mean_abs_top_logprob_delta']:.4f} "
        f"({entry['tokens']:,} tokens)")
    G.enforce(entry, f"{name} was not written", log)
    return entry


def record(bundle: Path, out: Path, entry: dict | None) -> None:
    """Record a written GGUF in ``bundle``'s ``manifest.json`` (:func:`contract.bundle.update_manifest`, atomic): its
    sha256 and size in ``files`` when it lies in the bundle folder, and its gate ``entry`` (None for f32 / f16)
    merged into ``quantization``; a float GGUF outside the bundle leaves the manifest alone. ExportError for a
    manifest this version cannot read."""
    from export.gate import MANIFEST_KEY, merge

    inside = out.resolve().parent == bundle.resolve()
    if not inside and entry is None:
        return
    try:
        m = B.read_manifest(bundle)
        fields = {MANIFEST_KEY: merge(m.get(MANIFEST_KEY), entry)} if entry is not None else {}
        B.update_manifest(bundle, [out.name] if inside else [], **fields)
    except B.BundleError as e:
        raise ExportError(f"{out} was written but cannot be recorded: {e}") from None
