"""Device and precision choice, autocast, and peak FLOP/s for MFU.

``train.device = "auto"`` picks CUDA when available, else CPU; ``train.dtype = "auto"`` means bfloat16
autocast on CUDA (weights and optimizer stay float32). On CPU it starts as float32 and becomes bfloat16 autocast
only on a CPU that computes bfloat16 natively (:func:`native_cpu_bf16`) once preflight has shown that it agrees
with float32 and is faster (:func:`auto_cpu_dtype`, decided by ``train.components.placement``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from contract.cpu import cpu_flags, cpu_label

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Dense (no sparsity) peak tensor-core FLOP/s by GPU name fragment and dtype, from the vendors' datasheets.
PEAK_FLOPS = [
    ("H200", {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}),
    ("H100", {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}),  # SXM; PCIe is 756e12
    ("A100", {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12}),
    ("L40S", {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12}),
    ("A10", {torch.bfloat16: 125e12, torch.float16: 125e12, torch.float32: 31.2e12}),
    ("4090", {torch.bfloat16: 165e12, torch.float16: 165e12, torch.float32: 82.6e12}),
]


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` → ``cuda`` if available else ``cpu``; ``cuda`` without a GPU is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r} but CUDA is not available on this machine")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype: ``auto`` → bfloat16 on CUDA, float32 on CPU (where preflight may then switch it to
    bfloat16: :func:`auto_cpu_dtype`)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


# /proc/cpuinfo flags of the instructions that compute bfloat16 products natively (Linux's names): Intel's AMX
# tiles (Sapphire Rapids on), and AVX512-BF16's ``vdpbf16ps`` (Cooper Lake, Sapphire Rapids, AMD Zen 4 on), which
# oneDNN's bfloat16 matmul kernels use. Without them oneDNN converts to float32 and bfloat16 runs slower.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# ``SHALIK_CPU_BF16=0`` hides them (bfloat16 is then never chosen by ``auto``): the fallback, testable anywhere.
BF16_ENV = "SHALIK_CPU_BF16"


def native_cpu_bf16() -> str | None:
    """The first of :data:`BF16_CPU_FLAGS` this CPU has (``"amx_bf16"`` or ``"avx512_bf16"``), else None.

    Read from the ``flags`` line of ``/proc/cpuinfo`` (Linux, :func:`contract.cpu.cpu_flags`); where that file is absent, from torch's own CPU
    probe (``torch.cpu._is_amx_tile_supported`` / ``_is_avx512_bf16_supported``, when this torch has them).
    The environment variable ``SHALIK_CPU_BF16=0`` masks both (returns None); any other value is ignored.
    """
    if os.environ.get(BF16_ENV, "").strip() == "0":
        return None
    flags = cpu_flags()
    if flags is None:
        checks = (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
        return next((flag for flag, fn in checks if getattr(torch.cpu, fn, lambda: False)()), None)
    return next((f for f in BF16_CPU_FLAGS if f in flags), None)


# bfloat16 must beat float32 by this much in preflight's interleaved timing to be chosen (a 2-core machine shared
# with other jobs times the same step within a few percent; a native CPU gains 1.2-1.5x on the cpu preset).
AUTO_BF16_MIN_GAIN = 1.10


def auto_cpu_dtype(precision_ok: bool | None, gain: float | None, flag: str | None = None) -> tuple[torch.dtype, str]:
    """``train.dtype = "auto"`` on CPU: (the dtype, the reason as the run's log says it).

    bfloat16 when the CPU computes it natively (``flag``, :func:`native_cpu_bf16`), preflight's precision check
    passed (``precision_ok``) and its throughput check timed bfloat16 at least :data:`AUTO_BF16_MIN_GAIN` × float32's
    tokens/s (``gain``); float32 otherwise (``None``: not measured, e.g. preflight skipped).
    """
    if flag is None:
        return torch.float32, f"float32: no native bfloat16 on this CPU ({' / '.join(BF16_CPU_FLAGS)} absent or {BF16_ENV}=0)"
    if precision_ok is None or gain is None:
        return torch.float32, f"float32: the CPU has {flag}, but preflight did not run to check bfloat16 (it decides)"
    if not precision_ok:
        return torch.float32, f"float32: the CPU has {flag}, but preflight's precision check failed under bfloat16"
    if gain < AUTO_BF16_MIN_GAIN:
        return torch.float32, (f"float32: the CPU has {flag}, but bfloat16 ran only {gain:.2f}× float32's tokens/s in "
                               f"preflight (< {AUTO_BF16_MIN_GAIN})")
    return torch.bfloat16, (f"bfloat16 autocast: the CPU has {flag}, preflight's precision check passed and bfloat16 "
                            f"ran {gain:.2f}× float32's tokens/s")


def autocast_ctx(device: torch.device, dtype: torch.dtype):
    """``torch.autocast`` for a reduced dtype, a null context for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def device_name(device: torch.device) -> str:
    """What the run trains on, as its figures should name it: the GPU's name, or the CPU's
    (:func:`contract.cpu.cpu_label`, e.g. ``"AMD EPYC (family 25 model 1; AVX2)"``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_label()


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of a known GPU for ``dtype`` (None on CPU or an unknown GPU: no MFU then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for frag, table in PEAK_FLOPS:
        if frag in name:
            return table.get(dtype)
    return None


def setup_cuda_fast_paths() -> None:
    """TF32 matmuls and cuDNN convolutions (the float32 leftovers under bf16 autocast)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


# glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def setup_cpu_allocator(threshold_bytes: int = 1 << 30) -> bool:
    """Keep freed activation buffers in glibc's heap instead of returning them to the kernel.

    A CPU training step allocates and frees the same large tensors every time (``small``'s float32 logits alone
    are 8 × 512 × 32,000 × 4 B = 524 MB). Above glibc's mmap threshold each one is a fresh ``mmap`` whose pages the
    kernel faults in and zeroes again: here a third of a step's CPU time was system time. Raising the mmap and
    trim thresholds to ``threshold_bytes`` (1 GiB) makes malloc reuse the memory (PyTorch's CPU tuning guide gets
    the same effect by switching to jemalloc or tcmalloc); what it saves: benchmarks/README.md ("Training"). The
    cost: the process keeps its peak memory until it exits.

    Returns True when applied; False (and does nothing) outside glibc (macOS, musl, Windows).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes))


# SDPA backends tried on CUDA, fastest first on Hopper: cuDNN attention (about 2x FlashAttention-2 there, but only
# used when asked for), then FlashAttention-2, then memory-efficient attention. The math backend is the reference.
SDPA_CANDIDATES = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                   ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
SDPA_TOL = 2e-2  # max |Δ| of outputs and gradients vs float32 math, for unit-variance inputs in bf16 (bf16 ε = 7.8e-3)


def attention_error(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                    dtype: torch.dtype, num_heads: int, head_dim: int, seq_len: int = 256, qk_std: float = 1.0) -> float:
    """Max |Δ| of causal attention's output and its q, k, v gradients as ``attend(q, k, v)`` computes them in
    ``dtype`` against float32 SDPA math, on q, k, v ``[2, num_heads, seq_len, head_dim]`` drawn from a generator of
    its own (seed 0; the global RNG is not touched): v unit-variance, q and k of standard deviation ``qk_std`` (4
    gives the large, peaked logits a trained model reaches). ``attend``'s exceptions propagate."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, num_heads, seq_len, head_dim, device=device, generator=g) * s
               for s in (qk_std, qk_std, 1.0))
    dout = torch.randn(2, num_heads, seq_len, head_dim, device=device, generator=g)

    def run(fn, dt):
        qq, kk, vv = (t.detach().to(dt).clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        out.backward(dout.to(dt))
        return [t.detach().float() for t in (out, qq.grad, kk.grad, vv.grad)]

    def math(qq, kk, vv):
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

    ref = run(math, torch.float32)
    return max(float((a - b).abs().max()) for a, b in zip(run(attend, dtype), ref, strict=True))


def choose_sdpa_backend(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, seq_len: int = 256,
                        candidates=None) -> tuple[str, SDPBackend | None, str]:
    """The first SDPA backend that runs causal attention forward + backward on ``device`` in ``dtype`` and agrees
    with float32 math within ``SDPA_TOL`` on q, k, v ``[2, num_heads, seq_len, head_dim]``
    (:func:`attention_error`).

    Returns ``(name, backend, detail)``; on CPU (or float32) ``("default", None, …)``: PyTorch's own choice is
    kept. ``candidates`` (default :data:`SDPA_CANDIDATES`) is a list of ``(name, SDPBackend)``. When none passes,
    ``("math", SDPBackend.MATH, reasons)``.
    """
    if candidates is None:
        if device.type != "cuda" or dtype == torch.float32:
            return "default", None, f"PyTorch's choice on {device.type} {str(dtype).replace('torch.', '')}"
        candidates = SDPA_CANDIDATES
    reasons = []
    for name, backend in candidates:
        def attend(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        try:
            err = attention_error(attend, device, dtype, num_heads, head_dim, seq_len)
        except RuntimeError as e:  # not available for this GPU, dtype or head_dim
            reasons.append(f"{name}: {str(e).splitlines()[0][:120]}")
            continue
        if err <= SDPA_TOL:
            return name, backend, f"max |Δ| {err:.2e} vs float32 math (tolerance {SDPA_TOL})"
        reasons.append(f"{name}: max |Δ| {err:.2e} > {SDPA_TOL}")
    return "math", SDPBackend.MATH, "; ".join(reasons)


def sdpa_context(backend: SDPBackend | None):
    """``sdpa_kernel([backend])``, or a null context for ``None`` (PyTorch's default choice)."""
    return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])


_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's peak allocated memory, or on Linux the process's peak resident set (VmHWM, reset by
    writing 5 to /proc/self/clear_refs, proc(5)); elsewhere on CPU nothing (the peak is then the process's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            _CLEAR_REFS.write_text("5")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak since :func:`reset_peak_memory`: CUDA ``max_memory_allocated`` (tensors), or the peak resident set of
    this process on CPU (VmHWM on Linux, else ``ru_maxrss``), in bytes."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
