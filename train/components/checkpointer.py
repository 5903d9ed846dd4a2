"""A run's ``runs/NAME/checkpoints``: save (rank 0, the others wait), ``--resume`` (exactly: weights, optimizer,
data position, schedule, RNG), ``--init-from`` (weights only), refusing to overwrite an existing run, and the
comparison of a checkpoint's model config with the run's. The file formats are :mod:`train.checkpoint`'s; this
module owns ``trainer_state.json``'s keys, written by :meth:`Checkpointer.save` and read by
:meth:`Checkpointer.resume`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from train import distributed as D
from train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_name,
)
from train.components.run_data import RunData
from train.components.state import TrainState
from train.config import Config
from train.errors import TrainError
from train.model import LlamaForCausalLM, ModelConfig
from train.optim import lr_for


def check_same_model(ckpt: Path, mcfg: ModelConfig) -> None:
    """CheckpointError naming every key of ``ckpt/config.json`` that differs from ``mcfg`` (old → new)."""
    saved = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    diffs = [f"{k}: {getattr(saved, k)!r} in the checkpoint → {getattr(mcfg, k)!r} now"
             for k in mcfg.to_dict() if getattr(saved, k) != getattr(mcfg, k)]
    if diffs:
        raise CheckpointError(f"the model config differs from {ckpt}: " + "; ".join(diffs))


class Checkpointer:
    """``run_dir/checkpoints`` of one run; ``last`` is the newest checkpoint this run wrote or resumed from (None
    before either). ``log`` is the run's (rank 0) log."""

    def __init__(self, cfg: Config, run_dir: Path, dist: D.DistInfo, log: Callable[[str], None]):
        self.cfg = cfg
        self.run_dir = run_dir
        self.root = run_dir / "checkpoints"
        self.dist = dist
        self.log = log
        self.last: Path | None = None

    def refuse_existing_run(self, resume: bool) -> None:
        """TrainError when runs/NAME already holds a checkpoint and this is not a --resume (checked before the data
        is prepared, so the refusal is immediate; rank 0 only)."""
        if not self.dist.is_main:
            return
        existing = None
        if self.root.is_dir():
            try:
                existing = find_checkpoint(self.run_dir)
            except CheckpointError:
                existing = None
        if existing is not None and not resume:
            state = json.loads((existing / "trainer_state.json").read_text())
            raise TrainError(
                f"{self.run_dir} already holds a run (checkpoint at step {state['step']}). Pass --resume to continue "
                f"it, --name NEW for a new run, or delete {self.run_dir}.")

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
        D.barrier(self.dist)
        return path

    def holds(self, step: int) -> bool:
        """Whether the newest checkpoint of this session is of ``step`` (the final save is then not repeated)."""
        return self.last is not None and self.last.name == step_name(step)

