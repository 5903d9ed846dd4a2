"""The module a training step calls: :class:`train.model.CausalLMLoss` over the model, compiled as ``train.compile``
says (each decoder layer and the head + loss, static shapes, warmed up at the training micro-batch; "head": the head
+ loss alone; "auto" and "head" fall back to eager aloud) or eager, with the causal attention ``train.attention``
names, wrapped in DistributedDataParallel under torchrun; and :class:`CompileInfo`, the record of which path ran
(summary.json's ``compile``).

``train.attention = "auto"`` takes :func:`train.model.blocked_causal_attention` where it pays: on CPU, in reduced
precision, with the decoder layers compiled (eager it is no faster than SDPA's CPU kernel; on CUDA SDPA's fused
kernels win), and only when it agrees with float32 math (:func:`train.device.attention_error`, at unit-variance q, k
and at 4× that) within :data:`train.device.SDPA_TOL` (the bar SDPA's backends pass on CUDA) or within
:data:`BLOCKED_SLACK` × the error of the SDPA kernel it replaces (on a CPU SDPA's own bfloat16 kernel misses that bar:
about 3e-2 at unit variance, 1e-1 at 4×). Elsewhere, and when compiling falls back to eager, SDPA."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from train import windows as W
from train.components.placement import Placement
from train.config import TrainSection
from train.device import SDPA_TOL, attention_error
from train.errors import TrainError
from train.model import CHUNK_TOKENS, CausalLMLoss, LlamaForCausalLM, blocked_causal_attention


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


CHECK_QK_STD = (1.0, 4.0)  # q, k scales of "auto"'s numerics check: unit variance, and a trained model's peaked logits
BLOCKED_SLACK = 1.25  # the blocked kernel may miss float32 math by up to this times SDPA's own error (or SDPA_TOL)
DDP_BUCKET_MB = 100  # fewer, larger all-reduces than DDP's 25 MB default (base-400m: 16 buckets, not 64)


def no_buffer_sync() -> dict[str, bool]:
    """DistributedDataParallel's keyword for "do not sync buffers before each forward" (the model's only buffers
    are RoPE tables, the same on every rank): ``forward_sync_buffers=False`` where torch has it (2.13 on, which
    deprecates ``broadcast_buffers``), else ``broadcast_buffers=False``."""
    import inspect  # noqa: PLC0415 - only under torchrun

    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    new = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers": False} if new else {"broadcast_buffers": False}


@dataclasses.dataclass
class CompileInfo:
    """Which training path ran: ``path`` "compiled" or "eager", ``reason`` why, the causal ``attention`` kernel
    ("sdpa" or "blocked") and why, the warm-up seconds, and the graphs Dynamo compiled during the warm-up and after
    it (``recompiles``, filled in at the end; 0 expected)."""

    requested: bool | str
    path: str = "eager"
    reason: str = ""
    attention: str = "sdpa"
    attention_reason: str = ""
    warmup_s: float = 0.0
    graphs: int = 0
    recompiles: int | None = None


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class StepModuleBuilder:
    """Builds the step module for ``train`` (the config's ``[train]``) and keeps its :class:`CompileInfo` in
    ``info``."""

    def __init__(self, train: TrainSection):
        self.train = train
        self.info = CompileInfo(requested=train.compile)
        self._graphs_after_warmup = 0

    def loss_module(self, model: LlamaForCausalLM, device_type: str = "cuda", attention: str = "sdpa") -> CausalLMLoss:
        """The eager :class:`CausalLMLoss` with the configured activation checkpointing and ``attention``; on CPU
        without chunking the head + loss (``chunk_tokens=None``: the logits' memory is cheap there, the chunks'
        recompute is not)."""
        return CausalLMLoss(model, chunk_tokens=None if device_type == "cpu" else CHUNK_TOKENS,
                            activation_checkpoint=self.train.activation_checkpoint,
                            checkpoint_every=self.train.activation_checkpoint_every, attention=attention)

    def choose_attention(self, placement: Placement, num_heads: int, head_dim: int,
                         layers_compiled: bool) -> tuple[str, str]:
        """``(kernel, why)`` for ``train.attention`` (see the module doc); "auto" measures
        :func:`~train.device.attention_error` of the blocked kernel (a fraction of a second) only where it would
        take it."""
        asked = self.train.attention
        if asked != "auto":
            return asked, f"train.attention = {json.dumps(asked)}"
        where = (f"{placement.device.type}, {placement.dtype_name}, decoder layers "
                 f"{'compiled' if layers_compiled else 'eager'}")
        if not (placement.device.type == "cpu" and placement.dtype in (torch.bfloat16, torch.float16)
                and layers_compiled):
            return "sdpa", (f"train.attention = \"auto\" on {where} (blocked pays on CPU in reduced precision with "
                            f"the layers compiled)")
        args = (placement.device, placement.dtype, num_heads, head_dim)
        errs = {std: (attention_error(blocked_causal_attention, *args, qk_std=std),
                      attention_error(_sdpa_causal, *args, qk_std=std)) for std in CHECK_QK_STD}
        figures = (f"max |Δ| {' / '.join(f'{b:.2e}' for b, _ in errs.values())} vs float32 math at q, k scale "
                   f"{' / '.join(f'{s:g}' for s in errs)}, SDPA's {' / '.join(f'{e:.2e}' for _, e in errs.values())}")
        if any(b > max(SDPA_TOL, BLOCKED_SLACK * e) for b, e in errs.values()):
            return "sdpa", (f"train.attention = \"auto\": SDPA, the blocked kernel is off its numerics ({figures}; "
                            f"allowed: {BLOCKED_SLACK}× SDPA's or {SDPA_TOL})")
        return "blocked", f"train.attention = \"auto\" on {where}; {figures}"

    def build(self, model: LlamaForCausalLM, placement: Placement, warmup_windows: np.ndarray,
              log: Callable[[str], None]) -> torch.nn.Module:
        """The step module (see the module doc). ``warmup_windows`` int64 ``[micro, seq + 1]``: the batch a compiled
        module is warmed up on (forward + backward, gradients dropped). TrainError when compiling fails and
        ``train.compile`` is true."""
        mode, info = self.train.compile, self.info
        heads, head_dim = model.config.num_attention_heads, model.config.head_dim
        info.attention, info.attention_reason = self.choose_attention(placement, heads, head_dim,
                                                                      mode not in (False, "head"))
        step_model = self.loss_module(model, placement.device.type, info.attention)
        if mode is False:
            info.path, info.reason = "eager", "train.compile = false"
        else:
            before = _unique_graphs()
            t0 = time.time()
            try:
                if mode == "head":
                    step_model.compile_head()
                    what = "the head + loss only (the decoder layers eager)"
                else:
                    step_model.compile_blocks(placement.micro)
                    what = "each decoder layer and the head + loss, static shapes"
                self._warm_up(step_model, placement, warmup_windows)
                info.path = "compiled"
                info.reason = (f"train.compile = {json.dumps(mode)}: {what}, warmed up at micro-batch "
                               f"{placement.micro} × {self.train.seq_len}")
                info.graphs = _unique_graphs() - before
            except Exception as e:  # noqa: BLE001 - any compiler failure: an error (true) or eager, said aloud (auto)
                model.zero_grad(set_to_none=True)
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                if mode is True:
                    raise TrainError(f"torch.compile failed ({why}). train.compile = true makes this an error; set "
                                     f"train.compile = \"auto\" to fall back to eager (about half the MFU) or false"
                                     ) from e
                if self.train.attention == "auto":
                    info.attention, info.attention_reason = self.choose_attention(placement, heads, head_dim, False)
                step_model = self.loss_module(model, placement.device.type, info.attention)
                info.path, info.reason = "eager", f"torch.compile failed, train.compile = {json.dumps(mode)} fell back: {why}"
                log("WARNING: " + "!" * 60)
                log(f"WARNING: training EAGERLY: {info.reason}")
                log("WARNING: " + "!" * 60)
            info.warmup_s = time.time() - t0
            self._graphs_after_warmup = _unique_graphs()
        log(f"training path: {info.path} ({info.reason})")
        log(f"training attention: {info.attention} ({info.attention_reason})")
        if step_model.checkpointed:
            log(f"activation checkpointing ({self.train.activation_checkpoint}): decoder layers "
                f"{', '.join(map(str, sorted(step_model.checkpointed)))} recompute their forward in the backward")
        if placement.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415 - only under torchrun

            d = placement.device
            return DDP(step_model, device_ids=[d.index] if d.type == "cuda" else None,
                       bucket_cap_mb=DDP_BUCKET_MB, **no_buffer_sync(), gradient_as_bucket_view=True,
                       static_graph=placement.accum == 1)  # with no_sync accumulation DDP's reducer asserts
        return step_model

    @staticmethod
    def _warm_up(step_model: CausalLMLoss, placement: Placement, windows: np.ndarray) -> None:
        """One forward + backward at the training micro-batch (the shapes every step uses), gradients dropped."""
        batch = placement.to_device(windows)
        with placement.step_context():
            loss = step_model(W.inputs(batch), W.labels(batch))
        loss.backward()
        step_model.lm.zero_grad(set_to_none=True)

    def count_recompiles(self, log: Callable[[str], None]) -> None:
        """At the end of a compiled run: the graphs compiled after the warm-up into ``info.recompiles``, logged."""
        info = self.info
        if info.path != "compiled":
            return
        info.recompiles = _unique_graphs() - self._graphs_after_warmup
        log(f"torch.compile: {info.graphs} graph(s) at warm-up ({info.warmup_s:.1f} s), {info.recompiles} "
            f"recompile(s) after")
