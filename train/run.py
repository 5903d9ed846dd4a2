"""``python -m train.run``: prepare data, run preflight, train, evaluate, checkpoint — resumable exactly.

With no arguments it trains config ``small`` on ``data/sample`` into ``runs/small``. The run directory, the
metrics keys and the checkpoint layout are docs/design.md's. The loop:

* device chosen automatically; on CUDA bf16 autocast, TF32, fused AdamW, the SDPA backend picked by a numerics
  check (cuDNN, then flash) and pinned-memory batches; on CPU float32. Before anything is allocated on a GPU the
  planner (``train.plan``) refuses a config that cannot fit;
* ``train.compile``: true (compile each decoder layer and the head + loss with static shapes, warmed up at the
  training micro-batch; a failure is an error), "auto" (the same, falling back to eager with a warning) or false;
  the log and ``summary.json`` say which path ran, why, and how many graphs were compiled after the warm-up;
* ``train.activation_checkpoint``: "none", "selective" (every ``activation_checkpoint_every``-th decoder layer
  recomputes its forward in the backward instead of keeping its activations) or "full" (every layer);
* the loss is computed inside the training module (``train.model.CausalLMLoss``): in bf16 the float32 logits are
  never held whole;
* AdamW (no decay on norms and embeddings) or Muon on the hidden matrices, warmup then a cosine, linear or WSD
  decay to ``min_lr`` (train/optim.py), gradient clipping;
* gradient accumulation normalised by the number of target tokens of the whole step (every micro-batch on every
  rank), not by the number of micro-batches (case TR1);
* evaluation every ``eval_every`` steps (val NLL and bits per character per language; at step 0 also the
  random-init twin) and greedy samples of fixed Bangla and English prompts;
* checkpoints every ``ckpt_every`` steps and at the end (``train.checkpoint``), ``--resume`` continues exactly
  (same weights, optimizer, data position, schedule and RNG), a changed model config is refused;
* SIGTERM / SIGINT save a checkpoint and exit 0; a non-finite loss or gradient skips the step, and
  ``max_nonfinite`` in a row stop the run (exit 1) naming the last good checkpoint;
* under ``torchrun`` DistributedDataParallel (100 MB buckets, gradients as bucket views, no buffer broadcast,
  static graph when there is no gradient accumulation), each rank its slice of every step, rank 0 alone writing; rank 0 prepares the data while the
  others wait on the process group's store (no collective, so no NCCL timeout), or prepare first with
  ``python -m train.data prepare``;
* the log goes to stderr and to ``runs/NAME/train.log``; peak memory is measured from the first training step
  (preflight and setup excluded).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from train import distributed as D
from train import plan as P
from train.atomic import atomic_write_json, atomic_write_text
from train.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.config import (
    Config,
    ConfigError,
    HelpFormatter,
    add_config_args,
    config_from_args,
    resolve_path,
    to_toml,
)
from train.corpus import DataError
from train.data import Prepared, prepare
from train.device import (
    autocast_ctx,
    choose_sdpa_backend,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    resolve_device,
    resolve_dtype,
    sdpa_context,
    setup_cpu_allocator,
    setup_cuda_fast_paths,
)
from train.errors import NonFiniteStop, TrainError
from train.evaluate import evaluate, greedy_samples
from train.loader import TrainLoader, step_batches, val_windows
from train.model import CausalLMLoss, LlamaForCausalLM, ModelConfig
from train.optim import build_optimizer_for, lr_for
from train.plots import plot_loss, read_metrics
from train.preflight import PreflightFailed, run_preflight
from train.shards import open_shard
from train.tokenizer import EOT, load_tokenizer, token_char_counts

DATA_WAIT_S = 6 * 3600  # how long ranks > 0 wait for rank 0 to prepare the data under torchrun
DDP_BUCKET_MB = 100  # fewer, larger all-reduces than DDP's 25 MB default (base-400m: 16 buckets, not 64)


@dataclasses.dataclass
class StepStats:
    """What one optimizer step reports: mean loss (nats per target token over all ranks), gradient norm before
    clipping, learning rate, target tokens of the whole step, whether it was skipped as non-finite, and whether
    any rank asked to stop (agreed by all ranks)."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    skipped: bool = False
    stop: bool = False


