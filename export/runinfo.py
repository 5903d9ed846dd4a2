"""What the run says about the checkpoint: its evaluation against the random-init twin and its data sources.

Read from the run folder (``summary.json`` when it describes this checkpoint's step, else the ``metrics.jsonl``
eval row of that step, plus the step-0 row's ``random_init``) and from the checkpoint's ``data_summary.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from export.source import Source


def eval_summary(src: Source) -> dict | None:
    """``{step, val: {lang: {nll, bpc, tokens}}, random_init: {…}}`` for the checkpoint's step, or None; with
    ``val_sources`` (the whole validation split per source file) and ``compression_floor`` (PPMd-16 and xz on the
    same text) when the run's final evaluation (summary.json) describes this step."""
    if src.run_dir is None:
        return None
    rows = _metrics(src.run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("val"), dict)]
    random_init = next((r["random_init"] for r in evals if isinstance(r.get("random_init"), dict)), None)
    val = next((r["val"] for r in reversed(evals) if r.get("step") == src.step), None)
    summary = _read(src.run_dir / "summary.json")
    if val is None and isinstance(summary, dict) and summary.get("steps") == src.step:
        val = summary.get("val")
        random_init = random_init or summary.get("random_init")
    if val is None and random_init is None:
        return None
    out = {"step": src.step, "val": val, "random_init": random_init}
    if isinstance(summary, dict) and summary.get("steps") == src.step:
        out.update({k: summary[k] for k in ("val_sources", "compression_floor") if isinstance(summary.get(k), dict)})
    return out


def data_summary(src: Source) -> dict | None:
    """``{sources: [{source, license, docs, chars}], languages: {lang: {…, chars_per_token}}, tokens_seen}``
    from the checkpoint's data_summary.json, or None."""
    d = src.read_json("data_summary.json")
    if not isinstance(d, dict):
        return None
    keep = ("sources", "languages", "target_mix", "token_mix", "tokens_seen", "tokenizer_sha256")
    return {k: d[k] for k in keep if k in d}


def _read(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _metrics(path: Path) -> list[dict]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out
