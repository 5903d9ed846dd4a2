"""Checkpoints in Hugging Face layout, written atomically, verified by sha256 on load.

``runs/NAME/checkpoints/step-000500/`` holds (docs/design.md): ``model.safetensors`` (Hugging Face Llama names; a
tied lm_head is not stored: transformers and our loader re-tie it), ``config.json`` (LlamaConfig),
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``optimizer.pt`` (loads with
``torch.load(weights_only=True)``), ``trainer_state.json`` (step, tokens, data position, scheduler, every RNG
state, config sha256), ``data_summary.json`` (sources and licences for the model card) and ``SHA256SUMS``.

Writes go to ``checkpoints/.tmp-step-…`` first: every file is fsynced, the folder renamed into place, and only
then ``checkpoints/latest`` (a text file naming the newest complete step folder) replaced atomically. A kill at
any moment leaves the previous checkpoint and ``latest`` intact (case TR5); leftovers are removed by the next
save. Old step folders beyond ``keep_last`` are deleted after ``latest`` moves.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from contract.atomic import TMP_PREFIX, atomic_dir, atomic_write_bytes, atomic_write_text, sha256_file
from train.hf_files import NAMES as HF_NAMES
from train.hf_files import write_hf_files
from train.model import LlamaForCausalLM, ModelConfig

SUMS = "SHA256SUMS"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, tampered with or does not match the model."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, contiguous, with a tied lm_head left out (stored once)."""
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        sd[k] = v.detach().contiguous()
    return sd


def save_weights(model: LlamaForCausalLM, path: Path, dtype: torch.dtype | None = None) -> None:
    """``model.safetensors`` with Hugging Face names (``metadata={"format": "pt"}``), optionally cast."""
    sd = hf_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    safetensors.torch.save_file({k: v.cpu() for k, v in sd.items()}, str(path), metadata={"format": "pt"})


def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Load ``model.safetensors`` into ``model`` (strict: every tensor present with the right shape), then
    re-tie lm_head. Raises CheckpointError naming the missing, unexpected or mis-shaped tensors."""
    try:
        sd = safetensors.torch.load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError / OSError / others
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        sd.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    shapes = sorted(f"{k}: {tuple(sd[k].shape)} in the file, model expects {tuple(expected[k])}"
                    for k in set(sd) & set(expected) if tuple(sd[k].shape) != tuple(expected[k]))
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}{' …' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected tensors {extra[:5]}{' …' if len(extra) > 5 else ''}")
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:3]))
        raise CheckpointError(f"{path} does not match the model config: " + ", ".join(parts))
    model.load_state_dict(sd, strict=False)
    model.tie_weights()


def rng_state() -> dict:
    """Every RNG state (Python, numpy, torch CPU, torch CUDA) as JSON-serialisable lists."""
    st = {
        "python": _to_json(random.getstate()),
        "numpy": _to_json(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict) -> None:
    """Restore what :func:`rng_state` saved."""
    random.setstate(_from_json_py(st["python"]))
    ns = st["numpy"]
    np.random.set_state((ns[0], np.array(ns[1], dtype=np.uint32), ns[2], ns[3], ns[4]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])


def _to_json(x):
    if isinstance(x, tuple | list):
        return [_to_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer | np.floating):
        return x.item()
    return x


def _from_json_py(x):
    return (x[0], tuple(x[1]), x[2])


def write_sums(folder: Path) -> None:
    """``SHA256SUMS`` (``<sha256>  <name>`` lines, sha256sum's format) for every file in ``folder``."""
    lines = [f"{sha256_file(p)}  {p.name}" for p in sorted(folder.iterdir()) if p.is_file() and p.name != SUMS]
    (folder / SUMS).write_text("\n".join(lines) + "\n")


def verify_sums(folder: Path) -> None:
    """Check every file against ``SHA256SUMS``; raises CheckpointError naming the first bad or missing file."""
    sums = folder / SUMS
    if not sums.is_file():
        raise CheckpointError(f"{folder}: no {SUMS} (an incomplete or foreign checkpoint)")
    try:
        text = sums.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{sums}: unreadable ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise CheckpointError(f"{sums}: line {n} is not '<sha256>  <file name>' (truncated or damaged): {line[:80]!r}")
        digest, name = parts
        f = folder / name.strip()
        if not f.is_file():
            raise CheckpointError(f"{folder}: {name.strip()} is listed in {SUMS} but missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f}: sha256 does not match {SUMS} (truncated or modified)")
    for name in ("trainer_state.json", "config.json"):
        f = folder / name
        if f.is_file():
            try:
                ok = isinstance(json.loads(f.read_text(encoding="utf-8")), dict)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{f}: not a JSON object ({e})") from None
            if not ok:
                raise CheckpointError(f"{f}: not a JSON object")


def save_checkpoint(ckpt_root: Path, step: int, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer | None,
                    trainer_state: dict, extra_files: dict[str, Path | str | bytes], keep_last: int,
                    serializer=None, special_ids: tuple[int, int] | None = None) -> Path:
    """Write ``ckpt_root/step-NNNNNN`` atomically, then point ``latest`` at it and prune old ones.

    ``extra_files`` maps file names to a source path (copied), a str (written as text) or bytes.
    ``special_ids`` = (eot_id, pad_id): also write the Hugging Face sidecar files (config.json,
    generation_config.json, tokenizer_config.json) with ``train.hf_files``; ``extra_files`` may then not name
    them (ValueError). ``serializer(obj, path)`` replaces ``torch.save`` for the optimizer (tests plant a failing
    one). Returns the step folder.
    """
    if special_ids is not None and set(extra_files) & set(HF_NAMES):
        raise ValueError(f"extra_files names {sorted(set(extra_files) & set(HF_NAMES))}, which special_ids writes")
    final = ckpt_root / step_name(step)
    with atomic_dir(final, overwrite=True) as tmp:
        save_weights(model, tmp / "model.safetensors")
        for name, src in extra_files.items():
            if isinstance(src, bytes):
                atomic_write_bytes(tmp / name, src)
            elif isinstance(src, str):
                atomic_write_text(tmp / name, src)
            else:
                shutil.copyfile(src, tmp / name)
        if special_ids is not None:  # after tokenizer.json: its chat tokens decide the chat template
            write_hf_files(tmp, model.config, *special_ids)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1) + "\n")
        if optimizer is not None:
            (serializer or torch.save)(optimizer.state_dict(), tmp / "optimizer.pt")
        write_sums(tmp)
    atomic_write_text(ckpt_root / "latest", final.name + "\n")
    prune(ckpt_root, keep_last)
    return final


