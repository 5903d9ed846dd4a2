"""The quantized ONNX graphs of a bundle: ``model.int8.onnx``, ``model.q4_0.onnx`` and ``model.q4_mix.onnx`` (the
schemes and which tensors stay at 8 bits: :mod:`contract.quant`; their file names: ``contract.bundle.ONNX_GRAPHS``; their
quality gate: :mod:`export.gate`).

Both start from the float32 graph pre-processed by ``quant_pre_process(skip_symbolic_shape=True)`` (notes/
export-facts.md, "int8"): it runs onnxruntime's optimiser, which folds the tied lm_head ``Transpose`` into an
initializer of its own, so lm_head becomes a quantized matmul instead of a per-step dequantised transpose.

* ``int8``: ``quantize_dynamic`` with QInt8 weights, per channel, MatMul only (the embedding ``Gather`` stays
  float32 and exact): ``MatMulInteger`` with ``DynamicQuantizeLinear`` activations.
* ``q4_0`` / ``q4_mix``: onnxruntime's ``MatMulNBitsQuantizer`` (``MatMulNBits``: 4-bit weights, blocks of 32 along the input
  features, one float scale per block, symmetric — llama.cpp's q4_0 layout of numbers; ``accuracy_level`` 4: the
  activations are quantized to int8 per block and the dot products summed in int32). The weights the scheme keeps
  at 8 bits (``q4_mix``: the tied head, v and down projections) get ``MatMulNBits`` with 8 bits, block 32 (q8_0's
  numbers). Which matmul multiplies by
  which weight is found by content (its initializer is the transpose of a ``model.safetensors`` tensor), not by
  the exporter's node names.
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
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic
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
    ``safetensors`` (which weight each matmul holds: the roles kept at 8 bits and the shape checks of a 4-bit
    scheme; not read for int8, which may pass None).

    Scratch files live in a temporary folder beside ``dst`` and are removed. Raises ExportError when ``s`` has no
    ONNX form or a weight's rows do not fill whole blocks (:func:`contract.quant.check_shape`), else what
    onnxruntime raises."""
    if not s.onnx:
        raise ExportError(f"{s.name} has no ONNX form (onnxruntime offers no such kernel)")
    data = src.with_name(external_data(src.name))
    big = data.is_file() and data.stat().st_size > EXTERNAL_DATA_FROM
    with tempfile.TemporaryDirectory(prefix=f".{s.name}-", dir=dst.parent) as td, _quiet():
        pre = Path(td) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True, save_as_external_data=True,
                          all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
        if s.bits == 8:
            quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"], use_external_data_format=big)
            return
        if safetensors is None:
            raise ExportError(f"{s.name}: the bundle's model.safetensors is needed to tell which matmul holds which "
                              "weight")
        model = onnx.load(str(pre))
        roles = matmul_weights(model, safetensors)
        for node, tensor in roles.items():
            shape = tuple(reversed(_initializer(model, _weight_input(model, node)).dims))
            try:
                check_shape(s, tensor, shape)
            except ValueError as e:
                raise ExportError(str(e)) from None
        keep = sorted(n for n, t in roles.items() if s.bits_of(role_of(t)) == 8)
        # nodes_to_exclude, not nodes_to_include: the quantizer takes every MatMul with a constant weight plus the
        # included ones (onnxruntime 1.32, MatMulNBitsQuantizer._process_subgraph)
        four = MatMulNBitsQuantizer(model, bits=s.bits, block_size=s.block, is_symmetric=True,
                                    accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=keep)
        four.process()
        model = four.model.model
        if keep:
            eight = MatMulNBitsQuantizer(model, bits=8, block_size=Q8_BLOCK, is_symmetric=True,
                                         accuracy_level=ACCURACY_LEVEL)
            eight.process()
            model = eight.model.model
        if big:
            onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=external_data(dst.name))
        else:
            onnx.save(model, str(dst))


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
