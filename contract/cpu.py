"""What this CPU is, as Linux's ``/proc/cpuinfo`` states it: the model name, the instruction-set flags, the clock.

One reader for every stage: preflight's dtype choice (``train.device.native_cpu_bf16``), the name a run's summary and
the benchmarks' page headers give the CPU (:func:`cpu_label`), llama-server's build choice (``benchmarks.timing``), and
the roofline's stated peak (``benchmarks.roofline``).
Each function takes the file to read (default :data:`CPUINFO`, looked up at call time so that a test can point it at
a file of its own) and returns None where that file cannot be read (not Linux; :func:`cpu_label` then falls back
to ``platform.processor()``); none of them raises.
"""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def _values(key: str, cpuinfo: Path | None) -> list[str] | None:
    """The value of every ``key : value`` line of ``cpuinfo`` (one per logical processor), stripped; None where the
    file cannot be read."""
    try:
        text = (CPUINFO if cpuinfo is None else cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    out = []
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            out.append(value.strip())
    return out


def cpu_name(cpuinfo: Path | None = None) -> str | None:
    """The first processor's ``model name`` (e.g. ``"AMD EPYC 9B14"``); None where there is none or no file."""
    names = _values("model name", cpuinfo)
    return names[0] if names else None


def cpu_flags(cpuinfo: Path | None = None) -> set[str] | None:
    """The first processor's instruction-set flags as Linux names them (``avx2``, ``avx512_bf16``, ``amx_tile``, ...:
    the ``flags`` line); an empty set where the file has no such line, None where it cannot be read."""
    flags = _values("flags", cpuinfo)
    if flags is None:
        return None
    return set(flags[0].split()) if flags else set()


def cpu_mhz(cpuinfo: Path | None = None) -> float | None:
    """The highest ``cpu MHz`` over the processors (the clock the kernel last saw, MHz); None where none is stated."""
    mhz = []
    for value in _values("cpu MHz", cpuinfo) or []:
        try:
            mhz.append(float(value))
        except ValueError:
            continue
    return max(mhz) if mhz else None


def cpu_label(cpuinfo: Path | None = None) -> str:
    """The CPU as a speed figure should name it: the model name, family and model numbers, and the widest SIMD the
    integer and float kernels use (AMX, AVX-512, AVX2, else "no AVX2"), e.g. ``"AMD EPYC (family 25 model 1; AVX2)"``.
    Cloud machines often report a bare "AMD EPYC", which may be a Zen 3 (AVX2 only) or a Zen 4 (family 25, models 1
    and 17), whose speeds differ widely. Where there is no model name or no file: ``platform.processor()``, else
    "unknown CPU" (never None, unlike the readers above)."""
    name = cpu_name(cpuinfo)
    if name is None:
        return platform.processor() or "unknown CPU"
    flags = cpu_flags(cpuinfo) or set()
    simd = next((label for flag, label in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                 if flag in flags), "no AVX2")
    family, model = _values("cpu family", cpuinfo) or [], _values("model", cpuinfo) or []
    where = [f"family {family[0]} model {model[0]}"] if family and model else []
    return f"{name} ({'; '.join([*where, simd])})"
