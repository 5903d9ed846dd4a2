"""``python -m train.plan [--config C] [--gpu h100|h200]``: will a config fit, and how fast will it run?

It plans for the device the command runs on (``train.device``: a CUDA GPU if there is one, else this CPU) unless
``--gpu`` names one to plan for (no GPU needed then), and exits 1, naming the planned and the usable GiB, when the
configured micro-batch does not fit. No GPU needed. Memory comes from running the real training step (``train.model.CausalLMLoss``, AdamW) on fake
tensors (``torch._subclasses.FakeTensorMode``) under PyTorch's memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``), as torchtitan's ``estimation.py`` does. Four fake runs
(2 and 3 layers × micro-batch 1 and 2) fix the bilinear law ``peak = a + b·L + c·B + d·L·B`` (parameters and
optimizer state grow with L; activations with L·B; the head and loss with B), which gives the peak for any
number of layers L and micro-batch B in milliseconds. In reduced precision the loss runs in chunks of
``CHUNK_TOKENS`` rows, so its transient stops growing after the first chunk: one more fake step (2 layers, two
chunks' worth of rows) measures the share of ``c`` that does. Reduced precision is traced under CPU autocast, whose op
lists match CUDA's for every op this model runs (the linear layers and SDPA in bf16, the norms' reductions and
the loss in float32).

The fake run is eager. ``compiled=True`` subtracts what Inductor saves by fusing: the activations one decoder
layer saves for the backward beyond its inputs, measured per token under eager autograd and under AOTAutograd's
min-cut partitioner (the one Inductor uses), on a real layer at one short prime sequence length (only the
per-token storages have an element count it divides; the weights' bf16 copies do not grow with tokens).
Activation checkpointing (``train.activation_checkpoint``) frees, for each checkpointed layer, all of that but
its inputs; the top layer's recompute, if it is checkpointed, comes back on top. The fit (seconds of CPU) is
cached under ``data.cache_dir/plan/``, keyed by the model config, sequence length, dtype, torch's version and
this file's and ``train/model.py``'s source.

What the process holds beyond the step's tensors is counted too (``Plan.overhead``), because that is what a user
sees in ``top`` or ``nvidia-smi``:

* on a CPU, the **runtime baseline** — the resident set of a Python process that has imported torch and Shalik's
  training modules (this process's own, measured before any fit: ≈ 0.5 GiB) — and **malloc's reserve**:
  ``train.run`` raises glibc's mmap threshold (``train.device.setup_cpu_allocator``) so the float32 logits-sized
  buffers of the loss ([micro-batch × seq_len × vocab]: the logits, their log-softmax and its gradient) come from
  the heap and are reused, and the heap then keeps about ``CPU_RESERVE_LOGITS`` of them beyond the live peak
  (measured on ``tiny`` and ``small``: 2.4–2.6; ``benchmarks/plan_accuracy.py`` checks the whole estimate against
  the peak resident set of ``python -m train.run``). Usable memory is the machine's ``MemAvailable`` now.
* on a GPU, the **CUDA context** (``CUDA_CONTEXT_BYTES``: driver, kernels loaded lazily, cuBLAS workspace) and the
  **caching allocator's reserve** (``GPU_RESERVE_FRACTION`` of the tensor peak: blocks reserved but not
  allocated, fragmentation). Usable memory is the whole GPU.

Time: FLOPs per token are 6·N_matmul + 12·L·hidden·seq (``LlamaForCausalLM.flops_per_token``, PaLM appendix B);
the step time assumes dense bf16 matmuls at ``ETA_MATMUL`` of the GPU's peak, causal attention (half of the 12·L·h·s
term is real work) at ``ETA_ATTENTION``, the chunked loss's extra lm_head forward, each checkpointed layer's
forward once more, and the activation and optimizer traffic at the HBM bandwidth. MFU = model FLOPs / (step time ×
peak), the PaLM definition (recomputation is not model FLOPs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from contract.atomic import atomic_write_json
from contract.cli import HelpFormatter
from train.config import ConfigError, add_config_args, config_from_args, resolve_path
from train.device import PEAK_FLOPS, autocast_ctx, resolve_device, resolve_dtype
from train.model import (
    CHUNK_TOKENS,
    CausalLMLoss,
    DecoderLayer,
    LlamaForCausalLM,
    ModelConfig,
    RotaryEmbedding,
    checkpointed_layers,
)
from train.optim import MuonAdamW, build_optimizer

CUDA_CONTEXT_BYTES = 600 * 2**20  # the CUDA context, lazily loaded kernels, cuBLAS workspace (outside max_memory_allocated)
GPU_RESERVE_FRACTION = 0.10  # the caching allocator's reserved-but-unallocated share of the tensor peak (and NCCL)
OVERHEAD_HEADS = {"runtime_baseline": "runtime", "malloc_reserve": "malloc", "cuda_context": "CUDA ctx",
                  "allocator_reserve": "allocator"}
CPU_RESERVE_LOGITS = 2.5  # float32 [tokens × vocab] buffers malloc's heap keeps beyond the live peak (measured: 2.4–2.6)
ETA_MATMUL = 0.75  # large bf16 GEMMs reach ≈ 700-750 of H100 SXM's 989 dense TFLOP/s
ETA_ATTENTION = 0.45  # cuDNN / FlashAttention forward + backward at head_dim 64, as a share of the peak


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_flops: float  # dense, no sparsity
    hbm_bytes_per_s: float


GPUS = {  # vendors' datasheets (SXM parts); the peak FLOP/s have one owner, train.device.PEAK_FLOPS
    "h100": GPU("H100 SXM 80GB", 80 * 10**9, dict(PEAK_FLOPS)["H100"][torch.bfloat16], 3.35e12),
    "h200": GPU("H200 SXM 141GB", 141 * 10**9, dict(PEAK_FLOPS)["H200"][torch.bfloat16], 4.8e12),
}


@dataclasses.dataclass
class Plan:
    """One estimate; bytes, FLOPs and seconds."""

    micro_batch_size: int
    seq_len: int
    dtype: str
    compiled: bool
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int
    flops_per_token: float
    activation_checkpoint: str = "none"
    checkpointed_layers: int = 0  # decoder layers whose forward runs again in the backward
    activation_traffic_per_token: float = 0.0  # HBM bytes per token the activations move (written, read back)
    overhead: dict[str, int] = dataclasses.field(default_factory=dict)  # what the process holds beyond the tensors

    @property
    def process_bytes(self) -> int:
        """The process's peak: the tensors' (``peak_bytes``) plus :attr:`overhead`."""
        return self.peak_bytes + sum(self.overhead.values())

    def summary(self) -> str:
        g = 2**30
        extra = "".join(f", {k.replace('_', ' ')} {v / g:.2f}" for k, v in self.overhead.items())
        head = f"process ≈ {self.process_bytes / g:.1f} GiB: " if self.overhead else "peak ≈ "
        return (
            f"micro-batch {self.micro_batch_size} × {self.seq_len}, {self.dtype}, "
            f"{'compiled' if self.compiled else 'eager'}{self._ac()}: {head}tensors {self.peak_bytes / g:.1f} GiB "
            f"(parameters {self.param_bytes / g:.2f}, gradients {self.grad_bytes / g:.2f}, optimizer state "
            f"{self.optimizer_bytes / g:.2f}, activations and the rest {self.activation_bytes / g:.1f}){extra}"
        )

    def _ac(self) -> str:
        if self.activation_checkpoint == "none":
            return ""
        return f", activation checkpointing {self.activation_checkpoint} ({self.checkpointed_layers} layers)"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _fake_peaks(
    cfg: ModelConfig, micros: tuple[int, ...], seq_len: int, dtype: torch.dtype, activation_checkpoint: str = "none",
    checkpoint_every: int = 2, optimizer: str = "adamw",
) -> list[tuple[int, int, int]]:
    """(peak, parameter, optimizer-state) bytes of one training step on fake tensors, optimizer state present, for
    each micro-batch size in ``micros`` (one model and the run's ``optimizer`` — AdamW keeps two moments per
    parameter, Muon one momentum buffer per hidden matrix — a fresh tracker per step)."""
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: PLC0415 - seconds to import; a cache hit skips it

    out = []
    with FakeTensorMode():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        step = CausalLMLoss(model, activation_checkpoint=activation_checkpoint, checkpoint_every=checkpoint_every)
        opt = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95), optimizer=optimizer)
        parts = (opt.muon, opt.adamw) if isinstance(opt, MuonAdamW) else (opt,)
        for p in model.parameters():  # create the optimizer state before tracking, as at any step after the first
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for micro in micros:
            tracker = MemTracker()
            tracker.track_external(model, *parts)
            x = torch.randint(0, cfg.vocab_size, (micro, seq_len + 1))
            with tracker:
                with autocast_ctx(torch.device("cpu"), dtype):
                    loss = step(x[:, :-1], x[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            snap = tracker.get_tracker_snapshot("peak")
            per_dev = next(iter(snap.values()))
            kinds = {str(k.value) if hasattr(k, "value") else str(k): v for k, v in per_dev.items()}
            out.append((int(kinds["Total"]), int(kinds.get("Parameter", 0)), int(kinds.get("Optstate", 0))))
            del x, loss
    return out


def _fake_peak(
    cfg: ModelConfig, micro: int, seq_len: int, dtype: torch.dtype, activation_checkpoint: str = "none",
    checkpoint_every: int = 2,
) -> tuple[int, int, int]:
    """(peak, parameter, optimizer-state) bytes of one training step at ``micro`` on fake tensors."""
    return _fake_peaks(cfg, (micro,), seq_len, dtype, activation_checkpoint, checkpoint_every)[0]


def _trace_length(cfg: ModelConfig) -> int:
    """A sequence length that divides no element count but the per-token ones: the smallest prime from 61 on that
    divides none of the layer's dimensions (so a weight's copy, ``hidden × intermediate`` say, never counts)."""
    dims = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
    s = 61
    while any(d % s == 0 for d in dims) or any(s % k == 0 for k in range(2, math.isqrt(s) + 1)):
        s += 1
    return s


def _layer_saved_per_token(cfg: ModelConfig, dtype: torch.dtype, compiled: bool) -> float:
    """Bytes per token one decoder layer saves for its backward beyond its inputs (x, cos, sin), measured on a
    real layer at one sequence length (:func:`_trace_length`): the saved storages whose element count it divides
    grow with tokens; the weights' reduced-precision copies do not and are left out.

    ``compiled`` traces the layer through AOTAutograd's min-cut partitioner (the one Inductor uses). This is also
    what activation checkpointing frees for each checkpointed layer (it keeps only the inputs)."""
    torch.manual_seed(0)
    layer = DecoderLayer(cfg)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
    fn = (
        torch.compile(layer, backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False) if compiled else layer
    )
    s = _trace_length(cfg)
    x = torch.randn(1, s, cfg.hidden_size, requires_grad=True)
    seen: dict[int, tuple[int, int]] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = (st.nbytes(), t.element_size())
        return t

    with autocast_ctx(torch.device("cpu"), dtype):
        cos, sin = rope(torch.arange(s)[None], dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, cos, sin, None, None)
    for t in (x, cos, sin):
        seen.pop(t.untyped_storage().data_ptr(), None)
    return sum(n for n, size in seen.values() if (n // size) % s == 0) / s


@dataclasses.dataclass
class MemoryModel:
    """``peak(L, B) = a + b·L + c·B + d·L·B`` bytes, fitted on eager fake runs, corrected by what one decoder layer
    saves per token eager and compiled (``layer_saved``): Inductor's fusion saves less per layer, and a
    checkpointed layer keeps only its inputs."""

    cfg: ModelConfig
    seq_len: int
    dtype: torch.dtype
    coef: tuple[float, float, float, float]
    param_per_layer: tuple[float, float]
    opt_per_layer: tuple[float, float]
    layer_saved_eager: float  # bytes per token, the layer's inputs excluded
    layer_saved_compiled: float
    params: int
    flops_per_token: float
    head_chunk_per_token: float = 0.0  # of c/seq_len: the loss chunk's share, which stops growing at CHUNK_TOKENS

    @property
    def compiled_saving_per_token_layer(self) -> float:
        """Bytes per token and layer that compiling saves against eager."""
        return max(0.0, self.layer_saved_eager - self.layer_saved_compiled)

    def plan(self, micro: int, compiled: bool, activation_checkpoint: str = "none", checkpoint_every: int = 2) -> Plan:
        """The :class:`Plan` at micro-batch ``micro`` (``activation_checkpoint`` as :class:`CausalLMLoss` takes
        it; ValueError for a bad mode or ``checkpoint_every``)."""
        a, b, c, d = self.coef
        L = self.cfg.num_hidden_layers
        ckpt = checkpointed_layers(activation_checkpoint, checkpoint_every, L)
        tokens = micro * self.seq_len
        peak = a + b * L + c * micro + d * L * micro
        peak -= self.head_chunk_per_token * max(0, tokens - CHUNK_TOKENS)  # one chunk's logits at a time
        per_layer = self.layer_saved_eager
        if compiled:
            peak -= self.compiled_saving_per_token_layer * L * tokens
            per_layer = self.layer_saved_eager - self.compiled_saving_per_token_layer
        plain_activations = peak  # before checkpointing, for the traffic
        peak -= per_layer * len(ckpt) * tokens  # a checkpointed layer keeps only its inputs ...
        if L - 1 in ckpt:  # ... until its recompute; the top layer's comes before any other layer has freed its own
            peak += per_layer * tokens
        pb = self.param_per_layer[0] + self.param_per_layer[1] * L
        ob = self.opt_per_layer[0] + self.opt_per_layer[1] * L
        act_plain = (plain_activations - 2 * pb - ob) / tokens
        return Plan(
            micro_batch_size=micro,
            seq_len=self.seq_len,
            dtype=str(self.dtype).replace("torch.", ""),
            compiled=compiled,
            params=self.params,
            param_bytes=int(pb),
            grad_bytes=int(pb),
            optimizer_bytes=int(ob),
            activation_bytes=int(peak - 2 * pb - ob),
            peak_bytes=int(peak),
            flops_per_token=self.flops_per_token,
            activation_checkpoint=activation_checkpoint,
            checkpointed_layers=len(ckpt),
            # written once and read back in the backward (eager: one more round trip between unfused ops); a
            # recomputed layer writes its activations once more
            activation_traffic_per_token=(3 if compiled else 4) * act_plain + per_layer * len(ckpt),
        )


def _meta_model(cfg: ModelConfig) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def memory_model(
    cfg: ModelConfig, seq_len: int, dtype: torch.dtype, cache_dir: str | Path | None = None, optimizer: str = "adamw"
) -> MemoryModel:
    """Fit :class:`MemoryModel` for ``cfg`` at ``seq_len`` in ``dtype`` (fake runs of 2 and 3 layers at micro-batch
    1 and 2, one eager and one compiled trace of a real layer).

    With ``cache_dir`` the fit is kept in ``cache_dir/plan/<key>.json``, the key being the sha256 of the model
    config, ``seq_len``, ``dtype``, ``optimizer`` (``train.optimizer``), torch's version and the source of ``train/plan.py`` and ``train/model.py``: a
    repeated plan of the same model (``train.run`` on CUDA after ``python -m train.plan``) takes no fake run."""
    path = None
    if cache_dir is not None:
        here = Path(__file__)
        src = here.read_bytes() + here.with_name("model.py").read_bytes() + here.with_name("optim.py").read_bytes()
        key = json.dumps([dataclasses.asdict(cfg), seq_len, str(dtype), optimizer, torch.__version__,
                          hashlib.sha256(src).hexdigest()], sort_keys=True)
        path = Path(cache_dir) / "plan" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            return MemoryModel(cfg, seq_len, dtype, tuple(d["coef"]), tuple(d["param_per_layer"]),
                               tuple(d["opt_per_layer"]), d["layer_saved_eager"], d["layer_saved_compiled"],
                               d["params"], d["flops_per_token"], d["head_chunk_per_token"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no entry or an unreadable one: fit again
    # reduced precision computes the loss in chunks of CHUNK_TOKENS rows: past that the head's transient stops
    # growing, which a fit at micro-batch 1 and 2 cannot see; one more step, over two chunks, measures it
    chunked = dtype != torch.float32 and 2 * seq_len <= CHUNK_TOKENS
    big = 2 * math.ceil(CHUNK_TOKENS / seq_len)
    runs = {}
    for n_layers in (2, 3):
        small = dataclasses.replace(cfg, num_hidden_layers=n_layers)
        micros = (1, 2, big) if chunked and n_layers == 2 else (1, 2)
        for micro, run in zip(micros, _fake_peaks(small, micros, seq_len, dtype, optimizer=optimizer), strict=True):
            runs[n_layers, micro] = run
    p = {k: v[0] for k, v in runs.items()}
    d = (p[3, 2] - p[3, 1]) - (p[2, 2] - p[2, 1])
    c = (p[2, 2] - p[2, 1]) - 2 * d
    b = (p[3, 1] - p[2, 1]) - d
    a = p[2, 1] - 2 * b - c - 2 * d
    par = (runs[2, 1][1] - 2 * (runs[3, 1][1] - runs[2, 1][1]), runs[3, 1][1] - runs[2, 1][1])
    opt = (runs[2, 1][2] - 2 * (runs[3, 1][2] - runs[2, 1][2]), runs[3, 1][2] - runs[2, 1][2])
    head_chunk = 0.0
    if chunked:  # the linear law's excess at `big` rows is the chunk share of the tokens past one chunk
        linear = a + 2 * b + c * big + 2 * d * big
        head_chunk = max(0.0, (linear - p[2, big]) / (big * seq_len - CHUNK_TOKENS))
    eager = _layer_saved_per_token(cfg, dtype, False)
    # float32 is not compiled on CPU and gains nothing from fusing here: the eager figure stands for both
    compiled = eager if dtype == torch.float32 else _layer_saved_per_token(cfg, dtype, True)
    meta = _meta_model(cfg)
    n = sum(q.numel() for q in meta.parameters())
    mm = MemoryModel(cfg, seq_len, dtype, (a, b, c, d), par, opt, eager, compiled, n, meta.flops_per_token(seq_len),
                     head_chunk)
    if path is not None:
        fields = ("coef", "param_per_layer", "opt_per_layer", "layer_saved_eager", "layer_saved_compiled", "params",
                  "flops_per_token", "head_chunk_per_token")
        try:
            atomic_write_json(path, {f: getattr(mm, f) for f in fields})
        except OSError:
            pass  # a read-only cache folder only costs the next run its fit
    return mm


def estimate(
    cfg: ModelConfig, micro: int, seq_len: int, dtype: torch.dtype, compiled: bool = True,
    activation_checkpoint: str = "none", checkpoint_every: int = 2,
) -> Plan:
    """The :class:`Plan` of one micro-batch size (see :func:`memory_model`)."""
    return memory_model(cfg, seq_len, dtype).plan(micro, compiled, activation_checkpoint, checkpoint_every)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the run will happen: ``kind`` "cuda" or "cpu"; ``usable_bytes`` (a GPU's whole memory, a CPU's
    ``MemAvailable``); ``flops`` the matmul FLOP/s in the run's dtype (a GPU's datasheet peak; on a CPU the rate a
    float32 GEMM of the model's shape measured here); ``bandwidth`` memory bytes/s (GPU); ``baseline_bytes`` the
    runtime's resident set before any tensor (CPU)."""

    kind: str
    name: str
    usable_bytes: int
    flops: float
    bandwidth: float = 0.0
    baseline_bytes: int = 0

    def overhead(self, plan: Plan, cfg: ModelConfig) -> dict[str, int]:
        """What the process holds beyond ``plan``'s tensors on this target (see the module doc), by name."""
        if self.kind == "cuda":
            return {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_reserve": int(GPU_RESERVE_FRACTION * plan.peak_bytes)}
        logits = plan.micro_batch_size * plan.seq_len * cfg.vocab_size * 4
        return {"runtime_baseline": self.baseline_bytes, "malloc_reserve": int(CPU_RESERVE_LOGITS * logits)}

    def plan(self, mm: MemoryModel, micro: int, compiled: bool, activation_checkpoint: str = "none",
             checkpoint_every: int = 2) -> Plan:
        """``mm``'s :class:`Plan` at ``micro`` with this target's overhead filled in."""
        pl = mm.plan(micro, compiled, activation_checkpoint, checkpoint_every)
        pl.overhead = self.overhead(pl, mm.cfg)
        return pl


def gpu_target(gpu: GPU) -> Target:
    """A named GPU of :data:`GPUS` (planned for without one)."""
    return Target("cuda", gpu.name, gpu.memory_bytes, gpu.bf16_flops, gpu.hbm_bytes_per_s)


def cuda_target(device: torch.device) -> Target:
    """The CUDA GPU this process sees: its name and whole memory; FLOP/s and bandwidth from :data:`GPUS` (H100 /
    H200) or ``train.device.PEAK_FLOPS`` (bandwidth then H100's, an assumption the name says)."""
    props = torch.cuda.get_device_properties(device)
    known = next((g for k, g in GPUS.items() if k in props.name.lower()), None)
    if known:
        return Target("cuda", props.name, props.total_memory, known.bf16_flops, known.hbm_bytes_per_s)
    flops = next((t[torch.bfloat16] for frag, t in PEAK_FLOPS if frag in props.name), GPUS["h100"].bf16_flops)
    return Target("cuda", f"{props.name} (bandwidth assumed H100's)", props.total_memory, flops,
                  GPUS["h100"].hbm_bytes_per_s)


def _proc_kib(path: str, key: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_matmul_flops(cfg: ModelConfig, tokens: int, seconds: float = 0.3) -> float:
    """float32 FLOP/s of this CPU on the model's MLP GEMM (``[tokens, hidden] @ [hidden, intermediate]``, at most
    4,096 rows), measured for about ``seconds`` with torch's threads as configured: the rate a training step's
    matmuls run at, at best (the step also runs attention, norms, the optimizer)."""
    import time  # noqa: PLC0415

    m = min(tokens, 4096)
    a, b = torch.randn(m, cfg.hidden_size), torch.randn(cfg.hidden_size, cfg.intermediate_size)
    a @ b  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        a @ b
        n += 1
    return 2.0 * m * cfg.hidden_size * cfg.intermediate_size * n / (time.perf_counter() - t0)


def cpu_target(cfg: ModelConfig, tokens: int) -> Target:
    """This CPU: ``MemAvailable`` (or the total memory where /proc is absent) as usable, this process's resident
    set now as the runtime baseline (call it before any fit: torch and the training modules imported, no tensors),
    and :func:`cpu_matmul_flops`."""
    import os  # noqa: PLC0415

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    usable = _proc_kib("/proc/meminfo", "MemAvailable") or total
    baseline = _proc_kib("/proc/self/status", "VmRSS") or 0
    return Target("cpu", f"this CPU ({os.cpu_count()} cores)", usable, cpu_matmul_flops(cfg, tokens),
                  baseline_bytes=baseline)


def largest_micro_batch(
    cfg: ModelConfig, seq_len: int, dtype: torch.dtype, compiled: bool, target: Target,
    activation_checkpoint: str = "none", checkpoint_every: int = 2, mm: MemoryModel | None = None,
) -> int:
    """The largest power-of-two micro-batch whose process peak (tensors + overhead) fits ``target``'s usable
    memory (0 if none); ``mm`` reuses a fitted :class:`MemoryModel` (it must be ``cfg``'s at ``seq_len`` and
    ``dtype``)."""
    mm = mm or memory_model(cfg, seq_len, dtype)
    best, b = 0, 1
    while b <= 1024 and target.plan(mm, b, compiled, activation_checkpoint, checkpoint_every).process_bytes \
            <= target.usable_bytes:
        best, b = b, b * 2
    return best


def newton_schulz_flops(cfg: ModelConfig, steps: int = 5) -> float:
    """FLOPs of Muon's orthogonalisation in one optimizer step (torch.optim.Muon: ``steps`` quintic Newton–Schulz
    iterations per hidden matrix, Jordan et al. 2024): for an ``m × n`` matrix with ``m ≤ n`` each iteration forms
    ``A = X Xᵀ`` (2m²n), ``A·A`` (2m³) and ``B·X`` (2m²n). Independent of the batch: amortised over the step's tokens."""
    h, kv, i = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q, k, v, o, gate, up, down
    per_layer = sum(steps * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3) for a, b in shapes)
    return float(cfg.num_hidden_layers * per_layer)


def step_time(plan: Plan, cfg: ModelConfig, target: Target | GPU, tokens_per_step: int,
              optimizer: str = "adamw") -> tuple[float, float | None]:
    """(seconds per optimizer step, MFU) for ``tokens_per_step`` tokens on ``target`` (a :class:`Target` or a
    :class:`GPU`; see the module doc). On a CPU: the model FLOPs at the measured matmul rate (a lower bound: the
    rest of the step is not counted) and no MFU.

    On a GPU a checkpointed layer's forward runs twice: its matmuls (2 FLOPs per weight and token) and its attention
    forward (4·hidden·seq per token, half of it real work under the causal mask) are added to the time; MFU counts
    model FLOPs only (PaLM), so recomputation lowers it."""
    if isinstance(target, GPU):
        target = gpu_target(target)
    ns = newton_schulz_flops(cfg) if optimizer == "muon" else 0.0  # Muon: in bf16, at the matmul efficiency
    if target.kind == "cpu":
        return (plan.flops_per_token * tokens_per_step + ns) / target.flops, None
    attn = 12.0 * cfg.num_hidden_layers * cfg.hidden_size * plan.seq_len
    dense = plan.flops_per_token - attn + 2.0 * cfg.hidden_size * cfg.vocab_size  # + the loss chunks' recompute
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    layer_weights = h * (2 * h + 2 * kv) + 3 * h * cfg.intermediate_size  # q, o + k, v + gate, up, down
    dense += plan.checkpointed_layers * 2.0 * layer_weights
    attn += plan.checkpointed_layers * 4.0 * h * plan.seq_len
    compute = tokens_per_step * (dense / (target.flops * ETA_MATMUL) + attn / 2 / (target.flops * ETA_ATTENTION))
    compute += ns / (target.flops * ETA_MATMUL)
    traffic = plan.activation_traffic_per_token * tokens_per_step + 4 * (plan.param_bytes * 4)
    seconds = compute + traffic / target.bandwidth
    return seconds, plan.flops_per_token * tokens_per_step / (seconds * target.flops)


def main(argv: list[str] | None = None) -> int:
    """Entry point: a table of micro-batch sizes for the config on this device or the named GPU; exit 1 when the
    configured micro-batch does not fit, 2 for a bad config."""
    p = argparse.ArgumentParser(
        prog="python -m train.plan", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_config_args(p)
    p.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="plan for this GPU (default: the device this command runs on, as train.device says)")
    p.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's size (default tokenizer.vocab_size)")
    p.add_argument("--eager", action="store_true", help="plan for eager training (default: as train.compile says)")
    p.add_argument("--no-cache", action="store_true", help="fit again instead of reading data.cache_dir/plan/")
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
        device = torch.device("cuda") if args.gpu else resolve_device(cfg.train.device)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mcfg = ModelConfig(vocab_size=args.vocab_size or cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model))
    t = cfg.train
    global_tokens = t.micro_batch_size * t.grad_accum * t.seq_len
    if args.gpu:
        target = gpu_target(GPUS[args.gpu])
    elif device.type == "cuda":
        target = cuda_target(device)
    else:
        target = cpu_target(mcfg, t.micro_batch_size * t.seq_len)  # before any fit: the baseline is the runtime's
    dtype = resolve_dtype(t.dtype, device)
    compiled = t.compile is not False and not args.eager
    ac = (t.activation_checkpoint, t.activation_checkpoint_every)
    mm = memory_model(mcfg, t.seq_len, dtype, cache_dir=None if args.no_cache else resolve_path(cfg.data.cache_dir),
                      optimizer=t.optimizer)
    ckpt = sorted(checkpointed_layers(*ac, mcfg.num_hidden_layers))
    ac_text = {"none": "no activation checkpointing", "full": f"activation checkpointing of all {len(ckpt)} layers",
               "selective": f"activation checkpointing of {len(ckpt)} of {mcfg.num_hidden_layers} layers "
                            f"({', '.join(map(str, ckpt))})"}[t.activation_checkpoint]
    g = 2**30
    speed = (f"{target.flops / 1e12:.0f} TFLOP/s bf16" if target.kind == "cuda" else
             f"float32 matmuls measured at {target.flops / 1e9:.0f} GFLOP/s")
    print(
        f"{args.config}: {mm.params:,} parameters, {mm.flops_per_token / 1e9:.2f} GFLOPs per token "
        f"(6N + attention), {global_tokens:,} tokens a step, optimizer {t.optimizer}; {target.name}: "
        f"{target.usable_bytes / g:.1f} GiB usable, {speed}; {'compiled' if compiled else 'eager'}, "
        f"{str(dtype).replace('torch.', '')}, {ac_text}"
    )
    extra = list(target.overhead(mm.plan(1, compiled, *ac), mcfg))
    print(
        f"{'micro':>5} {'accum':>5} {'params':>7} {'grads':>6} {'optim':>6} {'activ.':>7} "
        + "".join(f"{OVERHEAD_HEADS.get(k, k)[:9]:>10}" for k in extra)
        + f" {'peak GiB':>8} {'fits':>4} {'step s':>7} {'MFU':>6}"
    )
    configured = None
    for micro in (1, 2, 4, 8, 16, 32, 64):
        if global_tokens % (micro * t.seq_len):
            continue
        pl = target.plan(mm, micro, compiled, *ac)
        secs, mfu = step_time(pl, mcfg, target, global_tokens, t.optimizer)
        fits = pl.process_bytes <= target.usable_bytes
        mark = " ← config" if micro == t.micro_batch_size else ""
        if micro == t.micro_batch_size:
            configured = pl
        print(
            f"{micro:>5} {global_tokens // (micro * t.seq_len):>5} {pl.param_bytes / g:>7.2f} {pl.grad_bytes / g:>6.2f} "
            f"{pl.optimizer_bytes / g:>6.2f} {pl.activation_bytes / g:>7.1f} "
            + "".join(f"{v / g:>10.2f}" for v in pl.overhead.values())
            + f" {pl.process_bytes / g:>8.1f} {'yes' if fits else 'NO':>4} {secs:>7.2f} "
            f"{'-' if mfu is None else f'{mfu:.1%}':>6}{mark}"
        )
    best = largest_micro_batch(mcfg, t.seq_len, dtype, compiled, target, *ac, mm=mm)
    print(
        f"largest micro-batch that fits {target.usable_bytes / g:.1f} GiB: {best} (× grad_accum "
        f"{max(1, math.ceil(global_tokens / max(best * t.seq_len, 1)))} for the same global batch)"
        + ("; peak = tensors + " + " + ".join(k.replace("_", " ") for k in extra) + " (see python -m train.plan --help)")
    )
    if t.optimizer == "muon":
        ns = newton_schulz_flops(mcfg)
        eta = ETA_MATMUL if target.kind == "cuda" else 1.0
        print(f"Muon: Newton–Schulz {ns / 1e12:.2f} TFLOP an optimizer step, ≈ {ns / (target.flops * eta):.3f} s of "
              f"the step time above; its state is one momentum buffer per hidden matrix (AdamW's: two moments)")
    if configured is None:
        configured = target.plan(mm, t.micro_batch_size, compiled, *ac)
    if configured.process_bytes > target.usable_bytes:
        print(f"error: the configured micro-batch {t.micro_batch_size} × {t.seq_len} plans {configured.process_bytes / g:.1f}"
              f" GiB, over the {target.usable_bytes / g:.1f} GiB usable on {target.name}; try micro-batch {best} "
              f"with grad_accum {max(1, math.ceil(global_tokens / max(best * t.seq_len, 1)))}" if best else
              f"error: the configured micro-batch {t.micro_batch_size} × {t.seq_len} plans "
              f"{configured.process_bytes / g:.1f} GiB, over the {target.usable_bytes / g:.1f} GiB usable on "
              f"{target.name}, and no micro-batch fits: a smaller model or activation checkpointing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
