"""Helpers of the client and benchmark tests: a real ``uvicorn serve.app:app`` process on a free loopback port,
configured by SHALIK_* variables like a deployment (the OpenAI SDK and lm-evaluation-harness talk to it over
sockets), and loading a file of ``benchmarks/eval_tasks/`` (lm-evaluation-harness's task folder, not a package) as
a module."""

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
    """A Python file of the repository outside a package (e.g. ``benchmarks/eval_tasks/build.py``) as a module,
    registered in sys.modules."""
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


class ServerProcess:
    """A server started by :func:`server_process`: ``url``, ``proc``, and ``log`` (its stderr) once it stopped."""

    def __init__(self, url: str, proc: subprocess.Popen):
        self.url, self.proc, self.log = url, proc, ""


@contextmanager
def server_process(argv: list[str], port: int, env: dict | None = None, health: int = 200,
                   startup_s: float = 120) -> Iterator[ServerProcess]:
    """Run ``python argv...`` (a server listening on ``port``), wait until its ``/health`` answers ``health``, and
    yield it; stop it on exit and keep its stderr in ``.log``. Raises RuntimeError, with the stderr, when the
    process exits first, when ``/health`` reports the model ``unavailable`` (a load that failed), or after
    ``startup_s`` seconds."""
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    srv = ServerProcess(f"http://127.0.0.1:{port}", proc)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
            try:
                h = httpx.get(f"{srv.url}/health", timeout=2)
                if h.status_code == health:
                    break
                if h.json().get("status") == "unavailable":
                    raise RuntimeError(f"the server cannot load its model: {h.json().get('detail')}")
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server's /health did not answer {health} within {startup_s:g} s")
            time.sleep(0.1)
        yield srv
    finally:
        proc.terminate()
        try:
            srv.log = proc.communicate(timeout=15)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            srv.log = proc.communicate()[1]


@contextmanager
def uvicorn_server(bundle: str | Path, startup_s: float = 120, **env: str) -> Iterator[str]:
    """Serve ``bundle`` with ``python -m uvicorn serve.app:app`` and yield its base URL (``http://127.0.0.1:PORT``)
    once ``/health`` says the model is loaded. ``env`` adds SHALIK_* variables (e.g. ``SHALIK_API_KEY="k"``);
    SHALIK_THREADS defaults to 1. The process is stopped on exit; its stderr is in the error when it fails."""
    port = free_port()
    argv = ["-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with server_process(argv, port, {"SHALIK_MODEL": str(bundle), "SHALIK_THREADS": "1", **env},
                        startup_s=startup_s) as srv:
        yield srv.url
