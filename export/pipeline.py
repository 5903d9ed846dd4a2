"""The bundle pipeline behind ``python -m export.onnx`` (:mod:`export.onnx` is its command line).

Turns a checkpoint (a step folder, a ``checkpoints/`` folder or a run folder, meaning its latest checkpoint) into
the bundle of docs/design.md — ``model.safetensors``, ``config.json``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``model.onnx`` + ``model.onnx.data`` (+ ``model.int8.onnx``),
``README.md`` (model card) and ``manifest.json`` — and refuses to finish unless the bundle computes what the
checkpoint computes (the parity gate, :mod:`export.parity`).

The bundle is built in a temporary folder beside the output and put in place at the end
(``train.atomic.atomic_dir``, one atomic exchange when replacing): a failure, a failed gate or Ctrl-C leaves no
partial bundle, and ``--force`` replaces an existing bundle (never another folder, :mod:`export.target`) only once
the new one is complete. Exporter: dynamo (``torch.export``) first; if it raises or its graph fails the ONNX
parity cases, TorchScript; the manifest records which.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from export import bundle as B
from export import parity as P
from export.card import render_card, write_card
from export.errors import ExportError, ParityError
from export.graph import EXPORTERS, OPSET, export_graph
from export.quantize import LOGPROB_MAX, TARGET, TOP1_MIN, int8_report, quantize_int8
from export.runinfo import data_summary, eval_summary
from export.source import Source, load_source
from export.target import check_target, os_error_in, write_error
from export.valdata import find_run_shards, from_shards, load_val_data, run_seq_len
from serve.bundle import CARD, ONNX, ONNX_INT8, TOKENIZER, BundleError, read_manifest
from train.atomic import atomic_dir, clean_stale, sha256_file

__all__ = ["DTYPES", "ExportError", "ParityError", "export_bundle"]

DTYPES = ("float32", "float16")



def _up_to_date(src: Source, out: Path, dtype: str, quantize: str | None, parity: bool) -> bool:
    """True when ``out`` is a complete bundle of this very checkpoint with the same dtype, an int8 model when one
    is asked for (an extra one does no harm), and a passed gate: re-running the README's main job then skips
    the export instead of failing."""
    try:
        m = read_manifest(out)
    except BundleError:
        return False
    return (m.get("source", {}).get("sha256") == src.sha256
            and m.get("dtype", "float32") == dtype and (quantize != "int8" or bool(m.get("int8")))
            and (not parity or bool(m.get("parity", {}).get("ok"))))


def _check_out(src: Source, out: Path, force: bool) -> None:
    """Refuse an output that may not be replaced (:func:`export.target.check_target`) or that would replace or
    lie inside the checkpoint itself."""
    if out.exists() and not force:
        raise ExportError(f"{out} already exists and is not an up-to-date bundle of {src.ckpt} "
                          f"(use --force to replace it)")
    o, c = out.resolve(), src.ckpt.resolve()
    if o == c or o in c.parents:
        raise ExportError(f"--out {out} would replace the checkpoint {src.ckpt} it is exported from")
    if c in o.parents:
        raise ExportError(f"--out {out} lies inside the checkpoint folder {src.ckpt} (its SHA256SUMS would no longer "
                          "describe it); choose another folder")
    check_target(out, force)


def _val_data(src: Source, val_data: str | Path | None, log: Callable[[str], None]):
    """Validation windows for the int8 measurement (ExportError for a bad --val-data; None when none found)."""
    tok = src.ckpt / TOKENIZER
    seq = run_seq_len(src.run_dir, src.cfg.max_position_embeddings)
    if val_data is not None:
        return load_val_data(Path(val_data), src.cfg.vocab_size, tok, src.eot_id, seq)
    shards = find_run_shards(src.run_dir, tok)
    if shards is None:
        log("int8: no validation shards found through the run's config.toml (pass --val-data PATH); "
            "the NLL change will not be measured")
        return None
    return from_shards(shards, src.cfg.vocab_size, sha256_file(tok), seq)


def _build_graph(src: Source, tmp: Path, dtype: str, exporter: str, greedy_ref, log) -> tuple[str, list]:
    """Export ``tmp/model.onnx`` with the first exporter whose graph passes the ONNX cases (all of them when
    ``greedy_ref`` is None, i.e. without the gate: the first that exports). Returns (exporter, ONNX rows)."""
    order = list(EXPORTERS) if exporter == "auto" else [exporter]
    errors: list[str] = []
    last: tuple[str, list] | None = None
    for ex in order:
        t = time.time()
        try:
            export_graph(src.model, tmp / ONNX, ex, dtype)
        except Exception as e:  # noqa: BLE001 - any exporter failure means: try the next exporter
            if os_error_in(e) is not None:   # a full disk or a vanished folder is not the exporter's failure
                raise os_error_in(e) from e
            errors.append(f"{ex}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            log(f"onnx: the {ex} exporter failed ({errors[-1]})")
            continue
        log(f"onnx: {ex} export took {time.time() - t:.1f} s")
        if greedy_ref is None:
            return ex, []
        rows = P.onnx_cases(tmp, src.model, src.pad_id, greedy_ref, dtype, runtime=f"onnx ({ex})")
        if P.all_ok(rows):
            return ex, rows
        log(f"onnx: the {ex} graph fails parity:\n{P.format_table(rows)}")
        last = (ex, rows)
    if last is None:
        raise ExportError("no exporter could turn the model into an ONNX graph: " + "; ".join(errors), exit_code=1)
    return last


def int8_cases(int8: dict) -> list[P.Case]:
    """Parity rows for the int8 graph: the val NLL change over all languages, then per language the NLL change,
    the top-1 agreement with fp32 and the mean |Δ log p| of fp32's top token (thresholds: export.quantize)."""
    rows = [P.Case("onnx int8", "val NLL change, nats/token", int8["val_nll_delta"], TARGET,
                   bool(np.isfinite(int8["val_nll_delta"]) and int8["val_nll_delta"] <= TARGET),
                   f"{int8['tokens']:,} tokens")]
    for lang, v in int8["by_lang"].items():
        rows += [
            P.Case("onnx int8", f"{lang}: val NLL change, nats/token", v["delta"], TARGET,
                   bool(np.isfinite(v["delta"]) and v["delta"] <= TARGET), f"{v['tokens']:,} tokens"),
            P.Case("onnx int8", f"{lang}: top-1 agreement with fp32", v["top1_agreement"], TOP1_MIN,
                   v["top1_agreement"] >= TOP1_MIN, f"needs ≥ {TOP1_MIN:.0%}"),
            P.Case("onnx int8", f"{lang}: mean |Δ log p| of fp32's top token, nats", v["mean_abs_top_logprob_delta"],
                   LOGPROB_MAX, v["mean_abs_top_logprob_delta"] <= LOGPROB_MAX, f"needs ≤ {LOGPROB_MAX}"),
        ]
    return rows


