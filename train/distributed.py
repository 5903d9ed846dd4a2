"""torchrun support: process-group setup and the few collectives the training loop needs.

Under ``torchrun --nproc_per_node N -m train.run …`` the environment carries ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; the process group uses NCCL on CUDA and gloo on CPU. Without them everything is a no-op.
"""

from __future__ import annotations

import datetime
import os
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


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
