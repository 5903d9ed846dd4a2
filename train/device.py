"""Device and precision choice, autocast, and peak FLOP/s for MFU.

``train.device = "auto"`` picks CUDA when available, else CPU; ``train.dtype = "auto"`` means bfloat16
autocast on CUDA (weights and optimizer stay float32) and float32 on CPU.
"""

from __future__ import annotations

import contextlib

import torch

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
