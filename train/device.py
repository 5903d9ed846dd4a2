"""Device and precision choice, autocast, and peak FLOP/s for MFU.

``train.device = "auto"`` picks CUDA when available, else CPU; ``train.dtype = "auto"`` means bfloat16
autocast on CUDA (weights and optimizer stay float32) and float32 on CPU.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    """The compute dtype: ``auto`` → bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def autocast_ctx(device: torch.device, dtype: torch.dtype):
    """``torch.autocast`` for a reduced dtype, a null context for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


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
    the same effect by switching to jemalloc or tcmalloc). Measured on ``small``, 2 cores: system time −40 %,
    tokens/s +7–24 % over two interleaved pairs. The cost: the process keeps its peak memory until it exits.

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


def choose_sdpa_backend(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, seq_len: int = 256,
                        candidates=None) -> tuple[str, SDPBackend | None, str]:
    """The first SDPA backend that runs causal attention forward + backward on ``device`` in ``dtype`` and agrees
    with float32 math within ``SDPA_TOL`` on q, k, v ``[2, num_heads, seq_len, head_dim]``.

    Returns ``(name, backend, detail)``; on CPU (or float32) ``("default", None, …)``: PyTorch's own choice is
    kept. ``candidates`` (default :data:`SDPA_CANDIDATES`) is a list of ``(name, SDPBackend)``. When none passes,
    ``("math", SDPBackend.MATH, reasons)``.
    """
    if candidates is None:
        if device.type != "cuda" or dtype == torch.float32:
            return "default", None, f"PyTorch's choice on {device.type} {str(dtype).replace('torch.', '')}"
        candidates = SDPA_CANDIDATES
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, num_heads, seq_len, head_dim, device=device, generator=g) for _ in range(3))
    dout = torch.randn(2, num_heads, seq_len, head_dim, device=device, generator=g)

    def run(backend, dt):
        qq, kk, vv = (t.detach().to(dt).clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out.backward(dout.to(dt))
        return [t.detach().float() for t in (out, qq.grad, kk.grad, vv.grad)]

    ref = run(SDPBackend.MATH, torch.float32)
    reasons = []
    for name, backend in candidates:
        try:
            got = run(backend, dtype)
        except RuntimeError as e:  # not available for this GPU, dtype or head_dim
            reasons.append(f"{name}: {str(e).splitlines()[0][:120]}")
            continue
        err = max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True))
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
