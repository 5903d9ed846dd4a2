"""The bundle pipeline behind ``python -m export.onnx`` (:mod:`export.onnx` is its command line).

Turns a checkpoint (a step folder, a ``checkpoints/`` folder or a run folder, meaning its latest checkpoint) into
the bundle of docs/design.md — ``model.safetensors``, ``config.json``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``model.onnx`` + ``model.onnx.data`` (+ the quantized graphs of
``--quantize``: ``model.q8_0.onnx``, ``model.q4_0.onnx``, ``model.q4_mix.onnx``), ``README.md`` (model card) and ``manifest.json`` — and
refuses to finish unless the bundle computes what the checkpoint computes (the parity gate, :mod:`export.parity`)
and every quantized form passes its quality gate (:mod:`export.gate`).

The bundle is built in a temporary folder beside the output and put in place at the end
(``contract.atomic.atomic_dir``, one atomic exchange when replacing): a failure, a failed gate or Ctrl-C leaves no
partial bundle, and ``--force`` replaces an existing bundle (never another folder, :mod:`export.target`) only once
the new one is complete. Exporter: dynamo (``torch.export``) first; if it raises or its graph fails the ONNX
parity cases, TorchScript; the manifest records which.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from contract.atomic import atomic_dir, clean_stale, sha256_file
from contract.bundle import (
    CARD,
    CONFIG,
    ONNX,
    ONNX_GRAPHS,
    TOKENIZER,
    WEIGHTS,
    BundleError,
    has_chat_template,
    read_manifest,
)
from contract.quant import SCHEMES, Scheme, scheme
from export import bundle as B
from export import gate as G
from export import parity as P
from export.card import render_card, write_card
from export.errors import ExportError, ParityError
from export.graph import EXPORTERS, OPSET, export_graph
from export.quantize import write_onnx_form
from export.runinfo import data_summary, eval_summary
from export.source import Source, load_source
from export.target import check_target, os_error_in, write_error
from export.valdata import find_run_shards, from_shards, load_val_data, run_seq_len
from serve.verdict import fmt_figure
from train.components.checkpoint import step_name
from train.hf_files import turn_end_ids_of_checkpoint

__all__ = ["DTYPES", "ExportError", "ParityError", "export_bundle"]

DTYPES = ("float32", "float16")
UNTRAINED = ("step 0 (random init): the quality gate is not measured on an untrained model (its near-tied "
             "logits say nothing about a quantization); the forms are written for speed and memory figures")



def _stale(src: Source, out: Path, dtype: str, schemes: tuple[Scheme, ...], parity: bool) -> str | None:
    """Why ``out`` is not an up-to-date bundle of ``src``, or None when it is: a complete bundle of this very
    checkpoint with the same dtype, the quantized graphs asked for (extra ones do no harm), a passed gate, and a
    chat template exactly when the checkpoint is a chat model (an export from before base models lost theirs keeps
    one, and every runtime would chat with it) — re-running the README's main job then skips the export instead
    of failing."""
    try:
        m = read_manifest(out)
    except BundleError:
        return "no readable manifest"
    files = m.get("files") or {}
    if m.get("source", {}).get("sha256") != src.sha256:
        return "exported from another checkpoint"
    if m.get("dtype", "float32") != dtype:
        return f"dtype {m.get('dtype', 'float32')}, not {dtype}"
    missing = [ONNX_GRAPHS[s.name] for s in schemes if s.onnx and ONNX_GRAPHS[s.name] not in files]
    if missing:
        return f"no {', '.join(missing)}"
    if parity and not m.get("parity", {}).get("ok"):
        return "its parity gate did not pass"
    chat = bool(turn_end_ids_of_checkpoint(src.ckpt))
    if has_chat_template(out) != chat:
        return ("a chat template, but the checkpoint is a base model" if not chat
                else "no chat template, but the checkpoint was fine-tuned on conversations")
    return None


def _older_own(src: Source, out: Path) -> int | None:
    """The step of the bundle at ``out`` when it is the run's own default bundle (``<run dir>/bundle``) exported from
    an older checkpoint of the run (its manifest's source ``<run name>/checkpoints/step-N``, N below ``src``'s step):
    after a ``--resume`` the README's line replaces it without ``--force``. None otherwise (another folder, another
    run's bundle, a newer or unrecorded step)."""
    if src.run_dir is None or out.resolve() != (src.run_dir / "bundle").resolve():
        return None
    try:
        s = read_manifest(out).get("source") or {}
    except BundleError:
        return None
    step, ckpt = s.get("step"), Path(str(s.get("checkpoint", "")))
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step < src.step):
        return None
    own = ckpt.name == step_name(step) and ckpt.parent.name == "checkpoints" and ckpt.parent.parent.name == src.run_dir.name
    return step if own else None


