"""``loss.png``: train loss and val NLL per language against tokens seen (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from contract.atomic import FILE_MODE, TMP_PREFIX


def read_metrics(path: Path) -> list[dict]:
    """Rows of ``metrics.jsonl`` (a torn last line, from a kill mid-write, is ignored)."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_loss(metrics_path: Path, out_path: Path, title: str = "") -> bool:
    """Draw ``out_path`` from ``metrics_path`` (atomically); returns False when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not train and not evals:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if train:
        ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], color="0.6", lw=1, label="train loss")
    langs = sorted({k for r in evals for k in r.get("val", {}) if k != "all"})
    colors = {"bn": "tab:red", "en": "tab:blue"}
    for lang in langs:
        pts = [(r["tokens"], r["val"][lang]["nll"]) for r in evals if lang in r.get("val", {})]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors.get(lang), label=f"val NLL ({lang})")
    ri = next((r.get("random_init") for r in evals if r.get("random_init")), None)
    if ri and "all" in ri:
        ax.axhline(ri["all"]["nll"], color="k", ls=":", lw=1, label=f"random init ({ri['all']['nll']:.2f})")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("nats / token")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".png", dir=out_path.parent)
    os.close(fd)
    os.chmod(tmp, FILE_MODE)
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out_path)
    return True
