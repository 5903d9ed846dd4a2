"""``python -m train.run``: prepare data, run preflight, train, evaluate, checkpoint — resumable exactly.

With no arguments it trains config ``cpu`` (train.config.DEFAULT_PRESET) on ``data/sample`` into ``runs/cpu``. The run directory, the
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
* checkpoints every ``ckpt_every`` steps and at the end (``train.components.checkpoint``), ``--resume`` continues exactly
  (same weights, optimizer, data position, schedule and RNG), a changed model config is refused;
* SIGTERM / SIGINT save a checkpoint and exit 128 + the signal (143, 130); a non-finite loss or gradient skips the step, and
  ``max_nonfinite`` in a row stop the run (exit 1) naming the last good checkpoint;
* under ``torchrun`` DistributedDataParallel (100 MB buckets, gradients as bucket views, no buffer broadcast,
  static graph when there is no gradient accumulation), each rank its slice of every step, rank 0 alone writing; rank 0 prepares the data while the
  others wait on the process group's store (no collective, so no NCCL timeout), or prepare first with
  ``python -m train.data prepare``;
* the log goes to stderr and to ``runs/NAME/train.log``; peak memory is measured from the first training step
  (preflight and setup excluded).

:class:`Trainer` is the loop; the parts it wires, one job each, are in :mod:`train.components`.
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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from contract.cli import HelpFormatter
from train import windows as W
from train.components.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_identity,
    find_checkpoint,
    same_config,
)
from train.components.evaluation import Evaluator
from train.components.placement import Placement, all_reduce_sum, any_rank, barrier, shutdown
from train.components.run_data import RunData
from train.components.run_log import RunLog, Throughput
from train.components.signals import Interrupted, StopRequest, interrupts
from train.components.state import TrainState
from train.components.step_module import CompileInfo, StepModuleBuilder
from train.config import Config, ConfigError, add_config_args, config_from_args
from train.device import device_name, peak_memory_bytes, reset_peak_memory
from train.errors import NonFiniteStop, TrainError
from train.loader import step_batches
from train.model import LlamaForCausalLM, ModelConfig
from train.optim import build_optimizer_for, lr_for
from train.preflight import PreflightFailed, run_preflight


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


def model_config_for(cfg: Config, vocab_size: int) -> ModelConfig:
    """The run's :class:`ModelConfig`: ``[model]`` plus the tokenizer's vocabulary size."""
    return ModelConfig(vocab_size=vocab_size, **dataclasses.asdict(cfg.model))


class SmoothedLoss:
    """The progress bar's loss: an exponential moving average of the per-step losses, debiased for its first steps
    (nanochat's ``smooth_train_loss``; beta 0.9, about the last ten steps). One step's loss swings with what its
    batch holds (in fine-tuning, length-grouped steps of short replies next to long continuations), so the bar shows
    the trend; ``metrics.jsonl`` keeps every step's own loss. Non-finite losses (skipped steps) are left out."""

    def __init__(self, beta: float = 0.9):
        self.beta, self.ema, self.n = beta, 0.0, 0

    def add(self, loss: float) -> None:
        if math.isfinite(loss):
            self.ema = self.beta * self.ema + (1 - self.beta) * loss
            self.n += 1

    @property
    def value(self) -> float:
        """The debiased average (NaN before the first finite loss)."""
        return self.ema / (1 - self.beta ** self.n) if self.n else float("nan")


class Trainer:
    """One training run: ``Trainer(cfg, …).train()``; see the module doc. The loop and its wiring; the parts are
    in :mod:`train.components` (placement, data, state, checkpointer, run log, evaluation, step module, signals).
    ``data``, ``model``, ``optimizer`` and ``evaluator`` exist after :meth:`setup`."""

    def __init__(self, cfg: Config, *, resume: bool = False, init_from: str | None = None, use_preflight: bool = True,
                 log=None):
        self.cfg = cfg
        self.resume = resume
        self.init_from = init_from
        self.use_preflight = use_preflight and cfg.train.preflight
        self.placement = Placement(cfg.train)
        self.run_log = RunLog(Path(cfg.run.out_dir) / cfg.run.name, self.placement.dist.is_main, log)
        self.checkpointer = Checkpointer(cfg, self.run_log.run_dir, self.placement.dist, self.log)
        self.state = TrainState()
        self.stop = StopRequest(self.log)
        self.step_builder = StepModuleBuilder(cfg.train)
        self.data: RunData | None = None
        self.model: LlamaForCausalLM | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.evaluator: Evaluator | None = None

    # read-only views that callers of the loop use (benchmarks/gpu_check.py, benchmarks/recipe.py, main)
    run_dir = property(lambda self: self.run_log.run_dir)
    dist = property(lambda self: self.placement.dist)
    device = property(lambda self: self.placement.device)
    dtype = property(lambda self: self.placement.dtype)
    micro = property(lambda self: self.placement.micro)
    accum = property(lambda self: self.placement.accum)
    sdpa = property(lambda self: self.placement.sdpa)
    plan = property(lambda self: self.placement.plan)
    peak = property(lambda self: self.placement.peak_flops)
    compile_info = property(lambda self: self.step_builder.info)
    step = property(lambda self: self.state.step)

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token of the model at ``train.seq_len`` (0 before :meth:`setup`)."""
        return self.model.flops_per_token(self.cfg.train.seq_len) if self.model is not None else 0.0

    @classmethod
    def from_args(cls, args) -> Trainer:
        if getattr(args, "name", None) is not None:  # checked with the config's rule for run.name
            args.overrides = [*args.overrides, f"run.name={json.dumps(args.name)}"]
        try:
            cfg = config_from_args(args)
        except ConfigError as e:
            raise TrainError(str(e)) from None
        return cls(cfg, resume=getattr(args, "resume", False), init_from=getattr(args, "init_from", None),
                   use_preflight=not getattr(args, "no_preflight", False))

    def log(self, msg: str) -> None:
        """Rank 0: to the ``log`` callback (or stderr) and, once runs/NAME exists, to runs/NAME/train.log."""
        self.run_log.log(msg)

    # --------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Prepare the data, seed every RNG, place the run, build the model (``--init-from`` weights) and the
        optimizer. Raises TrainError on bad input."""
        cfg = self.cfg
        self.data = self.load_data()
        mcfg = model_config_for(cfg, self.data.vocab_size)
        torch.manual_seed(cfg.run.seed)
        np.random.seed(cfg.run.seed % 2**32)
        random.seed(cfg.run.seed)
        self.placement.setup(cfg, mcfg, self.log)
        self.model = LlamaForCausalLM(mcfg).to(self.placement.device)
        self.state.at_init = True
        self.init_weights()
        self.optimizer = build_optimizer_for(self.model, cfg.train, self.placement.device.type)
        self.evaluator = self.make_evaluator()

    # the parts a configuration of the loop replaces (train.sft: conversations, a pretrained start, chat samples)
    def load_data(self) -> RunData:
        """The run's data (:class:`RunData`: prepared shards and tokenizer). Raises TrainError on bad input."""
        return RunData.load(self.cfg, self.placement.dist, self.log)

    def init_source(self) -> dict | None:
        """The identity of the checkpoint this run starts from (``--init-from``'s; None from random weights), which
        ``runs/NAME/init.json`` records: the same command with another start is another run. Found once (finding it
        verifies the checkpoint's sha256 sums) and kept."""
        if not hasattr(self, "_init_source"):
            self._init_source = self._find_init_source()
        return self._init_source

    def _find_init_source(self) -> dict | None:
        return checkpoint_identity(self.init_from) if self.init_from else None

    def init_weights(self) -> None:
        """Weights beyond the random initialisation: ``--init-from``'s (clears ``state.at_init``)."""
        if self.init_from and not self.resume:  # resuming loads the run's own checkpoint instead
            src = self.checkpointer.load_init(self.init_from, self.model)
            self.state.at_init = False
            self.log(f"init-from: loaded weights of {src} (fresh optimizer, step 0)")

    def make_evaluator(self) -> Evaluator:
        """The periodic and final evaluation."""
        return Evaluator(self.data, self.placement, self.cfg.train.micro_batch_size, self.run_log, self.cfg.run.name)

    def preflight_batches(self) -> tuple[np.ndarray, np.ndarray]:
        """(small, big) windows for preflight: two windows of at most 64 targets, and a training micro-batch (one
        window on CUDA: the throughput check runs eagerly on a copy beside the live model, and at the full
        micro-batch that can run out of memory; the training loop measures the real figure)."""
        t, p = self.cfg.train, self.placement
        windows = self.data.loader.peek_windows(max(t.micro_batch_size, 2))
        n_big = 1 if p.device.type == "cuda" else p.micro
        return windows[:2, :min(t.seq_len, 64) + 1].copy(), windows[:n_big].copy()

    def start(self) -> None:
        """Everything before the first step: lock runs/NAME, refuse an existing run (unless resuming), set up, write runs/NAME,
        resume, preflight (PreflightFailed when a check fails), and start the peak-memory measurement."""
        t = self.cfg.train
        self.run_log.lock()
        self.checkpointer.refuse_existing_run(self.resume, self.init_source())
        self.setup()
        self.run_log.create(self.cfg, fresh=not self.resume, init=self.init_source())
        self.state.t_start = time.time()
        resumed_dtype = None
        if self.resume:
            ckpt = self.checkpointer.resume(self.model, self.optimizer, self.data, self.state, self.placement.device)
            self.run_log.truncate_metrics(self.state.step)
            self.log(f"resumed from {ckpt} at step {self.state.step} ({self.state.tokens:,} tokens)")
            resumed_dtype = self.state.dtype or None
        p = self.placement
        if resumed_dtype is not None:
            p.decide_auto(None, None, self.log, resumed_dtype=resumed_dtype)
        if self.use_preflight and t.max_steps > self.state.step:
            if not self.preflight():
                raise PreflightFailed(f"preflight failed; the run did not start. See {self.run_dir / 'preflight.json'}")
        elif not self.use_preflight:
            self.log("preflight: skipped (--no-preflight or train.preflight=false)")
        p.decide_auto(None, None, self.log)  # auto not settled by preflight: float32 (said in the log)
        self.state.dtype = p.dtype_name
        self.log(f"model: {self.model.num_params():,} parameters ({self.model.num_params(non_embedding=True):,} "
                 f"without the embedding), vocab {self.data.vocab_size:,}; device {p.device} ({device_name(p.device)}), "
                 f"{p.dtype_name}; {p.micro}×{t.seq_len} tokens × {p.accum} accum × {p.dist.world_size} ranks per step")
        gc.collect()  # preflight's copies
        if p.device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(p.device)

    # --------------------------------------------------------------------------------------- preflight
    def preflight(self) -> bool:
        """Run preflight (setting up first when needed), write ``preflight.json``; True when every check passed."""
        if self.model is None:
            self.setup()
            self.run_log.ensure_dir()
        t, p = self.cfg.train, self.placement
        small, big = self.preflight_batches()
        batch, big = torch.from_numpy(small).to(p.device), torch.from_numpy(big).to(p.device)
        report = run_preflight(
            self.model, batch, big_batch=big, device=p.device, dtype=p.dtype, vocab_size=self.data.vocab_size,
            optimizer_factory=lambda m: build_optimizer_for(m, t, p.device.type),
            model_config=self.model.config, lr=t.lr, at_init=self.state.at_init, seed=self.cfg.run.seed,
            compare_dtype=p.auto_candidate, log=self.log)
        self.run_log.write_preflight(report)
        if p.auto_candidate is not None and report.ok:
            checks = {c.name: c for c in report.checks}
            gain = checks["throughput"].values.get("bfloat16_gain") if "throughput" in checks else None
            p.decide_auto(checks["precision"].ok if "precision" in checks else None, gain, self.log)
        return any_rank(not report.ok, p.dist, p.device) is False

    # --------------------------------------------------------------------------------------- the loop
    def save(self, serializer=None) -> Path | None:
        """Checkpoint the current step (rank 0; the others wait)."""
        return self.checkpointer.save(self.state, self.model, self.optimizer, self.data, serializer=serializer)

    def train(self) -> dict:
        """Run to ``train.max_steps`` (or a stop signal); returns the summary dict. runs/NAME is locked meanwhile
        (:meth:`RunLog.lock`: TrainError when another process trains into it)."""
        try:
            return self._train()
        finally:
            self.run_log.unlock()

    def _train(self) -> dict:
        t = self.cfg.train
        self.start()
        train_model = None
        if t.max_steps > self.state.step:
            windows = self.data.loader.peek_windows(self.placement.micro)
            train_model = self.step_builder.build(self.model, self.placement, windows, self.log)
        with self.stop.installed():
            evaluated = any(r.get("kind") == "eval" and r.get("step") == 0 for r in self.run_log.metrics())
            if self.state.step == 0 and t.max_steps > 0 and not evaluated:  # not again when continuing from step 0
                self.evaluator(self.model, self.state)
            start_step = self.state.step
            meter = self._loop(train_model)
        step = self.state.step
        if (self.stop.requested or step == t.max_steps or step == start_step) and not self.checkpointer.holds(step):
            self.save()
        self.step_builder.count_recompiles(self.log)
        final = None
        if t.final_eval and step == t.max_steps and (step > start_step or self.run_log.read_summary().get("steps") != step):
            # also when a session stopped during it: the checkpoint at max_steps is there, its summary is not
            final = self.evaluator.final(self.model, self.cfg, self.state)
        summary = self._summary(meter, final, trained=step > start_step)
        if self.stopped_early:
            self.log(f"stopped by signal at step {step} of {t.max_steps} (checkpoint saved); the same command again "
                     f"continues it")
        return summary

    @property
    def stopped_early(self) -> bool:
        """True when a stop signal ended the run before ``train.max_steps`` (the CLI then exits 128 + the signal)."""
        return self.stop.requested and self.state.step < self.cfg.train.max_steps

    def _loop(self, train_model) -> Throughput:
        """Steps until ``train.max_steps``, a stop request or a non-finite stop; logs, evaluates and checkpoints on
        the configured steps. Returns the throughput meter (its latest figures go to the summary)."""
        t, state = self.cfg.train, self.state
        meter = Throughput(self.flops_per_token, self.placement.peak_flops)
        bar = tqdm(total=t.max_steps, initial=state.step, desc=self.cfg.run.name, unit="step", dynamic_ncols=True,
                   disable=not self.dist.is_main, mininterval=1.0)
        smooth = SmoothedLoss()
        try:
            while state.step < t.max_steps:
                if self.stop.requested and not self.dist.enabled:
                    break
                stats = self._train_step(train_model)
                meter.add(stats.tokens)
                smooth.add(stats.loss)
                if state.step % t.log_every == 0 or state.step == t.max_steps:
                    tps, mfu = meter.measure()
                    self.run_log.append_metrics({
                        "kind": "train", "step": state.step, "tokens": state.tokens, "loss": stats.loss,
                        "lr": stats.lr, "grad_norm": stats.grad_norm, "tokens_per_s": tps, "mfu": mfu,
                        "elapsed_s": state.elapsed()})
                    post = {"loss": f"{smooth.value:.3f}", "tok/s": f"{tps:,.0f}"}
                    if mfu is not None:
                        post["mfu"] = f"{mfu:.1%}"
                    bar.set_postfix(post, refresh=False)
                bar.update(1)
                if state.step % t.eval_every == 0 or state.step == t.max_steps:
                    self.evaluator(self.model, state)
                    barrier(self.dist)
                    meter.exclude_pause()
                if state.step % t.ckpt_every == 0 and state.step < t.max_steps:
                    if state.nonfinite:
                        self.log(f"step {state.step}: checkpoint skipped during a non-finite streak "
                                 f"(the last good one stays {self.checkpointer.last})")
                    else:
                        self.save()
                    meter.exclude_pause()
                if stats.stop:
                    self.stop.agree()
                    break
        finally:
            bar.close()
        return meter

    def _train_step(self, train_model) -> StepStats:
        """One optimizer step over ``micro × accum`` windows per rank; returns its :class:`StepStats`. The loss sum
        and the stop flag travel in one all-reduce (no extra collective or host sync at the top of a step)."""
        t, state, p = self.cfg.train, self.state, self.placement
        lr = lr_for(state.step, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        windows = self.data.loader.next_windows(p.micro * p.accum * p.dist.world_size)
        total_tokens = W.target_count(windows)
        micro_batches = step_batches(windows, p.micro, p.accum, p.dist.rank)
        scale = p.dist.world_size / max(total_tokens, 1)
        loss_sum = torch.zeros((), device=p.device)
        for k, mb in enumerate(micro_batches):
            batch = p.to_device(mb)
            sync = (k == len(micro_batches) - 1) or not p.dist.enabled
            with contextlib.nullcontext() if sync else train_model.no_sync():
                with p.step_context():
                    loss = train_model(W.inputs(batch), W.labels(batch))
                (loss * scale).backward()
            loss_sum += loss.detach().float()
        if p.dist.enabled:
            packed = torch.stack([loss_sum, torch.tensor(float(self.stop.requested), device=p.device)])
            all_reduce_sum(packed, p.dist)
            loss_sum, stop = packed[0], bool(packed[1] > 0)
        else:
            stop = self.stop.requested
        mean_loss = float(loss_sum) / max(total_tokens, 1)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip))
        skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
        if not skipped:
            self.optimizer.step()
            state.nonfinite = 0
        else:
            state.nonfinite += 1
            self.log(f"step {state.step + 1}: non-finite {'loss' if not math.isfinite(mean_loss) else 'gradient'} "
                     f"({mean_loss}, grad norm {grad_norm}); step skipped ({state.nonfinite} in a row)")
            if state.nonfinite >= t.max_nonfinite:
                self.optimizer.zero_grad(set_to_none=True)
                where = self.checkpointer.last or "none was written yet"
                raise NonFiniteStop(f"{state.nonfinite} non-finite steps in a row (train.max_nonfinite = "
                                    f"{t.max_nonfinite}); stopping at step {state.step + 1}. The last good checkpoint "
                                    f"is {where}. Lower train.lr, check the data, or run python -m train.preflight.")
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += total_tokens
        return StepStats(loss=mean_loss, grad_norm=grad_norm, lr=lr, tokens=total_tokens, skipped=skipped, stop=stop)

    def _summary(self, meter: Throughput, final: dict | None = None, trained: bool = True) -> dict:
        """summary.json (docs/design.md), written with the final loss.png by rank 0; returned on every rank. A
        session that trained no step (``--resume`` of a finished run) keeps what the last training session recorded
        of itself (:data:`SESSION_KEYS`) and its final report, instead of this session's empty ones."""
        rows = self.run_log.metrics()
        evals = [r for r in rows if r.get("kind") == "eval"]
        trains = [r for r in rows if r.get("kind") == "train"][-20:]
        p, last = self.placement, self.checkpointer.last
        summary = {
            "name": self.cfg.run.name, "params": self.model.num_params(), "device": str(p.device),
            "device_name": device_name(p.device), "dtype": p.dtype_name, "steps": self.state.step, "tokens": self.state.tokens,
            "wall_s": self.state.elapsed(),
            "tokens_per_s": (sum(r["tokens_per_s"] for r in trains) / len(trains)) if trains else meter.tokens_per_s,
            "mfu": meter.mfu, "val": evals[-1]["val"] if evals else None,
            "random_init": next((r["random_init"] for r in evals if "random_init" in r), None),
            "checkpoint": str(last) if last else None, "world_size": p.dist.world_size,
            "peak_memory_gb": peak_memory_bytes(p.device) / 1e9,
            "peak_memory_scope": "training steps only (reset after preflight and setup)",
            "compile": dataclasses.asdict(self.compile_info),
            "attention_backend": ({"name": "blocked", "detail": self.compile_info.attention_reason}
                                  if self.compile_info.attention == "blocked" else
                                  {"name": p.sdpa[0], "detail": p.sdpa[2]}),
            "plan": p.plan.to_dict() if p.plan else None,
        }
        if final:
            summary.update(final)
        if not trained:
            previous = self.run_log.read_summary()
            summary.update({k: previous[k] for k in (*SESSION_KEYS, *FINAL_KEYS) if k in previous})
        self.run_log.write_summary(summary, title=self.cfg.run.name, finished=not self.stopped_early)
        return summary