@dataclasses.dataclass
class CompileInfo:
    """Which training path ran: ``path`` "compiled" or "eager", ``reason`` why, the warm-up seconds, and the
    graphs Dynamo compiled during the warm-up and after it (``recompiles``, filled in at the end; 0 expected)."""

    requested: bool | str
    path: str = "eager"
    reason: str = ""
    warmup_s: float = 0.0
    graphs: int = 0
    recompiles: int | None = None


def model_config_for(cfg: Config, vocab_size: int) -> ModelConfig:
    """The run's :class:`ModelConfig`: ``[model]`` plus the tokenizer's vocabulary size."""
    return ModelConfig(vocab_size=vocab_size, **dataclasses.asdict(cfg.model))


class Trainer:
    """One training run: ``Trainer(cfg, …).train()``; see the module doc."""

    def __init__(self, cfg: Config, *, resume: bool = False, init_from: str | None = None, use_preflight: bool = True,
                 log=None):
        self.cfg = cfg
        self.resume = resume
        self.init_from = init_from
        self.use_preflight = use_preflight and cfg.train.preflight
        self.device = resolve_device(cfg.train.device)
        self.dist = D.init_distributed(self.device.type)
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        self.dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.run_dir = Path(cfg.run.out_dir) / cfg.run.name
        self.ckpt_root = self.run_dir / "checkpoints"
        self._log = log
        self.stop_requested = False
        self.step = 0
        self.tokens = 0
        self.nonfinite = 0
        self.wall_before = 0.0
        self.t_start = time.time()
        self.last_ckpt: Path | None = None
        self.model: LlamaForCausalLM | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.prepared: Prepared | None = None
        self.tokenizer = None
        self.eot_id = self.pad_id = self.vocab_size = None
        self.mcfg: ModelConfig | None = None
        self.char_counts: np.ndarray | None = None
        self.loader: TrainLoader | None = None
        self.val: dict[str, list[np.ndarray]] = {}
        self.at_init = True
        self.flops_per_token = 0.0
        self.peak: float | None = None
        self.ctx = contextlib.nullcontext()
        self.micro, self.accum = cfg.train.micro_batch_size, cfg.train.grad_accum
        self.compile_info = CompileInfo(requested=cfg.train.compile)
        self.sdpa = ("default", None, "")
        self.plan: P.Plan | None = None
        self._graphs_after_warmup = 0

    # --------------------------------------------------------------------------------------- helpers
    @classmethod
    def from_args(cls, args) -> Trainer:
        try:
            cfg = config_from_args(args)
        except ConfigError as e:
            raise TrainError(str(e)) from None
        if getattr(args, "name", None):
            cfg.run.name = args.name
        return cls(cfg, resume=getattr(args, "resume", False), init_from=getattr(args, "init_from", None),
                   use_preflight=not getattr(args, "no_preflight", False))

    def log(self, msg: str) -> None:
        """Rank 0: to the ``log`` callback (or stderr) and, once runs/NAME exists, to runs/NAME/train.log."""
        if not self.dist.is_main:
            return
        if self._log:
            self._log(msg)
        else:
            tqdm.write(msg, file=sys.stderr)
        if self.run_dir.is_dir():
            with open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    def _micro_split(self) -> tuple[int, int]:
        """(micro_batch_size, grad_accum) per rank such that the global batch stays as configured."""
        t, w = self.cfg.train, self.dist.world_size
        if t.grad_accum % w == 0:
            return t.micro_batch_size, t.grad_accum // w
        if t.micro_batch_size % w == 0:
            return t.micro_batch_size // w, t.grad_accum
        raise TrainError(f"world size {w} divides neither train.grad_accum ({t.grad_accum}) nor "
                         f"train.micro_batch_size ({t.micro_batch_size}): the global batch cannot be kept")

    # --------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        self.prepared = self._prepare_data()
        idx = self.prepared.index
        self.tokenizer = load_tokenizer(self.prepared.tokenizer_dir)
        self.eot_id = self.tokenizer.token_to_id(EOT)
        self.pad_id = self.tokenizer.token_to_id("<|pad|>")
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.mcfg = model_config_for(cfg, self.vocab_size)
        self.char_counts = np.asarray(token_char_counts(self.tokenizer), dtype=np.int64)

        self.loader = TrainLoader(self.prepared.shard_dir, idx, cfg.train.seq_len, cfg.run.seed)
        self.val = {}
        for lang, fname in idx["splits"]["val"]["files"].items():
            shard = open_shard(self.prepared.shard_dir / fname)
            w = val_windows(shard, cfg.train.seq_len, cfg.train.eval_tokens)
            if w:
                self.val[lang] = w

        torch.manual_seed(cfg.run.seed)
        np.random.seed(cfg.run.seed % 2**32)
        random.seed(cfg.run.seed)
        self.micro, self.accum = self._micro_split()
        if self.device.type == "cuda":
            setup_cuda_fast_paths()
            self._check_fits()
            self.sdpa = choose_sdpa_backend(self.device, self.dtype, self.mcfg.num_attention_heads, self.mcfg.head_dim)
            self.log(f"attention: SDPA backend {self.sdpa[0]} ({self.sdpa[2]})")
        else:
            setup_cpu_allocator()
        self.model = LlamaForCausalLM(self.mcfg).to(self.device)
        self.at_init = True
        if self.init_from:
            try:
                src = find_checkpoint(self.init_from)
                self._check_same_model(src)
                load_weights(self.model, src / "model.safetensors")
            except CheckpointError as e:
                raise TrainError(f"--init-from: {e}") from None
            self.at_init = False
            self.log(f"init-from: loaded weights of {src} (fresh optimizer, step 0)")
        self.optimizer = build_optimizer_for(self.model, cfg.train, self.device.type)
        self.flops_per_token = self.model.flops_per_token(cfg.train.seq_len)
        self.peak = peak_flops(self.device, self.dtype)
        self.ctx = autocast_ctx(self.device, self.dtype)

    def _prepare_data(self) -> Prepared:
        """prepare() on rank 0; under torchrun the other ranks wait for rank 0's word on the store (never in a
        collective with a timeout), then open the cache it built."""
        try:
            if not self.dist.enabled:
                return prepare(self.cfg, log=self.log)
            if self.dist.is_main:
                try:
                    prepared = prepare(self.cfg, log=self.log)
                except (DataError, ConfigError) as e:
                    D.publish(self.dist, "data", {"error": str(e)})
                    raise
                D.publish(self.dist, "data", {"ok": True})
                return prepared
            word = D.wait_for(self.dist, "data", "data preparation (to skip the wait, run `python -m train.data "
                              "prepare` with the same config before torchrun)", DATA_WAIT_S, print)
            if "error" in word:
                raise TrainError(f"rank 0 could not prepare the data: {word['error']}")
            return prepare(self.cfg, log=lambda m: None)
        except (DataError, ConfigError, TimeoutError) as e:
            raise TrainError(str(e)) from None

    def _check_fits(self) -> None:
        """Refuse, before allocating anything on the GPU, a micro-batch the planner says cannot fit its memory."""
        t = self.cfg.train
        total = torch.cuda.get_device_properties(self.device).total_memory
        compiled = t.compile is not False
        ac = (t.activation_checkpoint, t.activation_checkpoint_every)
        mm = P.memory_model(self.mcfg, t.seq_len, self.dtype, cache_dir=resolve_path(self.cfg.data.cache_dir),
                            optimizer=t.optimizer)
        self.plan = mm.plan(self.micro, compiled, *ac)
        self.log(f"plan: {self.plan.summary()} against {total / 2**30:.1f} GiB on {torch.cuda.get_device_name()}")
        if self.plan.peak_bytes > P.HEADROOM * total:
            fit = P.largest_micro_batch(self.mcfg, t.seq_len, self.dtype, compiled, total, P.HEADROOM, *ac, mm=mm)
            hint = (f"--set train.micro_batch_size={fit} --set train.grad_accum="
                    f"{max(1, t.micro_batch_size * t.grad_accum // fit)}" if fit else "a smaller model")
            raise TrainError(f"the planner estimates a peak of {self.plan.peak_bytes / 2**30:.1f} GiB at micro-batch "
                             f"{self.micro} × {t.seq_len}, over {P.HEADROOM:.0%} of this GPU's "
                             f"{total / 2**30:.1f} GiB; try {hint} (python -m train.plan shows the table)")

    def _check_same_model(self, ckpt: Path) -> None:
        saved = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
        diffs = [f"{k}: {getattr(saved, k)!r} in the checkpoint → {getattr(self.mcfg, k)!r} now"
                 for k in self.mcfg.to_dict() if getattr(saved, k) != getattr(self.mcfg, k)]
        if diffs:
            raise CheckpointError(f"the model config differs from {ckpt}: " + "; ".join(diffs))

    def _refuse_existing_run(self) -> None:
        """TrainError when runs/NAME already holds a checkpoint and this is not a --resume (checked before the data
        is prepared, so the refusal is immediate)."""
        if not self.dist.is_main:
            return
        existing = None
        if self.ckpt_root.is_dir():
            try:
                existing = find_checkpoint(self.run_dir)
            except CheckpointError:
                existing = None
        if existing is not None and not self.resume:
            state = json.loads((existing / "trainer_state.json").read_text())
            raise TrainError(
                f"{self.run_dir} already holds a run (checkpoint at step {state['step']}). Pass --resume to continue "
                f"it, --name NEW for a new run, or delete {self.run_dir}.")

    def _write_run_dir(self) -> None:
        """Create runs/NAME with its config.toml — only once the data is prepared, so that bad input (a missing
        data path, a corpus without a configured language) leaves no run folder behind."""
        if not self.dist.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.toml", to_toml(self.cfg))

    def _resume(self) -> None:
        try:
            ckpt = find_checkpoint(self.run_dir)
        except CheckpointError as e:
            raise TrainError(f"--resume: {e}") from None
        try:
            self._check_same_model(ckpt)
        except CheckpointError as e:
            raise TrainError(f"--resume refused: {e}. Start a new run with --name, or --init-from {ckpt} to "
                             f"fine-tune from its weights.") from None
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if state.get("tokenizer_sha256") and state["tokenizer_sha256"] != self.prepared.index["tokenizer_sha256"]:
            raise TrainError(f"--resume refused: the tokenizer differs from the one {ckpt} was trained with")
        was = state.get("scheduler", {}).get("optimizer", "adamw")  # checkpoints before train.optimizer: AdamW
        if was != self.cfg.train.optimizer:
            raise TrainError(f"--resume refused: {ckpt} was trained with train.optimizer = {was!r}, the config says "
                             f"{self.cfg.train.optimizer!r}. Resume with --set train.optimizer={was}, or start a new "
                             f"run with --init-from {ckpt} (its weights, a fresh optimizer).")
        load_weights(self.model, ckpt / "model.safetensors")
        opt_state = torch.load(ckpt / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt_state)
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.nonfinite = int(state.get("nonfinite", 0))
        self.wall_before = float(state.get("wall_s", 0.0))
        self.loader.set_position(state["data_position"])
        set_rng_state(state["rng"])
        if state.get("config_sha256") != self.cfg.sha256():
            self.log("note: the config differs from the checkpoint's in keys that do not change the model "
                     "(the schedule or eval settings, say); continuing with the new values")
        self.last_ckpt = ckpt
        self.at_init = False
        if self.dist.is_main:
            rows = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if r.get("step", 0) <= self.step]
            atomic_write_text(self.run_dir / "metrics.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                                      for r in rows))
        self.log(f"resumed from {ckpt} at step {self.step} ({self.tokens:,} tokens)")

    # --------------------------------------------------------------------------------------- preflight
    def preflight(self) -> bool:
        """Run preflight (setting up first when needed), write ``preflight.json``; True when every check passed."""
        if self.model is None:
            self.setup()
            if self.dist.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
        t = self.cfg.train
        small_len = min(t.seq_len, 64)
        windows = self.loader.peek_windows(max(t.micro_batch_size, 2))
        batch = torch.from_numpy(windows[:2, :small_len + 1].copy()).to(self.device)
        # On CUDA the throughput check (eager, on a deep copy) gets one window, not the micro-batch: eager at the
        # full micro-batch beside the live model can run out of memory; the training loop measures the real figure.
        n_big = 1 if self.device.type == "cuda" else self.micro
        big = torch.from_numpy(windows[:n_big].copy()).to(self.device)
        report = run_preflight(
            self.model, batch, big_batch=big, device=self.device, dtype=self.dtype, vocab_size=self.vocab_size,
            optimizer_factory=lambda m: build_optimizer_for(m, t, self.device.type),
            model_config=self.mcfg, lr=t.lr, at_init=self.at_init, seed=self.cfg.run.seed, log=self.log)
        if self.dist.is_main:
            atomic_write_json(self.run_dir / "preflight.json", report.to_dict())
            self.log(report.table())
        return D.any_rank(not report.ok, self.dist, self.device) is False

    # --------------------------------------------------------------------------------------- the loop
    def _build_train_model(self) -> torch.nn.Module:
        """The module a training step calls: :class:`CausalLMLoss` over the model, compiled as ``train.compile``
        says and warmed up at the training micro-batch, wrapped in DDP under torchrun."""
        mode = self.cfg.train.compile
        step_model = self._loss_module()
        info = self.compile_info
        if mode is False:
            info.path, info.reason = "eager", "train.compile = false"
        else:
            counters = torch._dynamo.utils.counters["stats"]
            before = counters["unique_graphs"]
            t0 = time.time()
            try:
                step_model.compile_blocks(self.micro)
                self._warm_up(step_model)
                info.path = "compiled"
                info.reason = (f"train.compile = {json.dumps(mode)}: each decoder layer and the head + loss, static "
                               f"shapes, warmed up at micro-batch {self.micro} × {self.cfg.train.seq_len}")
                info.graphs = counters["unique_graphs"] - before
            except Exception as e:  # noqa: BLE001 - any compiler failure: an error (true) or eager, said aloud (auto)
                self.model.zero_grad(set_to_none=True)
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                if mode is True:
                    raise TrainError(f"torch.compile failed ({why}). train.compile = true makes this an error; set "
                                     f"train.compile = \"auto\" to fall back to eager (about half the MFU) or false"
                                     ) from e
                step_model = self._loss_module()
                info.path, info.reason = "eager", f"torch.compile failed, train.compile = \"auto\" fell back: {why}"
                self.log("WARNING: " + "!" * 60)
                self.log(f"WARNING: training EAGERLY: {info.reason}")
                self.log("WARNING: " + "!" * 60)
            info.warmup_s = time.time() - t0
            self._graphs_after_warmup = counters["unique_graphs"]
        self.log(f"training path: {info.path} ({info.reason})")
        if step_model.checkpointed:
            self.log(f"activation checkpointing ({self.cfg.train.activation_checkpoint}): decoder layers "
                     f"{', '.join(map(str, sorted(step_model.checkpointed)))} recompute their forward in the backward")
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415 - only under torchrun

            return DDP(step_model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                       bucket_cap_mb=DDP_BUCKET_MB, broadcast_buffers=False, gradient_as_bucket_view=True,
                       static_graph=self.accum == 1)  # with no_sync accumulation DDP's reducer asserts
        return step_model

    def _loss_module(self) -> CausalLMLoss:
        t = self.cfg.train
        return CausalLMLoss(self.model, activation_checkpoint=t.activation_checkpoint,
                            checkpoint_every=t.activation_checkpoint_every)

    def _step_ctx(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self.ctx)
        stack.enter_context(sdpa_context(self.sdpa[1]))
        return stack

    def _warm_up(self, step_model: CausalLMLoss) -> None:
        """One forward + backward at the training micro-batch (the shapes every step uses), gradients dropped."""
        batch = self._batch_to_device(self.loader.peek_windows(self.micro))
        with self._step_ctx():
            loss = step_model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        self.model.zero_grad(set_to_none=True)

    def _batch_to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _install_signals(self):
        def handler(signum, _frame):
            self.stop_requested = True
            self.log(f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting")

        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return old

    def _append_metrics(self, row: dict) -> None:
        if self.dist.is_main:
            with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()

    def _evaluate(self) -> dict | None:
        if not self.dist.is_main:
            return None
        t0 = time.time()
        val = evaluate(self.model, self.val, self.char_counts, self.device, self.ctx,
                       batch_size=self.cfg.train.micro_batch_size)
        row = {"kind": "eval", "step": self.step, "tokens": self.tokens, "val": val}
        if self.step == 0 and self.at_init:
            row["random_init"] = val
        elif self.step == 0:
            twin = LlamaForCausalLM(self.mcfg).to(self.device)
            row["random_init"] = evaluate(twin, self.val, self.char_counts, self.device, self.ctx,
                                          batch_size=self.cfg.train.micro_batch_size)
            del twin
        self._append_metrics(row)
        samples = greedy_samples(self.model, self.tokenizer, self.eot_id)
        with open(self.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps({"step": self.step, **s}, ensure_ascii=False) + "\n")
        parts = ", ".join(f"{k} {v['nll']:.3f} nats ({v['bpc']:.3f} bpc)" for k, v in val.items())
        self.log(f"eval step {self.step}: {parts} [{time.time() - t0:.1f} s]")
        s0 = next((s for s in samples if s["lang"] == "bn"), None)
        if s0:
            self.log(f"  sample: {s0['prompt']}{s0['text']!r}")
        plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png", title=self.cfg.run.name)
        return row

    def _trainer_state(self) -> dict:
        t = self.cfg.train
        return {
            "step": self.step, "tokens": self.tokens, "data_position": self.loader.position,
            "scheduler": {"kind": f"warmup_{t.schedule}", "optimizer": t.optimizer, "step": self.step, "lr": t.lr,
                          "min_lr": t.min_lr, "warmup_steps": t.warmup_steps, "max_steps": t.max_steps,
                          "current_lr": lr_for(self.step, t)},
            "rng": rng_state(), "config_sha256": self.cfg.sha256(), "model_config": self.mcfg.to_dict(),
            "tokenizer_sha256": self.prepared.index["tokenizer_sha256"], "nonfinite": self.nonfinite,
            "wall_s": self.wall_before + (time.time() - self.t_start), "world_size": self.dist.world_size,
            "torch_version": torch.__version__,
        }

    def _data_summary(self) -> dict:
        idx = self.prepared.index
        return {"sources": idx["sources"], "languages": idx["languages"], "target_mix": idx["target_mix"],
                "token_mix": idx["token_mix"], "tokens_seen": self.tokens, "tokenizer_sha256": idx["tokenizer_sha256"],
                "inputs": [{"path": Path(i["path"]).name, "sha256": i["sha256"], "bytes": i["bytes"]}
                           for i in idx["inputs"]]}

    def save(self, serializer=None) -> Path | None:
        """Checkpoint the current step (rank 0; the others wait)."""
        path = None
        if self.dist.is_main:
            tok_dir = self.prepared.tokenizer_dir
            extra = {
                "tokenizer.json": tok_dir / "tokenizer.json",
                "data_summary.json": json.dumps(self._data_summary(), indent=2, ensure_ascii=False),
            }
            path = save_checkpoint(self.ckpt_root, self.step, self.model, self.optimizer, self._trainer_state(), extra,
                                   self.cfg.train.keep_last, serializer=serializer,
                                   special_ids=(self.eot_id, self.pad_id))
            self.last_ckpt = path
            self.log(f"checkpoint: {path}")
        D.barrier(self.dist)
        return path

    def train(self) -> dict:
        """Run to ``train.max_steps`` (or a stop signal); returns the summary dict."""
        cfg, t = self.cfg, self.cfg.train
        self._refuse_existing_run()
        self.setup()
        self._write_run_dir()
        self.t_start = time.time()
        if self.resume:
            self._resume()
        if self.use_preflight and t.max_steps > self.step:
            if not self.preflight():
                raise PreflightFailed(f"preflight failed; the run did not start. See {self.run_dir / 'preflight.json'}")
        elif not self.use_preflight:
            self.log("preflight: skipped (--no-preflight or train.preflight=false)")
        n = self.model.num_params()
        self.log(f"model: {n:,} parameters ({self.model.num_params(non_embedding=True):,} without the embedding), "
                 f"vocab {self.vocab_size:,}; device {self.device}, {str(self.dtype).replace('torch.', '')}; "
                 f"{self.micro}×{t.seq_len} tokens × {self.accum} accum × {self.dist.world_size} ranks per step")
        gc.collect()  # preflight's copies
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(self.device)
        train_model = self._build_train_model() if t.max_steps > self.step else None
        old_handlers = self._install_signals()
        if self.step == 0 and t.max_steps > 0:
            self._evaluate()
        start_step = self.step
        bar = tqdm(total=t.max_steps, initial=self.step, desc=cfg.run.name, unit="step", dynamic_ncols=True,
                   disable=not self.dist.is_main, mininterval=1.0)
        window_t0, window_tokens = time.time(), 0
        last_tps = last_mfu = None
        try:
            while self.step < t.max_steps:
                if self.stop_requested and not self.dist.enabled:
                    break
                stats = self._train_step(train_model)
                window_tokens += stats.tokens
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    dt = max(time.time() - window_t0, 1e-9)
                    last_tps = window_tokens / dt
                    last_mfu = self.flops_per_token * last_tps / self.peak if self.peak else None
                    row = {"kind": "train", "step": self.step, "tokens": self.tokens, "loss": stats.loss,
                           "lr": stats.lr, "grad_norm": stats.grad_norm, "tokens_per_s": last_tps,
                           "mfu": last_mfu, "elapsed_s": self.wall_before + time.time() - self.t_start}
                    self._append_metrics(row)
                    post = {"loss": f"{stats.loss:.3f}", "tok/s": f"{last_tps:,.0f}"}
                    if last_mfu is not None:
                        post["mfu"] = f"{last_mfu:.1%}"
                    bar.set_postfix(post, refresh=False)
                    window_t0, window_tokens = time.time(), 0
                bar.update(1)
                if self.step % t.eval_every == 0 or self.step == t.max_steps:
                    self._evaluate()
                    D.barrier(self.dist)
                    window_t0 = time.time()
                if self.step % t.ckpt_every == 0 and self.step < t.max_steps:
                    if self.nonfinite:
                        self.log(f"step {self.step}: checkpoint skipped during a non-finite streak "
                                 f"(the last good one stays {self.last_ckpt})")
                    else:
                        self.save()
                    window_t0 = time.time()
                if stats.stop:
                    break
        finally:
            bar.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
        if self.stop_requested or self.step == t.max_steps or self.step == start_step:
            if self.last_ckpt is None or self.last_ckpt.name != f"step-{self.step:06d}":
                self.save()
        if self.compile_info.path == "compiled":
            self.compile_info.recompiles = (torch._dynamo.utils.counters["stats"]["unique_graphs"]
                                            - self._graphs_after_warmup)
            self.log(f"torch.compile: {self.compile_info.graphs} graph(s) at warm-up "
                     f"({self.compile_info.warmup_s:.1f} s), {self.compile_info.recompiles} recompile(s) after")
        summary = self._summary(last_tps, last_mfu)
        if self.stop_requested:
            self.log(f"stopped by signal at step {self.step}; resume with: python -m train.run --name "
                     f"{cfg.run.name} --resume")
        return summary

    def _train_step(self, train_model) -> StepStats:
        """One optimizer step over ``micro × accum`` windows per rank; returns its :class:`StepStats`. The loss sum
        and the stop flag travel in one all-reduce (no extra collective or host sync at the top of a step)."""
        t = self.cfg.train
        lr = lr_for(self.step, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        windows = self.loader.next_windows(self.micro * self.accum * self.dist.world_size)
        total_tokens = int((windows[:, 1:] != -100).sum())
        micro_batches = step_batches(windows, self.micro, self.accum, self.dist.rank)
        scale = self.dist.world_size / max(total_tokens, 1)
        loss_sum = torch.zeros((), device=self.device)
        for k, mb in enumerate(micro_batches):
            batch = self._batch_to_device(mb)
            sync = (k == len(micro_batches) - 1) or not self.dist.enabled
            with contextlib.nullcontext() if sync else train_model.no_sync():
                with self._step_ctx():
                    loss = train_model(batch[:, :-1], batch[:, 1:])
                (loss * scale).backward()
            loss_sum += loss.detach().float()
        if self.dist.enabled:
            packed = torch.stack([loss_sum, torch.tensor(float(self.stop_requested), device=self.device)])
            D.all_reduce_sum(packed, self.dist)
            loss_sum, stop = packed[0], bool(packed[1] > 0)
        else:
            stop = self.stop_requested
        mean_loss = float(loss_sum) / max(total_tokens, 1)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip))
        skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
        if not skipped:
            self.optimizer.step()
            self.nonfinite = 0
        else:
            self.nonfinite += 1
            self.log(f"step {self.step + 1}: non-finite {'loss' if not math.isfinite(mean_loss) else 'gradient'} "
                     f"({mean_loss}, grad norm {grad_norm}); step skipped ({self.nonfinite} in a row)")
            if self.nonfinite >= t.max_nonfinite:
                self.optimizer.zero_grad(set_to_none=True)
                where = self.last_ckpt or "none was written yet"
                raise NonFiniteStop(f"{self.nonfinite} non-finite steps in a row (train.max_nonfinite = "
                                    f"{t.max_nonfinite}); stopping at step {self.step + 1}. The last good checkpoint "
                                    f"is {where}. Lower train.lr, check the data, or run python -m train.preflight.")
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += total_tokens
        return StepStats(loss=mean_loss, grad_norm=grad_norm, lr=lr, tokens=total_tokens, skipped=skipped, stop=stop)

    def _summary(self, tps, mfu) -> dict:
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        evals = [r for r in rows if r.get("kind") == "eval"]
        ri = next((r["random_init"] for r in evals if "random_init" in r), None)
        wall = self.wall_before + time.time() - self.t_start
        trains = [r for r in rows if r.get("kind") == "train"]
        summary = {
            "name": self.cfg.run.name, "params": self.model.num_params(), "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""), "steps": self.step, "tokens": self.tokens,
            "wall_s": wall,
            "tokens_per_s": (sum(r["tokens_per_s"] for r in trains[-20:]) / len(trains[-20:])) if trains else tps,
            "mfu": mfu, "val": evals[-1]["val"] if evals else None, "random_init": ri,
            "checkpoint": str(self.last_ckpt) if self.last_ckpt else None, "world_size": self.dist.world_size,
            "peak_memory_gb": peak_memory_bytes(self.device) / 1e9,
            "peak_memory_scope": "training steps only (reset after preflight and setup)",
            "compile": dataclasses.asdict(self.compile_info),
            "attention_backend": {"name": self.sdpa[0], "detail": self.sdpa[2]},
            "plan": self.plan.to_dict() if self.plan else None,
        }
        if self.dist.is_main:
            atomic_write_json(self.run_dir / "summary.json", summary)
            plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png", title=self.cfg.run.name)
            if summary["val"] and ri:
                self.log("val NLL vs the random-init twin: " + ", ".join(
                    f"{k} {v['nll']:.3f} vs {ri[k]['nll']:.3f}" for k, v in summary["val"].items() if k in ri))
            self.log(f"done: {self.step} steps, {self.tokens:,} tokens in {wall / 60:.1f} min → {self.run_dir}")
        return summary


def _already_done(cfg: Config) -> bool:
    """True when runs/NAME holds a finished run of the same config (re-running the README is then a no-op)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    s, c = run_dir / "summary.json", run_dir / "config.toml"
    if not (s.is_file() and c.is_file()):
        return False
    try:
        summary = json.loads(s.read_text())
    except json.JSONDecodeError:
        return False
    return c.read_text() == to_toml(cfg) and summary.get("steps") == cfg.train.max_steps and bool(summary.get("checkpoint")) \
        and Path(summary["checkpoint"]).is_dir()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m train.run``."""
    p = argparse.ArgumentParser(prog="python -m train.run", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_config_args(p)
    p.add_argument("--name", default=None, help="run name: the folder runs/NAME (default: the config's name)")
    p.add_argument("--resume", action="store_true", help="continue runs/NAME exactly from its latest checkpoint")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from a checkpoint's weights with a fresh optimizer (fine-tuning)")
    p.add_argument("--no-preflight", action="store_true", help="skip preflight (not recommended)")
    args = p.parse_args(argv)
    if args.resume and args.init_from:
        print("error: --resume and --init-from exclude each other", file=sys.stderr)
        return 2
    trainer = None
    try:
        trainer = Trainer.from_args(args)
        if not args.resume and _already_done(trainer.cfg):
            print(f"{trainer.run_dir} is already trained to step {trainer.cfg.train.max_steps} with this config; "
                  f"nothing to do (use --name for a new run)", file=sys.stderr)
            return 0
        trainer.train()
    except TrainError as e:  # PreflightFailed and NonFiniteStop exit 1, the rest 2 (train/errors.py)
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if trainer is not None:
            D.shutdown(trainer.dist)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CompileInfo", "StepStats", "Trainer", "TrainError", "main", "model_config_for"]
