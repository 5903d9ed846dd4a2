"""The quality gate of every quantized form: the same validation windows through the bundle's float32
``model.onnx`` (the reference) and through each form, compared position by position, per language.

Figures per language and over all: the NLL change (nats/token, the form minus float32), the top-1 agreement
(share of positions where the form's argmax equals float32's) and the mean |Δ log p| of float32's top token
(nats). An NLL average can hide a quantization that changes which token wins; the two per-position figures
cannot. A form passes when every language (and all) is within its bit width's thresholds
(:data:`contract.quant.GATE`); a form that fails is not written (the export refuses: exit 1, nothing left).

A form is anything that maps a window of ids to float32 logits ``[len(ids), vocab]``: onnxruntime's q8_0 and
q4_0 graphs (:mod:`export.quantize`), ``rust_runtime`` quantizing at load, llama.cpp reading a GGUF. The
reference runs once per window, however many forms are measured. Its result, ``manifest.json``'s
``quantization`` entry (:func:`gate_entry`): ``{data, tokens, reference, forms: {FORM: {scheme, bits, block,
keep_8bit, summary, runtime, file, thresholds, all: {…}, by_lang: {LANG: {nll_f32, nll, delta, top1_agreement,
mean_abs_top_logprob_delta, tokens, ok}}, continuations, ok}}}``, FORM = "<runtime> <scheme>" (e.g. "onnx q4_0",
"rust q8_0", "llama.cpp q4_k_m"). The pass rule, the figures' labels and their printing are
:mod:`serve.verdict`'s, which the loaders read the verdicts with.

What a user sees is measured too, not gated: ``continuations`` = ``{prompt_tokens, new_tokens, by_lang: {LANG:
{identical, prompts}}}``, how many greedy continuations of :data:`CONTINUATION_TOKENS` tokens are identical to
float32's, from :data:`PROMPTS_PER_LANG` prompts of :data:`PROMPT_TOKENS` tokens per language cut evenly from
the same validation text (a form whose runtime has a KV cache: ``Form.new_sequence``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from contract.bundle import ONNX
from contract.quant import Scheme
from export import parity as P
from export.errors import QualityGateError
from export.valdata import ValData
from serve.verdict import FIGURES, fmt_figure, fmt_limit
from serve.verdict import passes as figures_pass

ROWS = 256            # positions per block when comparing logits (bounds the float64 copies)
PROMPTS_PER_LANG = 10     # continuation agreement: prompts per language,
PROMPT_TOKENS = 32        # of this many validation tokens each,
CONTINUATION_TOKENS = 64  # continued greedily this far (fewer when the windows are shorter)
REFERENCE = f"onnx float32 ({ONNX})"
MANIFEST_KEY = "quantization"

Logits = Callable[[list[int]], np.ndarray]
NewSequence = Callable[[], Any]  # a serve.backends.base.Sequence factory (prefill / decode on a KV cache)


@dataclass(frozen=True)
class Form:
    """One quantized form: its ``runtime`` ("onnx", "rust", "llama.cpp"), its :class:`Scheme` (None: the runtime's
    float32, a benchmark's control row that :func:`judge` does not take), ``logits`` (ids → float32
    ``[len(ids), V]`` from position 0), the ``file`` it lives in (None: quantized at load) and ``new_sequence``
    (a KV cache of it, for the continuations; None: not measured)."""

    runtime: str
    scheme: Scheme | None
    logits: Logits
    file: str | None = None
    new_sequence: NewSequence | None = None

    @property
    def name(self) -> str:
        return f"{self.runtime} {self.scheme.name if self.scheme else 'f32'}"


def _log_softmax(blk: np.ndarray) -> np.ndarray:
    blk = np.asarray(blk, dtype=np.float64)
    m = blk.max(-1, keepdims=True)
    return blk - m - np.log(np.exp(blk - m).sum(-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Sums over positions of ``ref`` (float32) vs ``got`` (quantized) logits ``[..., V]`` with int ``targets``
    ``[...]``: ``{positions, nll_ref, nll_got, top1_agree, top_logprob_absdiff}`` — NLL sums in nats, the count of
    positions whose argmax agree, and the sum of |log p_got(t) - log p_ref(t)| for t = ref's argmax."""
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


def figures(sums: dict[str, float]) -> dict[str, float]:
    """Per-token figures from :func:`compare_logits` sums: ``{nll_f32, nll, delta, top1_agreement,
    mean_abs_top_logprob_delta, tokens}``."""
    n = sums["positions"]
    return {"nll_f32": sums["nll_ref"] / n, "nll": sums["nll_got"] / n, "delta": (sums["nll_got"] - sums["nll_ref"]) / n,
            "top1_agreement": sums["top1_agree"] / n, "mean_abs_top_logprob_delta": sums["top_logprob_absdiff"] / n,
            "tokens": n}


