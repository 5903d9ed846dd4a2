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

:class:`Checkpointer`, the Trainer's component, is a run's ``runs/NAME/checkpoints``: save (rank 0, the others
wait), ``--resume`` (exactly: weights, optimizer, data position, schedule, RNG), ``--init-from`` (weights only),
refusing to overwrite an existing run, and the comparison of a checkpoint's model config with the run's. It owns
``trainer_state.json``'s keys, written by :meth:`Checkpointer.save` and read by :meth:`Checkpointer.resume`."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from contract.atomic import TMP_PREFIX, atomic_dir, atomic_write_bytes, atomic_write_text, sha256_file
from train.components.placement import DistInfo, barrier
from train.components.run_data import RunData
from train.components.state import TrainState
from train.config import Config, spell, to_toml
from train.errors import TrainError
from train.hf_files import NAMES as HF_NAMES
from train.hf_files import write_hf_files
from train.model import LlamaForCausalLM, ModelConfig
from train.optim import lr_for

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

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


def find_checkpoint(path: str | Path, warn: bool = True) -> Path:
    """A checkpoint folder from a step folder, a ``checkpoints/`` folder or a run folder (its latest).

    The folder named by ``latest`` is verified; if it is damaged the newest intact step folder is used instead
    (and said so on stderr, unless ``warn`` is false: the checks that only look). Raises CheckpointError when there
    is none.
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
    candidates += sorted((q for q in root.glob("step-*") if q.is_dir() and not q.name.startswith(TMP_PREFIX)
                          and q.name != latest), reverse=True)
    for c in candidates:
        try:
            verify_sums(c)
            if errors and warn:
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


def check_same_model(ckpt: Path, mcfg: ModelConfig) -> None:
    """CheckpointError naming every key of ``ckpt/config.json`` that differs from ``mcfg`` (old → new)."""
    saved = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    diffs = [f"{k}: {getattr(saved, k)!r} in the checkpoint → {getattr(mcfg, k)!r} now"
             for k in mcfg.to_dict() if getattr(saved, k) != getattr(mcfg, k)]
    if diffs:
        raise CheckpointError(f"the model config differs from {ckpt}: " + "; ".join(diffs))


INIT = "init.json"   # runs/NAME/init.json: the checkpoint a run started from (--init-from, a fine-tuning base)


def checkpoint_identity(path: str | Path) -> dict | None:
    """``{"checkpoint": resolved step folder, "sums_sha256": sha256 of its SHA256SUMS}`` of the newest intact
    checkpoint at ``path`` (a step, checkpoints or run folder): what a run records of the weights it started from, so
    that the same command with another start is not taken for the same run. None when there is none."""
    try:
        ckpt = find_checkpoint(path)
        return {"checkpoint": str(ckpt.resolve()), "sums_sha256": hashlib.sha256((ckpt / SUMS).read_bytes()).hexdigest()}
    except (CheckpointError, OSError):
        return None


def same_config(run_dir: Path, cfg: Config, init: dict | None = None) -> bool:
    """True when ``run_dir/config.toml`` (written when a run starts) is ``cfg`` resolved (:func:`train.config.to_toml`)
    and its ``init.json`` records ``init`` (absent for None): the folder holds a run of this very config and start."""
    c, i = Path(run_dir) / "config.toml", Path(run_dir) / INIT
    try:
        if not (c.is_file() and c.read_text(encoding="utf-8") == to_toml(cfg)):
            return False
        return (json.loads(i.read_text(encoding="utf-8")) if i.is_file() else None) == init
    except (OSError, UnicodeDecodeError, ValueError):
        return False


def config_changes(run_dir: Path, cfg: Config, most: int = 4) -> str:
    """What differs between ``run_dir/config.toml`` and ``cfg``, for a refusal: ``"train.lr 0.01 → 0.002, …"`` (at
    most ``most`` keys, then how many more), "config.toml is missing" or "unreadable"; "" when they are equal."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return "config.toml is missing"
    try:
        old = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return "config.toml is unreadable"
    new = tomllib.loads(to_toml(cfg))

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.update(flat(v, key + ".") if isinstance(v, dict) and prefix == "" else {key: v})
        return out

    a, b = flat(old), flat(new)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = [f"{k} {spell(a[k]) if k in a else '(none)'} → {spell(b[k]) if k in b else '(none)'}" for k in keys[:most]]
    return ", ".join(shown) + (f" and {len(keys) - most} more" if len(keys) > most else "")


