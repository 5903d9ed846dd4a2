"""Helpers of the client and benchmark tests: a real ``uvicorn serve.app:app`` process on a free loopback port,
configured by SHALIK_* variables like a deployment (the OpenAI SDK and lm-evaluation-harness talk to it over
sockets), and loading a script of ``benchmarks/`` (not a package) as a module."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def load_script(relative: str):
    """A Python file of the repository (e.g. ``benchmarks/eval.py``) as a module, registered in sys.modules."""
    path = ROOT / relative
    name = "shalik_" + "_".join(Path(relative).with_suffix("").parts)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def uvicorn_server(bundle: str | Path, startup_s: float = 120, **env: str) -> Iterator[str]:
    """Serve ``bundle`` with ``python -m uvicorn serve.app:app`` and yield its base URL (``http://127.0.0.1:PORT``)
    once ``/health`` says the model is loaded. ``env`` adds SHALIK_* variables (e.g. ``SHALIK_API_KEY="k"``);
    SHALIK_THREADS defaults to 1. The process is stopped on exit; its stderr is in the error when it fails."""
    port = free_port()
    full_env = {**os.environ, "SHALIK_MODEL": str(bundle), "SHALIK_THREADS": "1", **env}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {proc.returncode}: {proc.stderr.read()}")
            try:
                h = httpx.get(f"{url}/health", timeout=2)
                if h.status_code == 200:
                    break
                if h.json().get("status") == "unavailable":
                    raise RuntimeError(f"the server cannot load {bundle}: {h.json().get('detail')}")
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not load {bundle} within {startup_s:g} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