def parse_schemes(quantize: str | Sequence[str] | None) -> tuple[Scheme, ...]:
    """``--quantize`` names (one string or several; ``none`` ignored) → their schemes, in :data:`contract.quant.NAMES`
    order without repeats. Raises ExportError naming an unknown name, or a scheme this export cannot produce
    (no ONNX form and not offered by rust_runtime)."""
    names = [quantize] if isinstance(quantize, str) else list(quantize or [])
    out: dict[str, Scheme] = {}
    for q in names:
        if isinstance(q, str) and q.strip().lower() == "none":
            continue
        try:
            s = scheme(q, "--quantize")
        except ValueError as e:
            raise ExportError(str(e)) from None
        if not s.onnx and not s.rust:
            raise ExportError(f"--quantize {s.name}: no form of it lives in a bundle (onnxruntime has no such kernel "
                              f"and rust_runtime does not offer it yet); for llama.cpp write it with "
                              f"python -m export.gguf BUNDLE --type {s.gguf}")
        out[s.name] = s
    return tuple(SCHEMES[n] for n in SCHEMES if n in out)


def _check_out(src: Source, out: Path, force: bool, stale: str | None = None) -> None:
    """Refuse an output that may not be replaced (:func:`export.target.check_target`) or that would replace or
    lie inside the checkpoint itself; ``stale`` says why an existing ``out`` is not up to date (:func:`_stale`)."""
    if out.exists() and not force:
        why = f": {stale}" if stale else ""
        raise ExportError(f"{out} already exists and is not an up-to-date bundle of {src.ckpt}{why} "
                          f"(use --force to replace it)")
    o, c = out.resolve(), src.ckpt.resolve()
    if o == c or o in c.parents:
        raise ExportError(f"--out {out} would replace the checkpoint {src.ckpt} it is exported from")
    if c in o.parents:
        raise ExportError(f"--out {out} lies inside the checkpoint folder {src.ckpt} (its SHA256SUMS would no longer "
                          "describe it); choose another folder")
    check_target(out, force)


def _val_data(src: Source, val_data: str | Path | None, log: Callable[[str], None]):
    """Validation windows for the quality gate (ExportError for a bad --val-data; None when none found)."""
    tok = src.ckpt / TOKENIZER
    seq = run_seq_len(src.run_dir, src.cfg.max_position_embeddings)
    if val_data is not None:
        return load_val_data(Path(val_data), src.cfg.vocab_size, tok, src.eot_id, seq)
    shards = find_run_shards(src.run_dir, tok)
    if shards is None:
        log("quantize: no validation shards found through the run's config.toml (pass --val-data PATH); "
            "the quality gate will not be measured")
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


