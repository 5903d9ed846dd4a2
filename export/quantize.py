"""``model.int8.onnx``: onnxruntime dynamic quantisation of the fp32 graph, and its validation NLL change.

Recipe (notes/export-facts.md, "int8"): ``quant_pre_process(skip_symbolic_shape=True)`` first — it runs ORT's
optimiser, which folds the tied lm_head ``Transpose`` into its own initializer, so lm_head becomes a
``MatMulInteger`` instead of a per-step dequantised transpose — then ``quantize_dynamic`` with QInt8 weights, per
channel, MatMul only (the embedding ``Gather`` stays fp32 and exact).

The change is measured as validation NLL (nats/token) of the int8 graph minus that of the fp32 graph, both
through serve's OnnxBackend on the same windows; the target is at most :data:`TARGET` nats/token.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np

from export.valdata import ValData

TARGET = 0.05
INT8_FILE = "model.int8.onnx"
BATCH = 4


def quantize_int8(src: Path, dst: Path) -> None:
    """Write the int8 graph ``dst`` from the fp32 graph ``src`` (with its external data beside it).

    Scratch files live in a temporary folder beside ``dst`` and are removed. Raises what onnxruntime raises.
    """
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    data = src.with_name(src.name + ".data")
    big = data.is_file() and data.stat().st_size > 6 * 2**30   # int8 output would pass protobuf's 2 GB
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=dst.parent) as td, _quiet():
        pre = Path(td) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True, save_as_external_data=True,
                          all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
        quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"], use_external_data_format=big)


def val_nll(backend, val: ValData) -> dict[str, dict]:
    """``{lang: {nll, tokens}, "all": {…}}`` in nats/token through ``backend.forward`` (numpy), windows of equal
    length batched by :data:`BATCH`."""
    out, tot_sum, tot_n = {}, 0.0, 0
    for lang, windows in val.windows.items():
        s, n = 0.0, 0
        by_len: dict[int, list[np.ndarray]] = {}
        for w in windows:
            by_len.setdefault(len(w), []).append(w)
        for _length, group in sorted(by_len.items()):
            for i in range(0, len(group), BATCH):
                batch = np.stack(group[i:i + BATCH])
                x, y = batch[:, :-1], batch[:, 1:]
                b, t = x.shape
                pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t))
                logits, _ = backend.forward(x, np.ones((b, t), dtype=np.int64), pos, None)
                s += nll_sum(logits, y)
                n += b * t
        if n:
            out[lang] = {"nll": s / n, "tokens": n}
            tot_sum, tot_n = tot_sum + s, tot_n + n
    if tot_n:
        out = {"all": {"nll": tot_sum / tot_n, "tokens": tot_n}, **out}
    return out


def nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over positions of ``-log softmax(logits)[target]`` in nats; logits float ``[..., V]``, targets int
    ``[...]``. Row by row in float32 (a ``[8, 512, 32000]`` float64 copy would take 1 GB)."""
    lg = logits.reshape(-1, logits.shape[-1])
    tg = targets.reshape(-1)
    total = 0.0
    for i in range(0, lg.shape[0], 256):
        blk = np.asarray(lg[i:i + 256], dtype=np.float32)
        m = blk.max(-1, keepdims=True)
        lse = m[:, 0].astype(np.float64) + np.log(np.exp(blk - m).sum(-1, dtype=np.float64))
        total += float((lse - blk[np.arange(len(blk)), tg[i:i + 256]]).sum())
    return total


def int8_report(bundle: Path, val: ValData | None) -> dict:
    """``{val_nll_delta, val_nll_fp32, val_nll_int8, by_lang, tokens, data, target, ok}`` for the manifest;
    ``val_nll_delta`` is None (and ``ok`` True) when there is no validation data to measure on."""
    if val is None:
        return {"val_nll_delta": None, "target": TARGET, "ok": True,
                "note": "no validation data found (pass --val-data PATH); the int8 change was not measured"}
    from serve.backends.onnx import OnnxBackend

    fp32 = val_nll(OnnxBackend(bundle), val)
    int8 = val_nll(OnnxBackend(bundle, quantize="int8"), val)
    delta = int8["all"]["nll"] - fp32["all"]["nll"]
    by_lang = {k: {"fp32": fp32[k]["nll"], "int8": int8[k]["nll"], "delta": int8[k]["nll"] - fp32[k]["nll"],
                   "tokens": fp32[k]["tokens"]} for k in fp32 if k != "all"}
    return {"val_nll_delta": delta, "val_nll_fp32": fp32["all"]["nll"], "val_nll_int8": int8["all"]["nll"],
            "by_lang": by_lang, "tokens": fp32["all"]["tokens"], "data": val.origin, "target": TARGET,
            "ok": bool(np.isfinite(delta) and delta <= TARGET)}


@contextlib.contextmanager
def _quiet():
    """Silence onnxruntime.quantization's logging and prints for the duration."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)