def export_bundle(src: str | Path, out: str | Path | None = None, *, force: bool = False, dtype: str = "float32",
                  quantize: str | None = None, parity: bool = True, val_data: str | Path | None = None,
                  exporter: str = "auto", log: Callable[[str], None] = print) -> Path:
    """Export a checkpoint (or a run's latest) into a bundle folder and return the folder.

    ``out`` defaults to ``<run dir>/bundle``; ``dtype`` "float32" or "float16" (ONNX weights and KV cache; the
    safetensors stay float32; fp16 parity uses atol = rtol = 5e-2); ``quantize="int8"`` adds ``model.int8.onnx``
    and its validation NLL change (from the run's val shards or ``val_data``: a shard folder or text);
    ``parity=False`` skips the gate (the card says the bundle is unchecked); ``exporter`` "auto", "dynamo" or
    "torchscript". Raises ExportError (exit_code 2) for bad input and ParityError (exit_code 1) when the gate
    fails; nothing is left at ``out`` then.
    """
    t0 = time.time()
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if quantize not in (None, "none", "int8"):
        raise ExportError(f"--quantize {quantize!r}: expected int8")
    quantize = None if quantize == "none" else quantize
    if exporter not in ("auto", *EXPORTERS):
        raise ExportError(f"--exporter {exporter!r}: expected auto, {', '.join(EXPORTERS)}")
    source = load_source(src)
    out = Path(out) if out is not None else source.default_out()
    clean_stale(out.parent)  # a replaced bundle parked by a crashed swap is put back before it is judged
    if out.exists() and not force and _up_to_date(source, out, dtype, quantize, parity):
        log(f"export: {out} is already an up-to-date bundle of {source.ckpt} (step {source.step}); nothing to do "
            f"(use --force to rebuild it)")
        return out
    _check_out(source, out, force)
    log(f"export: {source.ckpt} (step {source.step}, {source.model.num_params():,} parameters) → {out}")
    val = _val_data(source, val_data, log) if quantize else None
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        manifest = _build(source, out, force, dtype, quantize, parity, val, exporter, log, t0)
    except OSError as e:
        raise write_error(out, e) from None
    files = sorted(manifest["files"].items(), key=lambda kv: -kv[1]["bytes"])
    sizes = f"{sum(v['bytes'] for _, v in files) / 1e6:.1f} MB (" + ", ".join(
        f"{k} {v['bytes'] / 1e6:.1f}" for k, v in files[:4]) + ")"
    log(f"export: {'parity ok' if parity else 'parity SKIPPED'}; {manifest['exporter']} exporter; "
        f"{time.time() - t0:.1f} s; {sizes}; wrote {out}")
    return out


