"""Where and how the training steps run: the device and ranks, the compute dtype (``auto`` on CPU decided after
preflight), each rank's share of the global batch, the CUDA fast paths, the planner's memory check, the SDPA backend
and the autocast context; and torchrun's side of it: process-group setup and the few collectives the training
loop needs.

Under ``torchrun --nproc_per_node N -m train.run …`` the environment carries ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; the process group uses NCCL on CUDA and gloo on CPU. Without them everything is a no-op.

Work that takes long on one rank (data preparation) never sits inside a collective, whose timeout would abort
the job: rank 0 :func:`publish`-es its result in the process group's key-value store and the other ranks
:func:`wait_for` it, polling, with a progress message and their own timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from train import plan as P
from train.config import Config, TrainSection, resolve_path
from train.device import (
    DTYPES,
    auto_cpu_dtype,
    autocast_ctx,
    choose_sdpa_backend,
    native_cpu_bf16,
    peak_flops,
    resolve_device,
    resolve_dtype,
    sdpa_context,
    setup_cpu_allocator,
    setup_cuda_fast_paths,
)
from train.errors import TrainError
from train.model import ModelConfig


def micro_split(train: TrainSection, world_size: int) -> tuple[int, int]:
    """(micro_batch_size, grad_accum) per rank such that the global batch stays as configured: the accumulation
    is divided among the ranks when it can be, else the micro-batch. TrainError when neither divides."""
    if train.grad_accum % world_size == 0:
        return train.micro_batch_size, train.grad_accum // world_size
    if train.micro_batch_size % world_size == 0:
        return train.micro_batch_size // world_size, train.grad_accum
    raise TrainError(f"world size {world_size} divides neither train.grad_accum ({train.grad_accum}) nor "
                     f"train.micro_batch_size ({train.micro_batch_size}): the global batch cannot be kept")


class Placement:
    """The run's device (``cuda:LOCAL_RANK`` under torchrun), process group (:class:`DistInfo`)
    and compute dtype, known from construction; after :meth:`setup`, the per-rank ``micro`` × ``accum``, the
    memory ``plan`` (CUDA), the SDPA choice ``sdpa`` = (name, backend or None, detail), the ``autocast`` context
    and ``peak_flops`` (FLOP/s of a known GPU in this dtype, else None: no MFU).

    ``train.dtype = "auto"`` on a CPU with native bfloat16 (:func:`train.device.native_cpu_bf16`) starts as float32
    with ``auto_candidate`` = bfloat16: preflight measures it beside float32 and :meth:`decide_auto` settles the
    dtype before the first step (float32 stays when preflight is skipped)."""

    def __init__(self, train: TrainSection):
        self.device = resolve_device(train.device)
        self.dist = init_distributed(self.device.type)
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        self.dtype = resolve_dtype(train.dtype, self.device)
        self.bf16_flag = native_cpu_bf16() if train.dtype == "auto" and self.device.type == "cpu" else None
        self.auto_candidate: torch.dtype | None = torch.bfloat16 if self.bf16_flag else None
        self.dtype_reason = ""
        if train.dtype == "auto" and self.device.type == "cpu":
            self.dtype_reason = auto_cpu_dtype(None, None, self.bf16_flag)[1]
        self.settled = False  # decide_auto ran
        self.micro, self.accum = train.micro_batch_size, train.grad_accum
        self.sdpa: tuple[str, object, str] = ("default", None, "")
        self.plan: P.Plan | None = None
        self.autocast = contextlib.nullcontext()
        self.peak_flops: float | None = None

    @property
    def dtype_name(self) -> str:
        """The compute dtype as the logs and summary.json write it ("float32", "bfloat16")."""
        return str(self.dtype).replace("torch.", "")

    def setup(self, cfg: Config, mcfg: ModelConfig, log: Callable[[str], None]) -> None:
        """Before the model is allocated: the micro-batch split, then on CUDA the fast paths, the planner's refusal
        of a micro-batch that cannot fit and the SDPA backend (its numerics check draws from the global RNG, so it
        runs at the same point after seeding every time); on CPU the allocator thresholds. Raises TrainError."""
        self.micro, self.accum = micro_split(cfg.train, self.dist.world_size)
        if self.device.type == "cuda":
            setup_cuda_fast_paths()
            self._check_fits(cfg, mcfg, log)
            self.sdpa = choose_sdpa_backend(self.device, self.dtype, mcfg.num_attention_heads, mcfg.head_dim)
            log(f"attention: SDPA backend {self.sdpa[0]} ({self.sdpa[2]})")
        else:
            setup_cpu_allocator()
        self.peak_flops = peak_flops(self.device, self.dtype)
        self.autocast = autocast_ctx(self.device, self.dtype)

    def decide_auto(self, precision_ok: bool | None, gain: float | None, log: Callable[[str], None],
                    resumed_dtype: str | None = None) -> None:
        """Settle ``train.dtype = "auto"`` on CPU (:func:`train.device.auto_cpu_dtype`) from preflight's precision
        verdict and bfloat16's measured tokens/s gain over float32 (None: not measured), or keep the dtype a resumed
        checkpoint was trained in (``resumed_dtype``, so that ``--resume`` continues exactly). Every rank takes
        float32 when any rank would; the choice and its reason are logged. Only the first call acts, and only for
        ``auto`` on CPU."""
        if self.settled or not self.dtype_reason:  # settled, or not "auto" on CPU
            return
        self.settled = True
        if resumed_dtype in ("float32", "bfloat16"):
            dtype = DTYPES[resumed_dtype]
            reason = f"{resumed_dtype}{' autocast' if resumed_dtype == 'bfloat16' else ''}: as the resumed checkpoint"
        elif self.auto_candidate is None:
            log(f"dtype auto: {self.dtype_reason}")
            return
        else:
            dtype, reason = auto_cpu_dtype(precision_ok, gain, self.bf16_flag)
        if any_rank(dtype == torch.float32, self.dist, self.device) and dtype != torch.float32:
            dtype, reason = torch.float32, "float32: another rank measured no gain from bfloat16"
        self.dtype, self.dtype_reason, self.auto_candidate = dtype, reason, None
        self.autocast = autocast_ctx(self.device, self.dtype)
        log(f"dtype auto: {reason}")

    def _check_fits(self, cfg: Config, mcfg: ModelConfig, log: Callable[[str], None]) -> None:
        """Refuse, before allocating anything on the GPU, a micro-batch the planner says cannot fit its memory
        (the tensors' peak plus the CUDA context and the caching allocator's reserve, against the whole GPU)."""
        t = cfg.train
        target = P.cuda_target(self.device)
        compiled = t.compile is not False
        ac = (t.activation_checkpoint, t.activation_checkpoint_every)
        mm = P.memory_model(mcfg, t.seq_len, self.dtype, cache_dir=resolve_path(cfg.data.cache_dir),
                            optimizer=t.optimizer)
        self.plan = target.plan(mm, self.micro, compiled, *ac)
        g = 2**30
        log(f"plan: {self.plan.summary()} against {target.usable_bytes / g:.1f} GiB on {target.name}")
        if self.plan.process_bytes > target.usable_bytes:
            fit = P.largest_micro_batch(mcfg, t.seq_len, self.dtype, compiled, target, *ac, mm=mm)
            hint = (f"--set train.micro_batch_size={fit} --set train.grad_accum="
                    f"{max(1, t.micro_batch_size * t.grad_accum // fit)}" if fit else "a smaller model")
            raise TrainError(f"the planner estimates a peak of {self.plan.process_bytes / g:.1f} GiB at micro-batch "
                             f"{self.micro} × {t.seq_len}, over this GPU's {target.usable_bytes / g:.1f} GiB; try "
                             f"{hint} (python -m train.plan shows the table)")

    def step_context(self) -> contextlib.ExitStack:
        """The context a training forward runs in: autocast and the chosen SDPA backend."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast)
        stack.enter_context(sdpa_context(self.sdpa[1]))
        return stack

    def to_device(self, windows: np.ndarray) -> torch.Tensor:
        """int64 windows ``[n, seq + 1]`` as a tensor on the device (through pinned memory, asynchronously, on
        CUDA)."""
        t = torch.from_numpy(windows)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); returns this process's place."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return DistInfo(rank=rank, world_size=world, local_rank=local)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor over ranks (in place; returned for chaining)."""
    if info.enabled:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True when ``flag`` is true on any rank (all ranks agree on the answer)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _store():
    # The store torchrun's rendezvous gave the default process group; a TCP key-value store, no collective.
    return dist.distributed_c10d._get_default_store()


def publish(info: DistInfo, key: str, value: dict) -> None:
    """Rank 0: make ``value`` (JSON-able) visible to every rank under ``key`` (no-op without torchrun)."""
    if info.enabled:
        _store().set(f"shalik/{key}", json.dumps(value))


def wait_for(info: DistInfo, key: str, what: str, timeout_s: float, log, poll_s: float = 2.0,
             every_s: float = 60.0) -> dict:
    """Other ranks: poll for ``key`` (set by :func:`publish`) and return its value; log ``what`` every ``every_s``
    seconds while waiting. TimeoutError after ``timeout_s`` seconds, naming ``what``."""
    store, k = _store(), f"shalik/{key}"
    t0 = last = time.monotonic()
    while not store.check([k]):
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise TimeoutError(f"rank {info.rank}: gave up after {timeout_s:.0f} s waiting for rank 0: {what}")
        if now - last >= every_s:
            log(f"rank {info.rank}: still waiting for rank 0 ({now - t0:.0f} s): {what}")
            last = now
        time.sleep(poll_s)
    return json.loads(store.get(k))


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