# summary.json keys that describe the session that trained (its speed, memory and compiled path), and the final
# report's (Evaluator.final): a session that trains no step keeps them from the summary before it
SESSION_KEYS = ("tokens_per_s", "mfu", "peak_memory_gb", "peak_memory_scope", "compile", "attention_backend", "plan")
FINAL_KEYS = ("val_sources", "compression_floor", "samples")


def _already_done(cfg: Config, init: dict | None = None) -> bool:
    """True when runs/NAME holds a finished run of the same config and start (``init``: :meth:`Trainer.init_source`);
    re-running the README is then a no-op."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    s = run_dir / "summary.json"
    if not (s.is_file() and same_config(run_dir, cfg, init)):
        return False
    try:
        summary = json.loads(s.read_text())
    except json.JSONDecodeError:
        return False
    return summary.get("steps") == cfg.train.max_steps and bool(summary.get("checkpoint")) \
        and Path(summary["checkpoint"]).is_dir()


def _unfinished_step(cfg: Config, init: dict | None = None) -> int | None:
    """The step of the newest intact checkpoint when runs/NAME holds an unfinished run of the same config (stopped
    by a signal, killed, or its machine lost; at ``train.max_steps`` too when its summary was never written, i.e.
    it stopped during the final evaluation): re-running the same command continues it, as ``--resume`` would;
    None otherwise (no run there, a finished one, or a run of another config, which
    :meth:`Checkpointer.refuse_existing_run` refuses)."""
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    if not same_config(run_dir, cfg, init):
        return None
    try:
        ckpt = find_checkpoint(run_dir, warn=False)
        step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(step, int) or step > cfg.train.max_steps:
        return None
    return step if step < cfg.train.max_steps or not _already_done(cfg, init) else None


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
    return run_trainer(lambda: Trainer.from_args(args), args.resume)


def run_trainer(make: Callable[[], Trainer], resume: bool, done: str = "trained") -> int:
    """Make a Trainer with ``make()`` and train it, as a CLI does (``train.run``, ``train.sft``), so that running
    the same command again is safe: a run already finished with the same config is a no-op unless ``resume``, and
    an unfinished one of the same config is continued (``--resume`` implied, said on stderr). A TrainError is one
    line on stderr and its exit code (PreflightFailed and NonFiniteStop 1, the rest 2: train/errors.py); a stop
    signal exits 128 + the signal, after the loop's checkpoint (:class:`StopRequest`) or at once anywhere else
    (:class:`Interrupted`: data preparation, preflight, the final evaluation), in one line; the process group is shut
    down in every case. ``done`` words the no-op message. Returns the exit code."""
    trainer = None
    try:
        with interrupts():
            trainer = make()
            init = trainer.init_source()
            if not resume and _already_done(trainer.cfg, init):
                print(f"{trainer.run_dir} is already {done} to step {trainer.cfg.train.max_steps} with this config; "
                      f"nothing to do (use --name for a new run)", file=sys.stderr)
                return 0
            if not resume and (step := _unfinished_step(trainer.cfg, init)) is not None:
                print(f"{trainer.run_dir} holds an unfinished run of this config (checkpoint at step {step} of "
                      f"{trainer.cfg.train.max_steps}); continuing it (--name NEW starts a new run)", file=sys.stderr)
                trainer.resume = True
            trainer.train()
            if trainer.stopped_early:
                return trainer.stop.exit_code
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (Interrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        where = f"{trainer.run_dir} keeps its newest checkpoint, if any" if trainer is not None else "no run was started"
        print(f"stopped by {signal.Signals(signum).name}; {where}; the same command again continues", file=sys.stderr)
        return 128 + int(signum)
    finally:
        if trainer is not None:
            shutdown(trainer.dist)
    return 0

if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CompileInfo", "SmoothedLoss", "StepStats", "Trainer", "TrainError", "main", "model_config_for", "run_trainer"]
