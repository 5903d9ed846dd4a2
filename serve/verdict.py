"""The quality gate's verdicts at load: which quantized forms of a bundle passed the export's gate, and the rule
every loader follows (docs/design.md "Serving"; ``rust_runtime/src/integrity.rs`` is the same rule in Rust).

The export (:mod:`export.gate`) records a verdict per form in ``manifest.json``'s ``quantization.forms``, keyed
``"<runtime> <scheme>"`` (``"onnx q4_0"``, ``"rust q4_mix"``): ``ok`` true (passed), false (failed: the figures
and thresholds are beside it) or null (not measured, with a ``note``). A quantized form is served only when its
verdict is ``ok: true``. A failed form is refused with a message naming the form, the figure and the threshold;
a form without a verdict (no manifest, no ``quantization`` entry, not measured) is refused with a message saying
how to get one. ``allow_ungated=True`` (``SHALIK_ALLOW_UNGATED=1``) loads it anyway and logs what it overrides.

Verdicts are not measured at load: a bundle carries no validation text (the gate reads the run's validation
shards), and measuring needs the float32 model beside the quantized one at every start; the export measures every
form a loader can make instead (each ONNX graph it writes, and every scheme ``rust_runtime`` quantizes to at load).

The figures are printed at the precision of the rule: thresholds as the rule states them (two decimals), figures
with three (more where three would read as the threshold itself). Torch- and numpy-free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.bundle import BundleError
from contract.quant import GATE

__all__ = ["FIGURES", "Figure", "UngatedError", "Verdict", "check_form", "fmt_figure", "fmt_limit", "form_name",
           "forms_summary", "misses", "passes", "verdict"]

log = logging.getLogger("shalik.serve")

RULE_DECIMALS = 2   # the thresholds of contract.quant.GATE are stated with two decimals (0.05, 0.10, 0.85, 0.25)
OVERRIDE = "allow_ungated=True (--allow-ungated, SHALIK_ALLOW_UNGATED=1)"  # Python, the CLIs, the HTTP server


class UngatedError(BundleError):
    """A quantized form that failed the export's quality gate, or has no verdict, asked for without
    ``allow_ungated``."""


@dataclass(frozen=True)
class Figure:
    """One figure of the gate: its key in a form's per-language figures, its label, the comparison that passes
    (``"<="`` or ``">="``), the key of its limit in :class:`contract.quant.Thresholds` and its unit."""

    key: str
    label: str
    rule: str
    limit: str
    unit: str = ""
    signed: bool = False

    def ok(self, value: float, limit: float) -> bool:
        """Whether ``value`` is within ``limit`` (a NaN never is)."""
        if not math.isfinite(value):
            return False
        return value <= limit if self.rule == "<=" else value >= limit


FIGURES = (
    Figure("delta", "val NLL change", "<=", "val_nll_delta_max", " nats/token", signed=True),
    Figure("top1_agreement", "top-1 agreement with fp32", ">=", "top1_agreement_min"),
    Figure("mean_abs_top_logprob_delta", "mean |Δ log p| of fp32's top token", "<=", "mean_abs_top_logprob_delta_max",
           " nats"),
)


def fmt_limit(limit: float) -> str:
    """A threshold as the rule states it: ``0.85``, ``0.10``, ``0.25``."""
    return f"{limit:.{RULE_DECIMALS}f}"


def fmt_figure(value: float, limit: float | None = None, signed: bool = False) -> str:
    """A figure with three decimals (``0.853``, ``+0.112``), more when three would print the threshold itself for a
    value that differs from it (0.8496 against 0.85 prints ``0.8496``, not ``0.850``)."""
    sign = "+" if signed else ""
    if not math.isfinite(value):
        return str(value)
    for d in range(3, 8):
        s = f"{value:{sign}.{d}f}"
        if limit is None or value == limit or float(s) != round(limit, d):
            return s
    return s


def passes(figures: dict, thresholds: dict) -> bool:
    """One language's (or all's) figures within ``thresholds`` (:meth:`contract.quant.Thresholds.as_dict`)."""
    return all(f.ok(float(figures[f.key]), float(thresholds[f.limit])) for f in FIGURES)


def misses(entry: dict) -> list[str]:
    """The figures of one form's gate entry that miss their threshold, each as ``"bn: val NLL change +0.112
    nats/token > 0.10"`` (per language in name order, then over all: Rust's order too)."""
    th = entry.get("thresholds") or GATE[int(entry.get("bits", 8))].as_dict()
    out = []
    for where, figs in [*sorted((entry.get("by_lang") or {}).items()), ("all", entry.get("all") or {})]:
        for f in FIGURES:
            if f.key not in figs:
                continue
            value, limit = float(figs[f.key]), float(th[f.limit])
            if not f.ok(value, limit):
                broken = ">" if f.rule == "<=" else "<"
                out.append(f"{where}: {f.label} {fmt_figure(value, limit, f.signed)}{f.unit} {broken} "
                           f"{fmt_limit(limit)}")
    return out