def passes(v: dict, s: Scheme) -> bool:
    """One language's (or all's) :func:`figures` within scheme ``s``'s thresholds (:func:`serve.verdict.passes`)."""
    return figures_pass(v, s.thresholds.as_dict())


def measure(reference: Logits, forms: Iterable[Form], val: ValData, desc: str = "quality gate") -> dict[str, dict]:
    """``{form name: {"all": figures, "by_lang": {lang: figures}}}`` over every window of ``val``: the reference
    once per window, then each form (progress on stderr, tokens/s and ETA, when it is a terminal)."""
    forms = list(forms)
    sums: dict[str, dict[str, dict]] = {f.name: {} for f in forms}
    if len(sums) < len(forms):
        raise ValueError(f"two forms share a name: {sorted(f.name for f in forms)}")
    with tqdm(total=val.tokens * (1 + len(forms)), unit="tok", desc=desc, disable=None, leave=False) as bar:
        for lang, windows in val.windows.items():
            for w in windows:
                x, y = w[:-1].tolist(), w[1:]
                ref = reference(x)
                bar.update(len(x))
                for f in forms:
                    c = compare_logits(ref, f.logits(x), y)
                    for key in (lang, "all"):
                        acc = sums[f.name].setdefault(key, dict.fromkeys(c, 0))
                        for k, v in c.items():
                            acc[k] += v
                    bar.update(len(x))
    out = {}
    for name, by in sums.items():
        all_ = figures(by.pop("all"))
        out[name] = {"all": all_, "by_lang": {lang: figures(c) for lang, c in by.items()}}
    return out


def judge(form: Form, stats: dict) -> dict:
    """The manifest entry of one measured form: what it is (scheme, bits, block, keep_8bit, summary, runtime, file,
    thresholds), the figures with ``ok`` per language and over all, and ``ok`` (every language and all pass)."""
    s = form.scheme
    by_lang = {lang: {**v, "ok": passes(v, s)} for lang, v in stats["by_lang"].items()}
    all_ = {**stats["all"], "ok": passes(stats["all"], s)}
    return {**_described(form), "all": all_, "by_lang": by_lang,
            "ok": bool(all_["ok"] and all(v["ok"] for v in by_lang.values()))}


def _described(form: Form) -> dict:
    """What a form is, as the manifest records it: scheme, bits, block, the roles kept at 8 bits, runtime, file,
    the scheme's one-line summary and its thresholds."""
    s = form.scheme
    return {"scheme": s.name, "bits": s.bits, "block": s.block, "keep_8bit": sorted(s.keep_8bit),
            "summary": s.summary, "runtime": form.runtime, "file": form.file, "thresholds": s.thresholds.as_dict()}


def unmeasured(form: Form, why: str) -> dict:
    """The manifest entry of a form that could not be measured (no validation data, say): ``ok`` None and why."""
    return {**_described(form), "ok": None, "note": why}


