"""``model.int8.onnx``: onnxruntime dynamic quantisation of the fp32 graph, and its validation NLL change.

Recipe (notes/export-facts.md, "int8"): ``quant_pre_process(skip_symbolic_shape=True)`` first — it runs ORT's
optimiser, which folds the tied lm_head ``Transpose`` into its own initializer, so lm_head becomes a
``MatMulInteger`` instead of a per-step dequantised transpose — then ``quantize_dynamic`` with QInt8 weights, per
channel, MatMul only (the embedding ``Gather`` stays fp32 and exact).

Measured on the same validation windows through serve's OnnxBackend, per language and over all, against the
fp32 graph: the NLL change (nats/token, int8 minus fp32; at most :data:`TARGET`), the top-1 agreement (share
of positions where int8's argmax equals fp32's; at least :data:`TOP1_MIN`) and the mean |Δ log p| of fp32's
top token (nats; at most :data:`LOGPROB_MAX`). An NLL average can hide a quantisation that changes which token
wins; the two per-position figures cannot. Any language over a threshold fails the gate. The thresholds come
from measurement (benchmarks/results/int8_agreement.md): the trained tiny fixture (hidden 64) gives top-1 1.000
and |Δ log p| 0.013 (bn) / 0.034 (en); a random-init model of the small config's shape (hidden 512, 6 layers,
vocab 32000), the worst case because its near-flat logits are full of near-ties, gives top-1 0.923 and
|Δ log p| 0.027. The limits (0.85, 0.1 nats) sit below / about 3x above the worst measured figure, while a broken
quantisation (wrong scales, a dropped matrix) lands far outside them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import numpy as np
from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

from export.valdata import ValData
from serve.backends.onnx import OnnxBackend

TARGET = 0.05         # val NLL change, nats/token
TOP1_MIN = 0.85       # top-1 agreement with fp32, per language (measured 0.92 at worst: module doc)
LOGPROB_MAX = 0.1     # mean |log p_int8(t) - log p_fp32(t)| for fp32's top token t, nats, per language (0.034)
BATCH = 4
ROWS = 256            # positions per block when comparing logits (bounds the float64 copies)


def quantize_int8(src: Path, dst: Path) -> None:
    """Write the int8 graph ``dst`` from the fp32 graph ``src`` (with its external data beside it).

    Scratch files live in a temporary folder beside ``dst`` and are removed. Raises what onnxruntime raises.
    """
    data = src.with_name(src.name + ".data")
    big = data.is_file() and data.stat().st_size > 6 * 2**30   # int8 output would pass protobuf's 2 GB
    with tempfile.TemporaryDirectory(prefix=".int8-", dir=dst.parent) as td, _quiet():
        pre = Path(td) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True, save_as_external_data=True,
                          all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
        quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"], use_external_data_format=big)


def _batches(val: ValData):
    """``(lang, x, y)`` batches: windows of equal length, :data:`BATCH` at a time; x inputs, y targets (int64)."""
    for lang, windows in val.windows.items():
        by_len: dict[int, list[np.ndarray]] = {}
        for w in windows:
            by_len.setdefault(len(w), []).append(w)
        for _length, group in sorted(by_len.items()):
            for i in range(0, len(group), BATCH):
                batch = np.stack(group[i:i + BATCH])
                yield lang, batch[:, :-1], batch[:, 1:]


def _forward(backend, x: np.ndarray) -> np.ndarray:
    b, t = x.shape
    pos = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t))
    return backend.forward(x, np.ones((b, t), dtype=np.int64), pos, None)[0]


def _log_softmax(blk: np.ndarray) -> np.ndarray:
    blk = np.asarray(blk, dtype=np.float64)
    m = blk.max(-1, keepdims=True)
    return blk - m - np.log(np.exp(blk - m).sum(-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Sums over positions of ``ref`` (fp32) vs ``got`` (int8) logits ``[..., V]`` with ``targets`` ``[...]``:
    ``{positions, nll_ref, nll_got, top1_agree, top_logprob_absdiff}`` — NLL sums in nats, the count of positions
    whose argmax agree, and the sum of |log p_got(t) - log p_ref(t)| for t = ref's argmax."""
    r = ref.reshape(-1, ref.shape[-1])
    g = got.reshape(-1, got.shape[-1])
    tg = targets.reshape(-1)
    out = {"positions": 0, "nll_ref": 0.0, "nll_got": 0.0, "top1_agree": 0, "top_logprob_absdiff": 0.0}
    for i in range(0, r.shape[0], ROWS):
        lr, lg = _log_softmax(r[i:i + ROWS]), _log_softmax(g[i:i + ROWS])
        rows = np.arange(len(lr))
        t, top = tg[i:i + ROWS], lr.argmax(-1)
        out["positions"] += len(lr)
        out["nll_ref"] -= float(lr[rows, t].sum())
        out["nll_got"] -= float(lg[rows, t].sum())
        out["top1_agree"] += int((lg.argmax(-1) == top).sum())
        out["top_logprob_absdiff"] += float(np.abs(lg[rows, top] - lr[rows, top]).sum())
    return out


