"""How every benchmark of this folder times things: interleaved rounds, a quiet pause, one engine per process,
medians and per-round ratios, and the conditions of the run (load average, memory, machine).

The method (docs/design.md, "Testing habits"): figures are wall-clock on a machine shared with other jobs, so a
speed is only read against a peer measured in the same run. Each round runs every lane once, in an order rotated
round by round (:func:`rotated`), so load from other jobs and cache warmth hit every lane alike; a figure is the
median over rounds (:func:`median`), a comparison the median of the rounds' own ratios (:func:`median_ratio`),
with the load average recorded beside it (:func:`loadavg`).

Engines with thread pools run in a worker process each (:class:`Worker`, :class:`Channel`): their own pools
and OpenMP runtime, asleep on a pipe while another measures. Thread pools busy-wait after a call, so the next
timing waits :data:`QUIET_S` first (:func:`quiet`).
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from contract import cpu
from contract.cpu import cpu_flags  # noqa: F401  (the benchmarks read the CPU here; contract.cpu owns it)

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")

# Seconds to pause before timing one engine right after another. Thread pools busy-wait after a call: OpenBLAS's idle
# threads for about 2^28 cycles (0.1 s here), onnxruntime's intra-op threads likewise (allow_spinning, its default);
# the engine timed next would share the cores with those spinners. Measured: the packed matmul ran at 85-140
# GFLOP/s right after numpy in the same process and 150-230 after a 0.3 s pause (512 × 1280, m = 512, 2 threads).
QUIET_S = 0.5

WORKER_TIMEOUT_S = 1800  # a worker that answers nothing for this long is taken for dead


def quiet() -> None:
    """Sleep :data:`QUIET_S` seconds: the previous engine's idle threads stop spinning before the next timing."""
    time.sleep(QUIET_S)


# ---------------------------------------------------------------- rounds and statistics

def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index``: ``items`` rotated left by ``round_index`` places (A B C, B C A, C A B,
    …; with two items A B, B A, as an ABBA design). Every item leads equally often over len(items) rounds."""
    if not items:
        return []
    k = round_index % len(items)
    return list(items[k:]) + list(items[:k])


def median(xs: Iterable[float]) -> float:
    """The median (statistics.median); NaN for no values."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The per-round ratios ``a[i] / b[i]`` of two lanes measured in the same rounds. Raises ValueError when the
    lanes have different numbers of rounds."""
    return [x / y for x, y in zip(a, b, strict=True)]


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-round ratios ``a[i] / b[i]``: each ratio compares two lanes under the same load, so
    this is steadier than the ratio of the two medians. Raises ValueError on unequal lengths."""
    return median(ratios(a, b))


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by nearest rank on the sorted values; NaN for no values."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


# ---------------------------------------------------------------- conditions of the run

def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages ([] where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cores() -> int:
    """Cores this process may run on (``sched_getaffinity``, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU as a figure names it (:func:`contract.cpu.cpu_label`: model name, family, model and SIMD)."""
    return cpu.cpu_label()


def git_commit() -> str:
    """The repository's short HEAD commit ("" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return ""


def rss_mb(field: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident set in MB (1e6 bytes); file-backed mapped
    pages (memory-mapped weights) included. Falls back to ``ru_maxrss`` where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def bare_python_rss_mb() -> float:
    """Peak RSS (VmHWM) in MB of a fresh Python that imports numpy: what every worker pays before loading anything.
    (The child reports it itself: ``wait4``'s ru_maxrss would include the parent's memory copied at fork.)"""
    code = ("import numpy, pathlib; print([l.split()[1] for l in pathlib.Path('/proc/self/status').read_text()"
            ".splitlines() if l.startswith('VmHWM:')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip()) * 1024 / 1e6


def relative(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it (results never record this machine's
    absolute paths), else as given."""
    for p in (Path(path).absolute(), Path(path).resolve()):  # a linked runs/ folder lies inside, as its link says
        try:
            return str(p.relative_to(ROOT))
        except ValueError:
            pass
    return str(path)


# ---------------------------------------------------------------- one engine per process

class WorkerDied(RuntimeError):
    """A worker exited (or timed out) instead of answering; ``returncode`` < 0 is the signal that killed it."""

    def __init__(self, msg: str, returncode: int | None):
        super().__init__(msg)
        self.returncode = returncode


class Worker:
    """The orchestrator's handle on one worker process: ``module`` (``benchmarks.decode`` …) run with ``args``
    from the repository root; it answers each request line with one JSON line (see :class:`Channel`), its
    stderr goes to the file ``log``. ``threads`` sets the OpenMP / rayon / MKL thread counts of its environment
    (OpenBLAS gets 1: numpy's argmax needs none). ``ready`` is its first message. Raises WorkerDied when it exits
    or stays silent for ``timeout`` seconds (naming the tail of its log)."""

    def __init__(self, name: str, module: str, args: list[str], log: Path, threads: int,
                 timeout: float = WORKER_TIMEOUT_S):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), RAYON_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        self.name, self.log, self.timeout = name, log, timeout
        self._err = open(log, "w")
        self.p = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._err, text=True, env=env, cwd=ROOT)
        self.ready = self._read()

    def _read(self) -> dict:
        r, _, _ = select.select([self.p.stdout], [], [], self.timeout)
        line = self.p.stdout.readline() if r else ""
        if not line:
            self.close(kill=True)
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise WorkerDied(f"{self.name} worker exited with {self.p.returncode}: {' | '.join(tail)}",
                             self.p.returncode)
        return json.loads(line)

    def ask(self, request: str) -> dict:
        """Send one request line; returns the worker's JSON answer."""
        self.p.stdin.write(request + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self, kill: bool = False) -> dict:
        """Stop the worker; returns its last message (``{"bye": True, "peak_rss_mb_end": …}``) when it exits
        cleanly, {} otherwise."""
        last: dict = {}
        if not kill and self.p.poll() is None:
            try:
                last = self.ask("quit")
            except (OSError, WorkerDied):
                pass
        if self.p.poll() is None:
            try:
                self.p.wait(timeout=30 if not kill else 0.1)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._err.close()
        return last


class Channel:
    """The worker side of :class:`Worker`. Made first thing in a worker: stdout is duplicated for the protocol and
    then pointed at stderr, so anything a native library prints while loading goes to the log, never into the
    protocol. ``send(obj)`` writes one JSON line (the first one is the worker's "ready" message);
    :meth:`requests` yields the request lines until "quit", which it answers ``{"bye": True, "peak_rss_mb_end":
    …}``."""

    def __init__(self):
        self._proto = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, obj: dict) -> None:
        """One JSON line to the orchestrator."""
        self._proto.write(json.dumps(obj) + "\n")

    def requests(self) -> Iterator[str]:
        """The request lines (stripped) until "quit" or the end of stdin; says goodbye after the last."""
        for line in sys.stdin:
            request = line.strip()
            if request == "quit":
                break
            yield request
        self.send({"bye": True, "peak_rss_mb_end": rss_mb()})