def form_name(runtime: str, quantize: str) -> str:
    """The manifest's key of a form: ``"rust q4_0"``."""
    return f"{runtime} {quantize}"


@dataclass(frozen=True)
class Verdict:
    """The gate's verdict on one form of a bundle: ``ok`` True (passed), False (failed) or None (no verdict);
    ``detail``: the figures that missed (failed), or why there is no verdict."""

    form: str
    ok: bool | None
    detail: str


def verdict(manifest: dict | None, runtime: str, quantize: str) -> Verdict:
    """The verdict on form ``runtime quantize`` in ``manifest`` (None: the bundle has no manifest)."""
    form = form_name(runtime, quantize)
    if manifest is None:
        return Verdict(form, None, "the bundle has no manifest.json")
    entry = ((manifest.get("quantization") or {}).get("forms") or {}).get(form)
    if entry is None:
        return Verdict(form, None, "manifest.json records no quality-gate verdict for it")
    if entry.get("ok") is True:
        return Verdict(form, True, "passed")
    if entry.get("ok") is False:
        return Verdict(form, False, "; ".join(misses(entry)) or "failed")
    return Verdict(form, None, f"not measured: {entry.get('note') or 'no reason recorded'}")


def forms_summary(manifest: dict | None) -> dict[str, bool | None]:
    """``{form: ok}`` for every form the bundle's gate recorded (True passed, False failed, None not measured)."""
    forms = ((manifest or {}).get("quantization") or {}).get("forms") or {}
    return {name: r.get("ok") for name, r in forms.items()}


def check_form(manifest: dict | None, where: str, runtime: str, quantize: str | None, allow_ungated: bool = False,
               warn: Callable[[str], Any] | None = None) -> Verdict | None:
    """Refuse to serve a quantized form that did not pass the gate (module doc). ``where``: the bundle, named in
    messages; ``quantize`` None (float32) always passes (returns None). Returns the verdict; raises
    :class:`UngatedError` for a failed or unverdicted form unless ``allow_ungated``, which logs (``warn``, default
    the ``shalik.serve`` logger's warning) what it overrides."""
    if quantize is None:
        return None
    v = verdict(manifest, runtime, quantize)
    if v.ok:
        return v
    if v.ok is False:
        what = f"{v.form} failed the export's quality gate ({v.detail})"
        how = f"serve a form that passed ({_passed(manifest)}), or load it anyway with {OVERRIDE}"
    else:
        what = f"{v.form} has no quality-gate verdict ({v.detail})"
        how = ("export the bundle again to measure it (python -m export.onnx RUN --force gates every form rust_runtime "
               f"makes; --quantize {quantize} adds and gates the ONNX graph), or load it anyway with {OVERRIDE}")
    if not allow_ungated:
        raise UngatedError(f"{where}: {what}; {how}")
    (warn or log.warning)(f"{where}: serving {what}, because allow_ungated overrides the gate")
    return v


def _passed(manifest: dict | None) -> str:
    ok = sorted(name for name, r in forms_summary(manifest).items() if r)
    return "passed: " + ", ".join(ok) if ok else "none passed; float32 always serves"