def prune(ckpt_root: Path, keep_last: int) -> None:
    """Delete step folders older than the newest ``keep_last`` (never the one ``latest`` names)."""
    latest = read_latest_name(ckpt_root)
    steps = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for p in steps[:-keep_last] if keep_last > 0 else []:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def read_latest_name(ckpt_root: Path) -> str | None:
    f = ckpt_root / "latest"
    if not f.is_file():
        return None
    try:
        name = f.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if name and not re.fullmatch(r"step-\d+", name):
        raise CheckpointError(f"{f}: names {name[:80]!r}, not a step folder")
    return name or None


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a step folder, a ``checkpoints/`` folder or a run folder (its latest).

    The folder named by ``latest`` is verified; if it is damaged the newest intact step folder is used instead
    (and said so). Raises CheckpointError when there is none.
    """
    p = Path(path)
    if (p / "trainer_state.json").is_file() or (p / SUMS).is_file():
        verify_sums(p)
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not root.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint, a checkpoints folder or a run folder")
    candidates = []
    errors = []
    try:
        latest = read_latest_name(root)
    except CheckpointError as e:
        errors.append(str(e))
        latest = None
    if latest:
        candidates.append(root / latest)
    candidates += sorted((q for q in root.glob("step-*") if q.is_dir() and not q.name.startswith(TMP_PREFIX)),
                         reverse=True)
    for c in candidates:
        try:
            verify_sums(c)
            if errors:
                print(f"warning: {'; '.join(errors)}; using {c}, the newest intact checkpoint, instead",
                      file=sys.stderr)
            return c
        except CheckpointError as e:
            errors.append(str(e))
    raise CheckpointError(f"{path}: no complete checkpoint found" + (f" ({errors[0]})" if errors else ""))


def load_model(ckpt: Path, device: str | torch.device = "cpu") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from ``config.json`` and load ``model.safetensors`` (float32)."""
    try:
        cfg = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{ckpt}/config.json: cannot build a model config from it ({e})") from None
    model = LlamaForCausalLM(cfg)
    load_weights(model, ckpt / "model.safetensors")
    return model.to(device), cfg
