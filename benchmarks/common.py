"""Helpers shared by the scripts of benchmarks/. The folder is not a package with an ``__init__``: each script
puts the repository root on ``sys.path`` and imports ``from benchmarks.common import …`` (a namespace package).

``load_by_path(name)`` loads a sibling script as a module (its builders and shapes: rust_decode.SHAPES, …);
``free_port()`` picks a free TCP port on 127.0.0.1 for a server a benchmark starts. ``QUIET_S`` is the pause
before a timing that follows another engine's run.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent

# Seconds to pause before timing one engine right after another. Thread pools busy-wait after a call: OpenBLAS's idle
# threads for about 2^28 cycles (0.1 s here), onnxruntime's intra-op threads likewise (allow_spinning, its default);
# the engine timed next would share the cores with those spinners. Measured: the packed matmul ran at 85-140
# GFLOP/s right after numpy in the same process and 150-230 after a 0.3 s pause (512 × 1280, m = 512, 2 threads).
QUIET_S = 0.5


def load_by_path(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a fresh module (executed once per call). Raises FileNotFoundError
    when there is no such script."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