def export_bundle(src: str | Path, out: str | Path | None = None, *, force: bool = False, dtype: str = "float32",
                  quantize: str | Sequence[str] | None = None, parity: bool = True,
                  val_data: str | Path | None = None, exporter: str = "auto",
                  log: Callable[[str], None] = print) -> Path:
    """Export a checkpoint (or a run's latest) into a bundle folder and return the folder.

    ``out`` defaults to ``<run dir>/bundle``; ``dtype`` "float32" or "float16" (ONNX weights and KV cache; the
    safetensors stay float32; fp16 parity uses atol = rtol = 5e-2); ``quantize``: scheme names of
    :data:`contract.quant.NAMES` (one or several: ``"q8_0"``, ``["q8_0", "q4_0"]``) — each adds its ONNX graph
    (``model.q8_0.onnx``, ``model.q4_0.onnx``, ``model.q4_mix.onnx``) and, where rust_runtime offers the scheme, its Rust form to the
    quality gate (:mod:`export.gate`; on the run's val shards or ``val_data``: a shard folder or text);
    ``parity=False`` skips the parity gate (the card says the bundle is unchecked; the quantized forms' quality
    gate still holds);
    ``exporter`` "auto", "dynamo" or "torchscript". Raises ExportError (exit_code 2) for bad input (an unknown
    quantization name among them), ParityError (exit_code 1) when the parity gate fails and QualityGateError
    (a ParityError) when a quantized form fails its quality gate; nothing is left at ``out`` then.
    """
    t0 = time.time()
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    schemes = parse_schemes(quantize)
    if exporter not in ("auto", *EXPORTERS):
        raise ExportError(f"--exporter {exporter!r}: expected auto, {', '.join(EXPORTERS)}")
    source = load_source(src)
    out = Path(out) if out is not None else source.default_out()
    clean_stale(out.parent)  # a replaced bundle parked by a crashed swap is put back before it is judged
    stale = _stale(source, out, dtype, schemes, parity) if out.exists() and not force else None
    if out.exists() and not force and stale is None:
        log(f"export: {out} is already an up-to-date bundle of {source.ckpt} (step {source.step}); nothing to do "
            f"(use --force to rebuild it)")
        return out
    if stale is not None and (older := _older_own(source, out)) is not None:
        log(f"export: {out} is this run's bundle of step {older}; replacing it with step {source.step}")
        force = True
    _check_out(source, out, force, stale)
    log(f"export: {source.ckpt} (step {source.step}, {source.model.num_params():,} parameters) → {out}")
    untrained = source.step == 0   # a random-init model's near-flat logits say nothing about a quantization
    gated = _gated(schemes)
    if gated and untrained:
        log(f"quantize: {UNTRAINED}")
    val = _val_data(source, val_data, log) if gated and not untrained else None
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        manifest = _build(source, out, force, dtype, schemes, parity, val, exporter, log, t0)
    except OSError as e:
        raise write_error(out, e) from None
    files = sorted(manifest["files"].items(), key=lambda kv: -kv[1]["bytes"])
    sizes = f"{sum(v['bytes'] for _, v in files) / 1e6:.1f} MB (" + ", ".join(
        f"{k} {v['bytes'] / 1e6:.1f}" for k, v in files[:4]) + ")"
    log(f"export: {'parity ok' if parity else 'parity SKIPPED'}; {manifest['exporter']} exporter; "
        f"{time.time() - t0:.1f} s; {sizes}; wrote {out}")
    return out


def _gated(schemes: tuple[Scheme, ...]) -> tuple[Scheme, ...]:
    """The schemes whose forms the gate measures: those asked for, and every scheme rust_runtime quantizes to at
    load (when it is importable), since a loader may make any of them from the bundle's weights and serves only
    a form whose verdict is in the manifest (serve.verdict)."""
    rust = tuple(s for s in SCHEMES.values() if s.rust) if P.rust_available() else ()
    return tuple(s for n, s in SCHEMES.items() if s in schemes or s in rust)


class _Lazy:
    """A form's model, loaded on first use (an unmeasured form is never loaded)."""

    def __init__(self, load: Callable[[], object]):
        self._load, self._model = load, None

    @property
    def model(self):
        if self._model is None:
            self._model = self._load()
        return self._model

    def logits(self, ids):
        return self.model.logits(ids)

    def new_sequence(self):
        return self.model.new_sequence()


def _quantized_forms(tmp: Path, fp32_graph: Path, schemes: tuple[Scheme, ...],
                     log: Callable[[str], None]) -> list[G.Form]:
    """Write each asked-for scheme's ONNX graph into the bundle folder ``tmp`` from ``fp32_graph`` and return every
    form the gate measures: those graphs through onnxruntime, and every scheme rust_runtime offers through it (when
    it is importable: :func:`_gated`)."""
    from serve.backends.onnx import OnnxBackend

    forms: list[G.Form] = []
    for s in schemes:
        if s.onnx:
            t, graph = time.time(), ONNX_GRAPHS[s.name]
            write_onnx_form(s, fp32_graph, tmp / graph, tmp / WEIGHTS)
            log(f"quantize: {graph} ({s.name}) in {time.time() - t:.1f} s")
            m = _Lazy(lambda s=s: OnnxBackend(tmp, quantize=s))
            forms.append(G.Form("onnx", s, m.logits, graph, m.new_sequence))
    rust = [s for s in _gated(schemes) if s.rust]
    if rust:
        import rust_runtime  # deferred: optional (rust_available() said it is there)

        def load(s: Scheme):
            """The form to measure: no verdict exists yet (measuring is what the gate is for), so the override is
            needed and its warning is not."""
            quiet = logging.getLogger("rust_runtime")
            was, quiet.disabled = quiet.disabled, True
            try:
                return rust_runtime.Model.load(str(tmp), quantize=s.name, verify=False, allow_ungated=True)
            finally:
                quiet.disabled = was

        for s in rust:
            m = _Lazy(lambda s=s: load(s))
            forms.append(G.Form("rust", s, m.logits, None, m.new_sequence))
    elif any(s.rust for s in schemes):
        log("quantize: rust_runtime is not importable here; its forms of "
            f"{', '.join(s.name for s in schemes if s.rust)} are not gated")
    return forms


