"""torchrun support: process-group setup and the few collectives the training loop needs.

Under ``torchrun --nproc_per_node N -m train.run …`` the environment carries ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; the process group uses NCCL on CUDA and gloo on CPU. Without them everything is a no-op.

Work that takes long on one rank (data preparation) never sits inside a collective, whose timeout would abort
the job: rank 0 :func:`publish`-es its result in the process group's key-value store and the other ranks
:func:`wait_for` it, polling, with a progress message and their own timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
