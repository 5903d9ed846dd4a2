"""The quantized ONNX graphs of a bundle: ``model.q8_0.onnx``, ``model.q4_0.onnx`` and ``model.q4_mix.onnx`` (the
schemes and which tensors stay at 8 bits: :mod:`contract.quant`; their file names: ``contract.bundle.ONNX_GRAPHS``;
their quality gate: :mod:`export.gate`).

All start from the float32 graph pre-processed by ``quant_pre_process(skip_symbolic_shape=True)`` (notes/
export-facts.md, "int8"): it runs onnxruntime's optimiser, which folds the tied lm_head ``Transpose`` into an
initializer of its own, so lm_head becomes a quantized matmul instead of a per-step dequantised transpose. Every
quantized matmul becomes onnxruntime's ``MatMulNBits`` (blocks of 32 along the input features, one float scale per
block, symmetric; ``accuracy_level`` 4: the activations are quantized to int8 per block and the dot products summed
in int32); the embedding ``Gather`` stays float32 and exact.

* 4 bits (``q4_0``, the bulk of ``q4_mix``): onnxruntime's ``MatMulNBitsQuantizer`` — llama.cpp's q4_0 layout of
  numbers (d = the weight of largest |w| / −8).
* 8 bits (every matrix of ``q8_0``; the tensors ``q4_mix`` keeps at 8 bits: the tied head, v and down projections):
  ggml's ``block_q8_0`` as gguf-py quantizes it (d = max|w| / 127 stored as float16, q = round(w / d)), written
  into ``MatMulNBits`` with bits = 8 (its default zero point 128: w = d · (stored − 128)) by :func:`to_q8_0`, so
  the ONNX graph holds the very numbers that ``rust_runtime`` and the GGUF hold. (onnxruntime's own 8-bit quantizer
  uses d = the weight of largest |w| / −128 instead.)

Which matmul multiplies by which weight is found by content (its initializer is the transpose of a
``model.safetensors`` tensor), not by the exporter's node names.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from onnx import helper, numpy_helper
from onnxruntime.quantization import quant_pre_process
from safetensors import safe_open

from contract.bundle import external_data
from contract.quant import Q8_BLOCK, Scheme, check_shape, role_of
from export.errors import ExportError


def _import_quietly():
    """onnxruntime's MatMulNBitsQuantizer, imported without the ``logging.basicConfig(level=INFO)`` its module runs
    on import (which would print every dependency's INFO records — the exporter's passes log hundreds — for the
    rest of the process): basicConfig does nothing while the root logger has a handler."""
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.removeHandler(guard)
    return MatMulNBitsQuantizer


MatMulNBitsQuantizer = _import_quietly()

ACCURACY_LEVEL = 4          # MatMulNBits: int8 activations, int32 accumulation
EXTERNAL_DATA_FROM = 6 * 2**30  # float32 data above this: the quantized graph may pass protobuf's 2 GB, use external data


def write_onnx_form(s: Scheme, src: Path, dst: Path, safetensors: Path | None = None) -> None:
    """Write scheme ``s``'s graph ``dst`` from the float32 graph ``src`` (external data beside it) and the bundle's
    ``safetensors`` (which weight each matmul holds: the roles kept at 8 bits and the shape checks).

    Scratch files live in a temporary folder beside ``dst`` and are removed. Raises ExportError when ``s`` has no
    ONNX form or a weight's rows do not fill whole blocks (:func:`contract.quant.check_shape`), else what
    onnxruntime raises."""
    if not s.onnx:
        raise ExportError(f"{s.name} has no ONNX form (onnxruntime offers no such kernel)")
    if safetensors is None:
        raise ExportError(f"{s.name}: the bundle's model.safetensors is needed to tell which matmul holds which weight")
    data = src.with_name(external_data(src.name))
    big = data.is_file() and data.stat().st_size > EXTERNAL_DATA_FROM
    with tempfile.TemporaryDirectory(prefix=f".{s.name}-", dir=dst.parent) as td, _quiet():
        pre = Path(td) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True, save_as_external_data=True,
                          all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
        model = onnx.load(str(pre))
        roles = matmul_weights(model, safetensors)
        for node, tensor in roles.items():
            shape = tuple(reversed(_initializer(model, _weight_input(model, node)).dims))
            try:
                check_shape(s, tensor, shape)
            except ValueError as e:
                raise ExportError(str(e)) from None
        keep = sorted(n for n, t in roles.items() if s.bits_of(role_of(t)) == 8)
        if len(keep) < len(roles):
            # nodes_to_exclude, not nodes_to_include: the quantizer takes every MatMul with a constant weight plus
            # the included ones (onnxruntime 1.32, MatMulNBitsQuantizer._process_subgraph)
            four = MatMulNBitsQuantizer(model, bits=s.bits, block_size=s.block, is_symmetric=True,
                                        accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=keep)
            four.process()
            model = four.model.model
        to_q8_0(model, keep)
        if big:
            onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=external_data(dst.name))
        else:
            onnx.save(model, str(dst))


def q8_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's q8_0 of a float32 weight ``w`` ``[out, in]`` (``in`` a multiple of 32), as gguf-py quantizes it:
    ``(q, d)`` with q int8 ``[out, in / 32, 32]`` and d float32 ``[out, in / 32]`` (float16 values), w ≈ d · q."""
    out, inp = w.shape
    raw = gguf_quantize(np.ascontiguousarray(w, dtype=np.float32), GGMLQuantizationType.Q8_0)
    raw = raw.reshape(out, inp // Q8_BLOCK, 2 + Q8_BLOCK)
    d = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(raw[..., 2:]).view(np.int8)
    return q, d


def to_q8_0(model: onnx.ModelProto, nodes: list[str]) -> None:
    """Replace, in place, each MatMul of ``nodes`` (names; its second input a float32 initializer ``[in, out]``) by
    a ``MatMulNBits`` (bits 8, block 32, ``accuracy_level`` :data:`ACCURACY_LEVEL`, no zero-point input: 128)
    holding the q8_0 blocks of the weight (:func:`q8_0_blocks` of its transpose): the stored byte is q + 128 and
    the scale d. An initializer no other node reads any more is dropped."""
    if not nodes:
        return
    inits = {t.name: t for t in model.graph.initializer}
    wanted = set(nodes)
    graph_nodes = list(model.graph.node)
    for i, n in enumerate(graph_nodes):
        if n.name not in wanted:
            continue
        w = numpy_helper.to_array(inits[n.input[1]]).T  # [out, in], nn.Linear's layout
        q, d = q8_0_blocks(w)
        stored = (q.astype(np.int16) + 128).astype(np.uint8)
        b_name, s_name = f"{n.input[1]}_Q8", f"{n.input[1]}_scales"   # onnxruntime's quantizer's names
        model.graph.initializer.extend([numpy_helper.from_array(stored, b_name), numpy_helper.from_array(d, s_name)])
        graph_nodes[i] = helper.make_node("MatMulNBits", [n.input[0], b_name, s_name], list(n.output),
                                          name=f"{n.name}_Q8", domain="com.microsoft", K=w.shape[1], N=w.shape[0],
                                          bits=8, block_size=Q8_BLOCK, accuracy_level=ACCURACY_LEVEL)
    del model.graph.node[:]
    model.graph.node.extend(graph_nodes)
    used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto | None:
    for t in model.graph.initializer:
        if t.name == name:
            return t
    return None


def _weight_input(model: onnx.ModelProto, node_name: str) -> str:
    return next(n.input[1] for n in model.graph.node if n.name == node_name)


def matmul_weights(model: onnx.ModelProto, safetensors: Path) -> dict[str, str]:
    """``{MatMul node name: safetensors tensor name}`` for every MatMul whose second input is a 2-D initializer
    equal, bit for bit, to the transpose of a weight of ``safetensors`` (a tied lm_head matches
    ``model.embed_tokens.weight``); matched by sha256 of the float32 bytes, one tensor in memory at a time.
    Raises ExportError when a weight matmul matches no tensor: the graph is not this bundle's."""
    inits = {t.name: t for t in model.graph.initializer if len(t.dims) == 2}
    nodes = [n for n in model.graph.node if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits]
    with safe_open(str(safetensors), framework="np") as st:
        digests = {_digest(np.asarray(st.get_tensor(k), dtype=np.float32).T): k for k in st.keys()
                   if len(st.get_slice(k).get_shape()) == 2}
    out: dict[str, str] = {}
    for n in nodes:
        w = numpy_helper.to_array(inits[n.input[1]])
        name = digests.get(_digest(w)) if w.dtype == np.float32 else None
        if name is None:
            raise ExportError(f"the ONNX graph's matmul {n.name} ({list(w.shape)}) multiplies by no weight of "
                              f"{safetensors.name}: the graph is not this bundle's")
        out[n.name] = name
    return out


def _digest(a: np.ndarray) -> tuple[tuple[int, ...], str]:
    return a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@contextlib.contextmanager
def _quiet():
    """Silence onnxruntime.quantization's logging and prints for the duration."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    quant_logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    quant_level = quant_logger.level
    quant_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)
        quant_logger.setLevel(quant_level)