class Checkpointer:
    """``run_dir/checkpoints`` of one run; ``last`` is the newest checkpoint this run wrote or resumed from (None
    before either). ``log`` is the run's (rank 0) log."""

    def __init__(self, cfg: Config, run_dir: Path, dist: DistInfo, log: Callable[[str], None]):
        self.cfg = cfg
        self.run_dir = run_dir
        self.root = run_dir / "checkpoints"
        self.dist = dist
        self.log = log
        self.last: Path | None = None

    def refuse_existing_run(self, resume: bool, init: dict | None = None) -> None:
        """TrainError when runs/NAME already holds a checkpoint and this is not a --resume (checked before the data
        is prepared, so the refusal is immediate; rank 0 only). The CLIs resume a run of the same config on their
        own (:func:`train.run.run_trainer`), so from them this refuses a run of another config."""
        if not self.dist.is_main:
            return
        existing = None
        if self.root.is_dir():
            try:
                existing = find_checkpoint(self.run_dir, warn=False)
            except CheckpointError:
                existing = None
        if existing is None and resume:
            raise TrainError(f"--resume: {self.run_dir} holds no checkpoint to continue (start it without --resume)")
        if existing is not None and not resume:
            state = json.loads((existing / "trainer_state.json").read_text())
            if same_config(self.run_dir, self.cfg, init):
                which = "a run"
            else:
                changes = config_changes(self.run_dir, self.cfg) or f"{INIT}: it started from another checkpoint"
                which = f"a run of another config ({changes})"
            raise TrainError(
                f"{self.run_dir} already holds {which}, checkpoint at step {state['step']}. Use --name NEW for a "
                f"new run, --resume to continue this one with this config, or delete {self.run_dir}.")

    def load_init(self, init_from: str, model: LlamaForCausalLM) -> Path:
        """``--init-from``: the weights of a checkpoint (step folder, checkpoints folder or run folder) into
        ``model``; returns the folder. TrainError when there is none or its model config differs."""
        try:
            src = find_checkpoint(init_from)
            check_same_model(src, model.config)
            load_weights(model, src / "model.safetensors")
        except CheckpointError as e:
            raise TrainError(f"--init-from: {e}") from None
        return src

    def resume(self, model: LlamaForCausalLM, optimizer, data: RunData, state: TrainState,
               device: torch.device) -> Path:
        """``--resume``: load the newest intact checkpoint of this run into the model, the optimizer, the loader's
        position, ``state`` and every RNG; returns its folder. TrainError (naming the way out) when there is none,
        or its model config, tokenizer or ``train.optimizer`` differ from the run's."""
        try:
            ckpt = find_checkpoint(self.run_dir)
        except CheckpointError as e:
            raise TrainError(f"--resume: {e}") from None
        try:
            check_same_model(ckpt, model.config)
        except CheckpointError as e:
            raise TrainError(f"--resume refused: {e}. Start a new run with --name, or --init-from {ckpt} to "
                             f"fine-tune from its weights.") from None
        saved = json.loads((ckpt / "trainer_state.json").read_text())
        if saved.get("tokenizer_sha256") and saved["tokenizer_sha256"] != data.tokenizer_sha256:
            raise TrainError(f"--resume refused: the tokenizer differs from the one {ckpt} was trained with")
        t = self.cfg.train
        was = saved.get("scheduler", {}).get("optimizer", "adamw")  # checkpoints before train.optimizer: AdamW
        if was != t.optimizer:
            raise TrainError(f"--resume refused: {ckpt} was trained with train.optimizer = {was!r}, the config says "
                             f"{t.optimizer!r}. Resume with --set train.optimizer={was}, or start a new "
                             f"run with --init-from {ckpt} (its weights, a fresh optimizer).")
        load_weights(model, ckpt / "model.safetensors")
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device, weights_only=True))
        state.step = int(saved["step"])
        state.tokens = int(saved["tokens"])
        state.nonfinite = int(saved.get("nonfinite", 0))
        state.wall_before = float(saved.get("wall_s", 0.0))
        state.dtype = str(saved.get("dtype", ""))
        data.loader.set_position(saved["data_position"])
        set_rng_state(saved["rng"])
        if saved.get("config_sha256") != self.cfg.sha256():
            self.log("note: the config differs from the checkpoint's in keys that do not change the model "
                     "(the schedule or eval settings, say); continuing with the new values")
        self.last = ckpt
        state.at_init = False
        return ckpt

    def trainer_state(self, state: TrainState, model: LlamaForCausalLM, data: RunData) -> dict:
        """``trainer_state.json``: step, tokens, data position, the schedule, every RNG state, the config's and the
        tokenizer's sha256, the model config, the non-finite streak, wall seconds, world size, torch version, the compute
        dtype."""
        t = self.cfg.train
        return {
            "step": state.step, "tokens": state.tokens, "data_position": data.loader.position,
            "scheduler": {"kind": f"warmup_{t.schedule}", "optimizer": t.optimizer, "step": state.step, "lr": t.lr,
                          "min_lr": t.min_lr, "warmup_steps": t.warmup_steps, "max_steps": t.max_steps,
                          "current_lr": lr_for(state.step, t)},
            "rng": rng_state(), "config_sha256": self.cfg.sha256(), "model_config": model.config.to_dict(),
            "tokenizer_sha256": data.tokenizer_sha256, "nonfinite": state.nonfinite,
            "wall_s": state.elapsed(), "world_size": self.dist.world_size,
            "torch_version": torch.__version__, "dtype": state.dtype,
        }

    def save(self, state: TrainState, model: LlamaForCausalLM, optimizer, data: RunData,
             serializer=None) -> Path | None:
        """Checkpoint the current step (rank 0 writes and returns the folder; the others wait and get None).
        ``serializer`` replaces ``torch.save`` for the optimizer (tests plant a failing one)."""
        path = None
        if self.dist.is_main:
            path = save_checkpoint(self.root, state.step, model, optimizer, self.trainer_state(state, model, data),
                                   data.checkpoint_files(state.tokens), self.cfg.train.keep_last,
                                   serializer=serializer, special_ids=(data.eot_id, data.pad_id))
            self.last = path
            self.log(f"checkpoint: {path}")
        barrier(self.dist)
        return path

    def holds(self, step: int) -> bool:
        """Whether the newest checkpoint of this session is of ``step`` (the final save is then not repeated)."""
        return self.last is not None and self.last.name == step_name(step)