def prompts(val: ValData, n: int = PROMPTS_PER_LANG, length: int = PROMPT_TOKENS) -> dict[str, list[list[int]]]:
    """``n`` prompts of ``length`` ids per language, cut at evenly spaced offsets of its validation windows (fewer
    when the language has fewer ids; the length is capped at a quarter of the longest window)."""
    out = {}
    for lang, windows in val.windows.items():
        ids = np.concatenate(windows) if windows else np.zeros(0, np.int64)
        k = min(length, max(len(w) for w in windows) // 4) if windows else 0
        if k < 1 or len(ids) < k:
            continue
        starts = sorted({int(x) for x in np.linspace(0, len(ids) - k, n)})
        out[lang] = [ids[s:s + k].tolist() for s in starts]
    return out


def greedy(new_sequence: NewSequence, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` (argmax, ties to the lower id) through a KV cache."""
    seq = new_sequence()
    logits = np.asarray(seq.prefill(prompt))
    out: list[int] = []
    while len(out) < steps:
        out.append(int(np.argmax(logits)))
        if len(out) < steps:
            logits = np.asarray(seq.decode(out[-1]))
    return out


def continuations(reference: NewSequence, forms: Iterable[Form], val: ValData) -> dict[str, dict]:
    """``{form name: {prompt_tokens, new_tokens, by_lang: {lang: {identical, prompts}}}}`` for every form with a
    ``new_sequence``: how many greedy continuations equal float32's (module doc)."""
    forms = [f for f in forms if f.new_sequence is not None]
    ps = prompts(val)
    if not forms or not ps:
        return {}
    k = len(next(iter(ps.values()))[0])
    steps = max(1, min(CONTINUATION_TOKENS, min(len(w) for ws in val.windows.values() for w in ws) - 1 - k))
    out = {f.name: {"prompt_tokens": k, "new_tokens": steps, "by_lang": {}} for f in forms}
    for lang, prompts_ in ps.items():
        want = [greedy(reference, p, steps) for p in prompts_]
        for f in forms:
            same = sum(greedy(f.new_sequence, p, steps) == w for p, w in zip(prompts_, want))
            out[f.name]["by_lang"][lang] = {"identical": same, "prompts": len(prompts_)}
    return out


def gate_entry(reference: Logits, forms: list[Form], val: ValData | None, no_data: str = "",
               reference_sequence: NewSequence | None = None) -> dict:
    """``manifest.json``'s ``quantization`` entry for ``forms`` (module doc); with ``val`` None every form is
    recorded unmeasured with ``no_data`` as the reason. ``reference_sequence``: float32's KV cache, for the
    continuations of the forms that have one (None: not measured)."""
    if val is None:
        return {"data": None, "tokens": 0, "reference": REFERENCE,
                "forms": {f.name: unmeasured(f, no_data) for f in forms}}
    stats = measure(reference, forms, val)
    conts = continuations(reference_sequence, forms, val) if reference_sequence is not None else {}
    return {"data": val.origin, "tokens": val.tokens, "reference": REFERENCE,
            "forms": {f.name: {**judge(f, stats[f.name]), **({"continuations": conts[f.name]} if f.name in conts
                                                              else {})} for f in forms}}


def merge(old: dict | None, new: dict) -> dict:
    """``new``'s forms added to (or replacing those of) an existing ``quantization`` entry ``old``."""
    if not old:
        return new
    return {**old, **{k: v for k, v in new.items() if k != "forms" and v is not None},
            "forms": {**old.get("forms", {}), **new["forms"]}}


def cases(entry: dict) -> list[P.Case]:
    """Parity-table rows for every measured form of a ``quantization`` entry: per language and over all, each
    figure of :data:`serve.verdict.FIGURES` beside its threshold and rule (printed at the rule's precision)."""
    rows: list[P.Case] = []
    for name, r in entry.get("forms", {}).items():
        if r.get("ok") is None:
            continue
        th = r["thresholds"]
        for lang, v in [*r["by_lang"].items(), ("all", r["all"])]:
            for f in FIGURES:
                value, limit = float(v[f.key]), float(th[f.limit])
                rows.append(P.Case(name, f"{lang}: {f.label}{',' if f.unit else ''}{f.unit}", value, limit,
                                   f.ok(value, limit), f"{v['tokens']:,} tokens", rule=f.rule))
    return rows


def failures(entry: dict, only: Iterable[str] | None = None) -> list[str]:
    """Names of the measured forms of ``entry`` that fail their thresholds (of ``only`` when given)."""
    keep = None if only is None else set(only)
    return [n for n, r in entry.get("forms", {}).items() if r.get("ok") is False and (keep is None or n in keep)]


def enforce(entry: dict, nothing_written: str, log: Callable[[str], None] = print,
            required: Iterable[str] | None = None) -> None:
    """Raise QualityGateError (exit code 1) when a measured form of ``entry`` (of ``required`` when given: the
    forms asked for) fails, after logging its rows of the gate's table; ``nothing_written`` ends the message
    (e.g. "no bundle was written")."""
    bad = failures(entry, required)
    if not bad:
        return
    rows = [r for r in cases(entry) if r.runtime in bad]
    table = P.format_table(rows)
    log(table)
    first = next(r for r in rows if not r.ok)
    raise QualityGateError(f"the quality gate failed for {', '.join(bad)} (first: {first.runtime}, {first.case} = "
                           f"{fmt_figure(first.value, first.tol)}, limit {'≤' if first.rule == '<=' else '≥'} "
                           f"{fmt_limit(first.tol)}); {nothing_written}{no_4bit_note(entry)}",
                           [r.as_dict() for r in rows], table)


def no_4bit_note(entry: dict) -> str:
    """A sentence (starting with "; ") when 4-bit forms were measured and none passed, else ""."""
    four = {n: r for n, r in entry.get("forms", {}).items() if r.get("bits") == 4 and r.get("ok") is not None}
    if not four or any(r["ok"] for r in four.values()):
        return ""
    return ("; no 4-bit form passes the gate on this model (" + ", ".join(four) + "): a model this small loses "
            "too much at 4 bits; serve it at q8_0 or float32")


def reference_logits(bundle: Path, threads: int | None = None) -> Logits:
    """The gate's reference: ``bundle``'s float32 ``model.onnx`` through serve's OnnxBackend."""
    return reference_backend(bundle, threads).logits


def reference_backend(bundle: Path, threads: int | None = None):
    """``bundle``'s float32 ``model.onnx`` as serve's OnnxBackend (``logits`` and ``new_sequence``)."""
    from serve.backends.onnx import OnnxBackend

    return OnnxBackend(bundle, threads=threads)