def compare_int8(fp32, int8, val: ValData) -> dict[str, dict]:
    """``{lang: {…}, "all": {…}}`` with ``fp32``/``int8`` NLL (nats/token), ``delta``, ``top1_agreement``
    (0..1), ``mean_abs_top_logprob_delta`` (nats) and ``tokens``, from the two backends' ``forward`` (numpy) on
    the same windows."""
    sums: dict[str, dict] = {}
    for lang, x, y in _batches(val):
        c = compare_logits(_forward(fp32, x), _forward(int8, x), y)
        for key in (lang, "all"):
            acc = sums.setdefault(key, dict.fromkeys(c, 0))
            for k, v in c.items():
                acc[k] += v
    out = {}
    for key, c in sums.items():
        n = c["positions"]
        out[key] = {"fp32": c["nll_ref"] / n, "int8": c["nll_got"] / n, "delta": (c["nll_got"] - c["nll_ref"]) / n,
                    "top1_agreement": c["top1_agree"] / n, "mean_abs_top_logprob_delta": c["top_logprob_absdiff"] / n,
                    "tokens": n}
    return {"all": out.pop("all"), **out} if "all" in out else out


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
    """The manifest's ``int8`` entry: ``{val_nll_delta, val_nll_fp32, val_nll_int8, top1_agreement,
    mean_abs_top_logprob_delta, by_lang: {lang: {fp32, int8, delta, top1_agreement, mean_abs_top_logprob_delta,
    tokens, ok}}, tokens, data, target, thresholds, ok}``; ``ok`` is false when any language (or all) breaks a
    threshold (module doc). ``val_nll_delta`` is None (and ``ok`` True) when there is no validation data."""
    thresholds = {"val_nll_delta_max": TARGET, "top1_agreement_min": TOP1_MIN,
                  "mean_abs_top_logprob_delta_max": LOGPROB_MAX}
    if val is None:
        return {"val_nll_delta": None, "target": TARGET, "thresholds": thresholds, "ok": True,
                "note": "no validation data found (pass --val-data PATH); the int8 change was not measured"}
    stats = compare_int8(OnnxBackend(bundle), OnnxBackend(bundle, quantize="int8"), val)
    for v in stats.values():
        v["ok"] = passes(v)
    a = stats.pop("all")
    return {"val_nll_delta": a["delta"], "val_nll_fp32": a["fp32"], "val_nll_int8": a["int8"],
            "top1_agreement": a["top1_agreement"], "mean_abs_top_logprob_delta": a["mean_abs_top_logprob_delta"],
            "by_lang": stats, "tokens": a["tokens"], "data": val.origin, "target": TARGET, "thresholds": thresholds,
            "ok": bool(a["ok"] and all(v["ok"] for v in stats.values()))}


def passes(v: dict) -> bool:
    """One language's (or all's) figures within :data:`TARGET`, :data:`TOP1_MIN` and :data:`LOGPROB_MAX`."""
    return bool(np.isfinite(v["delta"]) and v["delta"] <= TARGET and v["top1_agreement"] >= TOP1_MIN
                and v["mean_abs_top_logprob_delta"] <= LOGPROB_MAX)


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