def _build(source: Source, out: Path, force: bool, dtype: str, quantize: str | None, parity: bool, val,
           exporter: str, log: Callable[[str], None], t0: float) -> dict:
    """Write the bundle into a temporary folder and put it at ``out``; returns the manifest. Raises OSError for
    a failed write (the caller names it), ExportError / ParityError as :func:`export_bundle` documents."""
    with atomic_dir(out, overwrite=force) as tmp:
        B.write_hf_files(source, tmp)
        greedy_ref = P.greedy_reference(source.model, tmp / TOKENIZER, source.eot_id) if parity else None
        chosen, rows = _build_graph(source, tmp, dtype, exporter, greedy_ref, log)
        if parity:
            rows += P.safetensors_cases(tmp, source.ckpt, source.model)
            rows += P.transformers_cases(tmp, source.model, tmp / TOKENIZER)
            if P.rust_available():
                rows += P.rust_cases(tmp, source.model, greedy_ref)
            else:
                log("parity: rust_runtime is not importable here; the Rust runtime is not checked")
        int8 = None
        if quantize:
            t = time.time()
            fp32_graph = tmp / ONNX
            if dtype != "float32":  # quantize from float32 weights, not from the float16 graph
                fp32_graph = tmp / ".fp32" / ONNX
                fp32_graph.parent.mkdir()
                export_graph(source.model, fp32_graph, chosen, "float32")
            quantize_int8(fp32_graph, tmp / ONNX_INT8)
            shutil.rmtree(tmp / ".fp32", ignore_errors=True)
            int8 = int8_report(tmp, val)
            log(f"int8: quantized in {time.time() - t:.1f} s; val NLL change "
                f"{'not measured' if int8['val_nll_delta'] is None else format(int8['val_nll_delta'], '+.4f')}")
            if parity and int8["val_nll_delta"] is not None:
                rows += int8_cases(int8)
        table = P.format_table(rows)
        ok = P.all_ok(rows) if parity else None
        info = {
            "exporter": chosen, "opset": OPSET, "dtype": dtype,
            "parity": {"ok": ok, "tol": P.FP32_TOL if dtype == "float32" else P.FP16_TOL, "near_tie": P.NEAR_TIE,
                       "cases": [r.as_dict() for r in rows]} if parity else {"ok": None, "skipped": True, "cases": []},
            "int8": int8, "eval": eval_summary(source), "data": data_summary(source),
        }
        if parity:
            log(table)
            if not ok:
                bad = [r for r in rows if not r.ok]
                raise ParityError(f"parity gate failed on {len(bad)} of {len(rows)} cases (first: {bad[0].runtime}, "
                                  f"{bad[0].case}); no bundle was written", [r.as_dict() for r in rows], table)
        write_card(tmp / CARD, render_card(source, str(out), info))
        manifest = B.write_manifest(tmp, source, exporter=chosen, opset=OPSET, dtype=dtype, parity=info["parity"],
                                    int8=int8, eval_=info["eval"], data=info["data"],
                                    export_seconds=time.time() - t0)
        B.make_readable(tmp)
    return manifest