def _quality_gate(source: Source, tmp: Path, dtype: str, exporter: str, schemes: tuple[Scheme, ...], val,
                  log: Callable[[str], None]) -> dict:
    """Write the quantized graphs and measure every form against float32 (:mod:`export.gate`); returns the
    manifest's ``quantization`` entry. A float16 bundle is quantized from, and compared with, a float32 graph
    exported into a scratch folder that is removed."""
    ref_dir = tmp
    if dtype != "float32":
        ref_dir = tmp / ".fp32"
        ref_dir.mkdir()
        for name in (CONFIG, TOKENIZER):
            shutil.copyfile(tmp / name, ref_dir / name)
        export_graph(source.model, ref_dir / ONNX, exporter, "float32")
    try:
        forms = _quantized_forms(tmp, ref_dir / ONNX, schemes, log)
        t = time.time()
        ref = G.reference_backend(ref_dir) if val is not None else None
        quant = G.gate_entry(ref.logits if ref else None, forms, val,
                             UNTRAINED if source.step == 0 else
                             "no validation data found (pass --val-data PATH); the quality gate was not measured",
                             reference_sequence=ref.new_sequence if ref else None)
    finally:
        shutil.rmtree(tmp / ".fp32", ignore_errors=True)
    log("quantize: quality gate " + ("not measured" if val is None else f"measured in {time.time() - t:.1f} s: " + "; ".join(
        _gate_line(n, r) for n, r in quant["forms"].items())))
    return quant


def _gate_line(name: str, r: dict) -> str:
    """One form's verdict for the export's log: pass or FAIL, the figures over all, continuation agreement."""
    line = (f"{name} {'pass' if r['ok'] else 'FAIL'} (ΔNLL {fmt_figure(r['all']['delta'], signed=True)}, "
            f"top-1 {fmt_figure(r['all']['top1_agreement'])}")
    cont = r.get("continuations")
    if cont:
        line += f", identical {cont['new_tokens']}-token greedy continuations " + ", ".join(
            f"{lang} {v['identical']}/{v['prompts']}" for lang, v in cont["by_lang"].items())
    return line + ")"


def _build(source: Source, out: Path, force: bool, dtype: str, schemes: tuple[Scheme, ...], parity: bool, val,
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
        gated = _gated(schemes)
        quant = _quality_gate(source, tmp, dtype, chosen, schemes, val, log) if gated else None
        if quant:
            asked = {f"{rt} {s.name}" for s in schemes for rt in ("onnx", "rust")}
            # also under --no-parity: a failing form asked for is never written
            G.enforce(quant, "no bundle was written", log, required=asked)
            if other := G.failures(quant):
                log(f"quantize: {', '.join(other)} failed the gate (not asked for: recorded in the manifest and "
                    f"the card, and serve.load refuses them without allow_ungated){G.no_4bit_note(quant)}")
            if parity:  # a form not asked for that fails is not a failure of this bundle
                rows += [r for r in G.cases(quant) if r.runtime not in other]
        table = P.format_table(rows)
        ok = P.all_ok(rows) if parity else None
        info = {
            "exporter": chosen, "opset": OPSET, "dtype": dtype,
            "parity": {"ok": ok, "tol": P.FP32_TOL if dtype == "float32" else P.FP16_TOL, "near_tie": P.NEAR_TIE,
                       "cases": [r.as_dict() for r in rows]} if parity else {"ok": None, "skipped": True, "cases": []},
            G.MANIFEST_KEY: quant, "eval": eval_summary(source), "data": data_summary(source),
        }
        if parity:
            log(table)
            if not ok:
                bad = [r for r in rows if not r.ok]
                raise ParityError(f"parity gate failed on {len(bad)} of {len(rows)} cases (first: {bad[0].runtime}, "
                                  f"{bad[0].case}); no bundle was written", [r.as_dict() for r in rows], table)
        write_card(tmp / CARD, render_card(source, str(out), info))
        manifest = B.write_manifest(tmp, source, exporter=chosen, opset=OPSET, dtype=dtype, parity=info["parity"],
                                    quantization=quant, eval_=info["eval"], data=info["data"],
                                    export_seconds=time.time() - t0)
        B.make_readable(tmp)
    return manifest
