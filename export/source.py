"""The checkpoint an export starts from: found, verified against SHA256SUMS and loaded, or refused.

``load_source(path)`` takes a step folder (``runs/NAME/checkpoints/step-000500``), a ``checkpoints/`` folder or a
run folder (meaning the step folder that ``checkpoints/latest`` names, else the newest one). Unlike training's
``find_checkpoint`` it never falls back to an older step when the newest is damaged: an export of something
other than what was asked for would be a silent surprise, so a damaged checkpoint is an error naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from contract.atomic import TMP_PREFIX
from contract.bundle import CONFIG, EOT, PAD, TOKENIZER, WEIGHTS, sha256_file
from export.errors import ExportError
from train.components.checkpoint import SUMS, CheckpointError, load_model, read_latest_name, verify_sums
from train.model import LlamaForCausalLM, ModelConfig

REQUIRED = (WEIGHTS, CONFIG, TOKENIZER)  # the bundle's Hugging Face files come from the checkpoint's


@dataclass
class Source:
    """A verified checkpoint and its model (float32, eval mode, on CPU)."""

    ckpt: Path                 # the step folder
    run_dir: Path | None       # the run folder above ``checkpoints/``, when there is one
    model: LlamaForCausalLM
    cfg: ModelConfig
    step: int | None
    sha256: str                # of the checkpoint's model.safetensors
    eot_id: int
    pad_id: int

    def default_out(self) -> Path:
        """``<run dir>/bundle``, or ``<step folder>-bundle`` beside a loose checkpoint."""
        if self.run_dir is not None:
            return self.run_dir / "bundle"
        return self.ckpt.with_name(self.ckpt.name + "-bundle")

    def read_json(self, name: str) -> dict | None:
        """A JSON file of the checkpoint, or None when absent or unreadable."""
        try:
            return json.loads((self.ckpt / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None


def resolve_checkpoint(path: str | Path) -> Path:
    """The step folder ``path`` means (see module doc). Raises ExportError when there is none."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"{p}: no such file or directory (expected a checkpoint, a checkpoints/ folder or a run)")
    if not p.is_dir():
        raise ExportError(f"{p}: not a checkpoint (a checkpoint is a folder holding {', '.join(REQUIRED)} and {SUMS})")
    if (p / SUMS).is_file() or (p / WEIGHTS).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    try:
        latest = read_latest_name(root)
    except CheckpointError as e:
        raise ExportError(f"{root / 'latest'}: {e}") from None
    if latest:
        if not (root / latest).is_dir():
            raise ExportError(f"{root / 'latest'} names {latest!r}, which does not exist")
        return root / latest
    steps = sorted(q for q in root.glob("step-*") if q.is_dir() and not q.name.startswith(TMP_PREFIX))
    if not steps:
        raise ExportError(f"{p}: not a checkpoint, a checkpoints/ folder or a run folder (no {SUMS}, no "
                          f"{WEIGHTS}, no step-* folders)")
    return steps[-1]


def load_source(path: str | Path) -> Source:
    """Resolve, verify (every file against SHA256SUMS) and load a checkpoint.

    Raises ExportError naming the problem: not a checkpoint, a file missing, a sha256 mismatch (truncated or
    modified file), an unreadable safetensors file, or a config.json that does not match the weights.
    """
    ckpt = resolve_checkpoint(path)
    missing = [n for n in REQUIRED if not (ckpt / n).is_file()]
    if missing:
        raise ExportError(f"{ckpt}: not a complete checkpoint, {', '.join(missing)} missing")
    try:
        verify_sums(ckpt)
        _check_config(ckpt)
        model, cfg = load_model(ckpt)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    model.eval()
    _check_finite(ckpt, model)
    state = _read_json(ckpt / "trainer_state.json") or {}
    step = state.get("step")
    if step is None and ckpt.name.startswith("step-"):
        try:
            step = int(ckpt.name[5:])
        except ValueError:
            step = None
    eot_id, pad_id = _special_ids(ckpt)
    if not 0 <= eot_id < cfg.vocab_size:
        raise ExportError(f"{ckpt}/{TOKENIZER}: {EOT} has id {eot_id}, outside the model's vocabulary "
                          f"({cfg.vocab_size}); the tokenizer does not belong to these weights")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    return Source(ckpt=ckpt, run_dir=run_dir, model=model, cfg=cfg, step=step,
                  sha256=sha256_file(ckpt / WEIGHTS), eot_id=eot_id, pad_id=pad_id)


def _check_finite(ckpt: Path, model: LlamaForCausalLM) -> None:
    """Refuse weights holding NaN or inf (a run that diverged, trained on with ``--no-preflight``): every runtime
    would compute NaN from them, and the first to say so was a traceback deep in the parity check. Raises
    ExportError naming the first such tensor and how many of its values are not finite."""
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                bad = int((~torch.isfinite(p)).sum())
                raise ExportError(f"{ckpt}/{WEIGHTS}: {name} holds {bad:,} of {p.numel():,} values that are NaN or "
                                  "inf; these weights compute nothing (the run diverged: see its train.log, train "
                                  "again with a lower train.lr or with preflight on)")


def _check_config(ckpt: Path) -> None:
    """Refuse a config.json whose head counts cannot describe a model (before building one)."""
    d = _read_json(ckpt / CONFIG)
    if not isinstance(d, dict):
        raise ExportError(f"{ckpt}/{CONFIG}: not a JSON object")
    try:
        cfg = ModelConfig.from_dict(d)
        ok = (min(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                  cfg.num_key_value_heads, cfg.intermediate_size, cfg.max_position_embeddings) > 0
              and cfg.hidden_size % cfg.num_attention_heads == 0
              and cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim % 2 == 0)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{ckpt}/{CONFIG}: cannot build a model config from it ({e})") from None
    if not ok:
        raise ExportError(f"{ckpt}/{CONFIG}: inconsistent sizes (hidden_size {cfg.hidden_size}, heads "
                          f"{cfg.num_attention_heads}, kv heads {cfg.num_key_value_heads}); it does not describe "
                          "a model these weights could belong to")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _special_ids(ckpt: Path) -> tuple[int, int]:
    """Ids of ``<|endoftext|>`` and ``<|pad|>`` from tokenizer.json (0 and 1 in Shalik's tokenizers)."""
    tok = _read_json(ckpt / TOKENIZER)
    if tok is None:
        raise ExportError(f"{ckpt}/{TOKENIZER}: not valid JSON")
    ids = {t.get("content"): t.get("id") for t in tok.get("added_tokens", []) if isinstance(t, dict)}
    if not isinstance(ids.get(EOT), int):
        raise ExportError(f"{ckpt}/{TOKENIZER}: no {EOT} special token")
    pad = ids.get(PAD)
    return ids[EOT], pad if isinstance(pad, int) else ids[EOT]
