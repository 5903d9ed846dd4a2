"""Continuous batching: Shalik's engines against llama.cpp's own server (``llama-server --parallel N``) on the same
model, at 1, 2, 4, 8, 16 and 32 concurrent streams: aggregate completion tokens/s, time to first token (TTFT) and
inter-token latency (ITL p50/p99), each as a ratio to one stream, and Shalik / llama-server per concurrency.

ITL is the gap between consecutive tokens of one stream, from its first token on (the wait for the first token
is TTFT, not ITL), pooled over the streams of a run (and over --rounds runs).

The model is ``runs/PRESET-init/bundle`` (default ``small``: configs/small.toml untrained, made by ``train.run``
and ``export.onnx`` when absent; benchmarks/bundles.py), the same bundle for every engine. For each engine and each
concurrency C, C requests go in at once, each read by a Python thread of its own; every request is the same token
id list on every engine (``<|endoftext|>`` + ``--prompt`` ids), ``--new`` greedy tokens with end-of-text ignored,
so that every lane produces exactly C × --new tokens (the tokens actually produced are counted and checked). Runs
are interleaved (each round: every concurrency, every engine) so that load from other jobs hits every cell alike;
tokens/s pools a cell's rounds (all tokens / all wall time). Writes benchmarks/results/serve_batching.{json,md,png}.
The page starts with the command that made it, the CPU and the commit; a hand-written block under the title
(between :data:`NOTES_BEGIN` and :data:`NOTES_END`) is kept by ``--replot``.

    python benchmarks/serve_batching.py [--preset small] [--threads 2] [--prompt 32] [--new 64]
        [--concurrency 1 2 4 8 16 32] [--rounds 1] [--token-budget 256] [--prefill-chunk N] [--engines ...]
        [--llama-server PATH]

Engines (``ENGINES``: each a lane of benchmarks/lanes.py, served by its runtime's engine):

* ``rust f32``, ``rust q8_0``, ``rust q4_0``, ``rust q4_mix``: rust_runtime.Engine with max_batch = C, in-process
  (the quantized lanes on rust_runtime's integer kernels).
* ``http rust f32``, ``http rust q8_0``, ``http rust q4_0``, ``http rust q4_mix``: the same rust_runtime.Engine
  behind Shalik's server, ``uvicorn serve.app:app`` (``SHALIK_BACKEND=rust``, ``SHALIK_QUANTIZE``,
  ``SHALIK_MAX_CONCURRENCY`` = C), started per cell like llama-server and timed like it, over HTTP on localhost: each
  stream a streaming ``POST /v1/completions`` of the same ids (``ignore_eos``, ``logprobs: 0`` so that each chunk
  says how many tokens it brings). The gap to the in-process lane is the server's per-token work (detokenization,
  SSE, the event loop) and the client's.
* ``onnx f32``: serve's own engine (serve.engine.StepEngine, the Python scheduler the onnx backend serves through)
  over the bundle's model.onnx with OnnxBackend.decode_batch, with the same max_batch / token_budget /
  prefill_chunk; in-process.
* ``llama-server f32``, ``llama-server q8_0``, ``llama-server q4_0``, ``llama-server q4_k_m``: llama.cpp's server on
  the same model as GGUF (``python -m export.gguf BUNDLE --type f32|q8_0 --approximate-pretokenizer``; Q4_0 and
  Q4_K_M by llama.cpp's own quantizer from the f32 file, benchmarks.bundles.gguf), started per cell (not timed) with ``--parallel C -t T -tb T
  -c C × per-slot context`` and its defaults otherwise (continuous batching, f16 KV cache, flash attention auto,
  CPU weight repacking), then warmed up once; each stream is a streaming ``POST /completion`` whose ``prompt`` is
  the token id list, ``n_predict`` = --new, ``temperature 0, top_k 1``, no penalties, ``cache_prompt false``,
  ``ignore_eos true``. The binary is built by benchmarks/build_llama_server.sh (the vendored llama.cpp of the
  llama-cpp-python sdist, AMX off); without one these lanes are left out and the md says so.

llama-server is measured over HTTP (localhost, server-sent events): TTFT and ITL are client-side arrival times of
the SSE chunks, Shalik's engines are timed in-process. The md also gives llama-server's own figures from the
``timings`` of each stream's final chunk (server-side tokens/s = the cell's tokens / the longest stream's
prompt_ms + predicted_ms; TTFT = prompt_ms; per-token ms = predicted_ms / predicted_n), so the HTTP/client
overhead is the gap between the two. llama.cpp holds back a token whose text ends in an incomplete UTF-8
character and sends it with the next chunk; such tokens are stamped at that chunk's arrival (``merged`` counts them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bundles, lanes, timing  # noqa: E402
from benchmarks.common import free_port  # noqa: E402
from contract.atomic import atomic_path, atomic_write_json, atomic_write_text  # noqa: E402
from contract.quant import ALIASES  # noqa: E402

# engine → the lane it serves (benchmarks/lanes.py); the lane's runtime picks the engine: rust → rust_runtime.Engine,
# onnx → serve.engine.StepEngine, llama → llama-server on the lane's GGUF
ENGINES = {"rust f32": "rust-f32", "rust q8_0": "rust-q8_0", "rust q4_0": "rust-q4_0", "rust q4_mix": "rust-q4_mix",
           "onnx f32": "ort-fp32", "llama-server f32": "llama-f32", "llama-server q8_0": "llama-q8_0",
           "llama-server q4_0": "llama-q4_0", "llama-server q4_k_m": "llama-q4_k_m",
           "http rust f32": "rust-f32", "http rust q8_0": "rust-q8_0", "http rust q4_0": "rust-q4_0",
           "http rust q4_mix": "rust-q4_mix"}
PEERS = {"rust f32": "llama-server f32", "rust q8_0": "llama-server q8_0",  # Shalik lane → its llama-server lane
         "rust q4_0": "llama-server q4_0", "rust q4_mix": "llama-server q4_k_m",
         "http rust f32": "llama-server f32", "http rust q8_0": "llama-server q8_0",
         "http rust q4_0": "llama-server q4_0", "http rust q4_mix": "llama-server q4_k_m"}
HTTP_PREFIX = "http "  # engines served by `uvicorn serve.app:app` (Shalik's server) and timed over HTTP
# A page's hand-written part (conditions, the headline, what went wrong on the way) sits between these two lines, right
# under the title; `--replot` keeps it, a new measurement starts the page without it.
NOTES_BEGIN = "<!-- notes: written by hand, kept by --replot -->"
NOTES_END = "<!-- /notes -->"

BUILD_HINT = ("build it with `bash benchmarks/build_llama_server.sh` (minutes: benchmarks/README.md, Build and test times), or pass "
              "`--llama-server PATH` for a binary elsewhere")


def lane(engine: str) -> lanes.Lane:
    """The lane an engine name serves."""
    return lanes.LANES[ENGINES[engine]]


class RustClient:
    """rust_runtime.Engine (max_batch = C): ``stream(ids, new)`` yields 1 per token event, greedy, eos ignored."""

    def __init__(self, model, max_batch: int, token_budget: int, prefill_chunk: int | None):
        import rust_runtime

        kw = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        self.engine = rust_runtime.Engine(model, max_batch=max_batch, token_budget=token_budget, **kw)
        self.prefill_chunk = self.engine.prefill_chunk

    def stream(self, ids: list[int], new: int) -> Iterator[int]:
        for _index, _tok, _lp, _top, finish in self.engine.submit(ids, new, temperature=0.0, ignore_eos=True):
            if finish is None:
                yield 1

    def close(self) -> None:
        self.engine.close()


class StepEngineClient:
    """serve.engine.StepEngine (the Python scheduler): ``stream(ids, new)`` as RustClient's."""

    def __init__(self, backend, max_batch: int, token_budget: int, prefill_chunk: int):
        from serve.engine import StepEngine

        self.engine = StepEngine(backend, eot_id=backend.eot_id, max_batch=max_batch, token_budget=token_budget,
                                 prefill_chunk=prefill_chunk)

    def stream(self, ids: list[int], new: int) -> Iterator[int]:
        from serve.sampling import SamplingParams

        for e in self.engine.submit(ids, new, SamplingParams(temperature=0.0), ignore_eos=True).events(0):
            if e.token is not None and e.finish is None:
                yield 1

    def close(self) -> None:
        self.engine.close()


def default_llama_server(cache: Path | None = None, flags: set[str] | None = None) -> str | None:
    """The llama-server binary: the newest build of benchmarks/build_llama_server.sh in its cache folder
    (``cache``; default ``$SHALIK_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/shalik``) that this CPU can run, else
    ``llama-server`` on PATH, else None.

    A build can run here when every instruction-set flag listed in its ``isa.txt`` (one Linux cpuinfo name a line,
    written by the build script) is among ``flags`` (default :func:`benchmarks.timing.cpu_flags`). A build without ``isa.txt`` (made
    before the script recorded it, with AVX-VNNI on: it stops with SIGILL on an AMD Zen 4) is never chosen; where
    the flags cannot be read (not Linux), a build with ``isa.txt`` is taken as it is."""
    if cache is None:
        cache = Path(os.environ.get("SHALIK_CACHE")
                     or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shalik")
    flags = timing.cpu_flags() if flags is None else flags
    runnable = []
    for binary in cache.glob("llama-server-build-*/bin/llama-server"):
        isa = binary.parent.parent / "isa.txt"
        if isa.is_file() and (flags is None or set(isa.read_text().split()) <= flags):
            runnable.append(binary)
    built = sorted(runnable, key=lambda p: p.stat().st_mtime)
    return str(built[-1]) if built else shutil.which("llama-server")


class LocalServer:
    """A server process on a free localhost port (``cmd`` built from the port), its output in ``log``, waited for
    until ``GET /health`` answers 200. Raises RuntimeError when it exits or is not healthy in ``timeout`` seconds
    (naming ``what`` and its log)."""

    def __init__(self, what: str, cmd, log: Path, env: dict | None = None, timeout: float = 120):
        self.port, self.log, self.what = free_port(), log, what
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd(self.port), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode} before it was healthy; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                conn.close()
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{what} not healthy after {timeout:.0f} s; see {log}")
            time.sleep(0.1)

    def post_stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST ``body`` as JSON to ``path`` and yield the JSON of each server-sent ``data:`` line (``[DONE]``
        ends it). Raises RuntimeError on a non-200 answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{self.what} {path}: HTTP {resp.status}: {resp.read()[:300]!r}")
            for line in resp:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    yield json.loads(line[6:])
        finally:
            conn.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ShalikServer(LocalServer):
    """``uvicorn serve.app:app`` on ``bundle`` with the rust backend at ``quantize`` (None: float32),
    ``SHALIK_MAX_CONCURRENCY`` = ``slots`` (the engine's batch), ``threads`` compute threads. ``stream(ids, new)``
    sends ``ids`` without their leading ``<|endoftext|>`` (the server prepends it) as a streaming
    ``/v1/completions`` (greedy, ``ignore_eos``, ``logprobs: 0`` so that each chunk says how many tokens it
    brings) and yields that count per chunk."""

    def __init__(self, bundle: Path, quantize: str | None, slots: int, threads: int, log: Path):
        env = {**os.environ, "SHALIK_MODEL": str(bundle), "SHALIK_BACKEND": "rust",
               "SHALIK_QUANTIZE": quantize or "none", "SHALIK_THREADS": str(threads),
               "SHALIK_ALLOW_UNGATED": "1",  # speed on an untrained twin, which the gate does not measure
               "SHALIK_MAX_CONCURRENCY": str(slots), "SHALIK_MAX_QUEUE": str(max(64, slots)), "SHALIK_VERIFY": "0"}
        super().__init__("uvicorn serve.app:app", lambda port: [
            sys.executable, "-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"], log, env)

    def stream(self, ids: list[int], new: int) -> Iterator[int]:
        body = {"prompt": ids[1:], "max_tokens": new, "temperature": 0.0, "stream": True, "ignore_eos": True,
                "logprobs": 0}
        for chunk in self.post_stream("/v1/completions", body):
            n = sum(len((c.get("logprobs") or {}).get("tokens", [])) for c in chunk.get("choices", []))
            if n:
                yield n


class LlamaServer(LocalServer):
    """One ``llama-server`` process on a GGUF (``--parallel slots``, ``threads`` for decode and batch, ``ctx`` total
    context = slots × per-slot context), on a free localhost port; its log goes to ``log``. ``stream(ids, new)``
    yields the number of tokens each SSE chunk of a streaming ``/completion`` brings, and appends that stream's
    final ``timings`` to ``self.timings``. Raises RuntimeError when the server exits or is not healthy in
    ``timeout`` seconds (naming its log)."""

    def __init__(self, binary: str, gguf: Path, slots: int, threads: int, ctx: int, log: Path, timeout: float = 120):
        self.timings: list[dict] = []
        self._lock = threading.Lock()
        super().__init__("llama-server", lambda port: [
            binary, "-m", str(gguf), "--parallel", str(slots), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
            "--host", "127.0.0.1", "--port", str(port)], log, timeout=timeout)

    def stream(self, ids: list[int], new: int) -> Iterator[int]:
        body = {"prompt": ids, "n_predict": new, "stream": True, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
                "min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "cache_prompt": False, "ignore_eos": True}
        seen = 0
        for chunk in self.post_stream("/completion", body):
            n = int(chunk.get("tokens_predicted", seen))
            if n > seen:
                yield n - seen
                seen = n
            if chunk.get("stop"):
                with self._lock:
                    self.timings.append(chunk.get("timings", {}))
                return


def request_ids(j: int, prompt_len: int, eot: int) -> list[int]:
    """Stream j's token ids: ``<|endoftext|>`` (id ``eot``) + ``prompt_len`` ids spread over ids 2..391."""
    return [eot, *(2 + (j * 37 + i * 11) % 390 for i in range(prompt_len))]


def run_concurrency(client, c: int, prompt_len: int, new: int, eot: int) -> dict:
    """C requests at once; each stream read by its own thread. Returns the figures of one run: tokens, wall_s,
    merged (tokens that came in a chunk with the one after them), and the raw latencies in seconds, `ttft` (one
    per stream) and `itl` (consecutive-token gaps within a stream, after its first token). A token that comes in
    the same chunk as the next is stamped at that chunk's arrival. Raises the first error of a stream."""
    results: list[dict] = [{} for _ in range(c)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(c + 1)

    def reader(j: int) -> None:
        ids = request_ids(j, prompt_len, eot)
        barrier.wait()
        t0 = time.perf_counter()
        stamps, merged = [], 0
        try:
            for k in client.stream(ids, new):
                stamps.extend([time.perf_counter()] * k)
                merged += k - 1
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
        results[j] = {"t0": t0, "stamps": stamps, "merged": merged}

    threads = [threading.Thread(target=reader, args=(j,)) for j in range(c)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    tokens = sum(len(r["stamps"]) for r in results)
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    return {"tokens": tokens, "wall_s": wall, "merged": sum(r["merged"] for r in results), "ttft": ttft,
            "itl": itl}


def server_figures(timings: list[dict]) -> dict:
    """llama-server's own figures of one run from its streams' final ``timings``: tokens (predicted_n), wall_s
    (the longest prompt_ms + predicted_ms), TTFT (prompt_ms, s) and per-token seconds (predicted_ms / predicted_n)."""
    return {
        "tokens": sum(int(t.get("predicted_n", 0)) for t in timings),
        "wall_s": max((t.get("prompt_ms", 0.0) + t.get("predicted_ms", 0.0) for t in timings), default=0.0) / 1e3,
        "ttft": [t.get("prompt_ms", float("nan")) / 1e3 for t in timings],
        "per_token": [t["predicted_ms"] / t["predicted_n"] / 1e3 for t in timings if t.get("predicted_n")],
    }


def summarize(c: int, runs: list[dict], servers: list[dict]) -> dict:
    """Pool the runs of one (engine, concurrency): aggregate tokens/s = all tokens / all wall time (beside it each
    round's and their median, with the 1-minute load average at each round's start); ``servers``:
    llama-server's own figures of those runs (server_figures), empty for in-process engines."""
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    ttft = [x for r in runs for x in r["ttft"]]
    itl = [x for r in runs for x in r["itl"]]
    row = {
        "concurrency": c,
        "tokens": tokens,
        "merged": sum(r["merged"] for r in runs),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "rounds_tokens_per_s": [r["tokens"] / r["wall_s"] for r in runs],
        "tokens_per_s_median": timing.median(r["tokens"] / r["wall_s"] for r in runs),
        "rounds_loadavg_1m": [r.get("loadavg_1m", float("nan")) for r in runs],
        "ttft_p50_ms": 1e3 * timing.percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * timing.percentile(ttft, 99),
        "itl_n": len(itl),
        "itl_p50_ms": 1e3 * timing.percentile(itl, 50),
        "itl_p99_ms": 1e3 * timing.percentile(itl, 99),
        "itl_max_ms": 1e3 * max(itl, default=float("nan")),
    }
    if servers:
        s_tokens, s_wall = sum(s["tokens"] for s in servers), sum(s["wall_s"] for s in servers)
        row["server"] = {
            "tokens": s_tokens,
            "wall_s": s_wall,
            "tokens_per_s": s_tokens / s_wall if s_wall else float("nan"),
            "ttft_p50_ms": 1e3 * timing.percentile([x for s in servers for x in s["ttft"]], 50),
            "per_token_p50_ms": 1e3 * timing.percentile([x for s in servers for x in s["per_token"]], 50),
        }
    return row


def fmt(x: float, spec: str = ".2f") -> str:
    return "—" if x != x else format(x, spec)  # NaN → dash


def page_notes(path: Path) -> str | None:
    """The hand-written block of the page ``path`` (the lines between :data:`NOTES_BEGIN` and :data:`NOTES_END`,
    markers included), or None where the page or the block is absent."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    start, end = text.find(NOTES_BEGIN), text.find(NOTES_END)
    return text[start:end + len(NOTES_END)] if 0 <= start < end else None


def write_md(path: Path, meta: dict, rows: list[dict], concurrency: list[int], missing: str | None,
             notes: str | None = None) -> None:
    """The md: the command and conditions of the run, ``notes`` (a hand-written block, :func:`page_notes`) when given,
    the per-cell table, Shalik / llama-server per concurrency, llama-server client vs server side."""
    c0 = concurrency[0]
    conditions = {k: v for k, v in meta.items() if k not in ("command", "cpu", "commit")}
    lines = [
        f"# serve_batching: {meta['shape']}, {meta['threads']} threads, {meta.get('cpu', 'CPU not recorded')}",
        "",
        f"    {meta['command']}" if "command" in meta else "Command: not recorded (a run before pages kept it).",
        "",
        f"Commit {meta.get('commit') or 'not recorded'}. Conditions: `{json.dumps(conditions)}`.",
        "",
        *([notes, ""] if notes else []),
        f"Every lane: the same {meta['prompt'] + 1} "
        f"token ids a stream (`<|endoftext|>` + {meta['prompt']}), {meta['new']} greedy tokens, end-of-text ignored; "
        f"× C={c0}: the figure over the same engine's at concurrency {c0}. ITL: gaps between consecutive tokens of "
        "one stream after its first token, pooled over streams. Shalik's engines are timed in-process, the "
        "`http` lanes and llama-server over HTTP on localhost (SSE chunk arrival times at the client).",
        "",
        "| engine | concurrency | tokens | tokens/s | tokens/s × C=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | ITL p99 × C=1 | ITL max ms | tokens/s by round (load 1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['concurrency']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s_x_c1']:.2f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} | "
            f"{r['itl_p99_ms']:.1f} | {r['itl_p99_x_c1']:.2f} | {r['itl_max_ms']:.1f} | "
            + ", ".join(f"{x:.0f} ({la:.1f})" for x, la in zip(r["rounds_tokens_per_s"], r["rounds_loadavg_1m"],
                                                              strict=True)) + " |"
        )
    cell = {(r["engine"], r["concurrency"]): r for r in rows}
    # a page measured before a quantization was renamed (contract.quant.ALIASES: int8 → q8_0) pairs by today's name
    by_name = {f"{head} {ALIASES.get(kind, kind)}": e for e in dict.fromkeys(k[0] for k in cell)
               for head, _, kind in [e.rpartition(" ")]}
    pairs = [(by_name[a], by_name[b]) for a, b in PEERS.items() if a in by_name and b in by_name]
    if pairs:
        lines += [
            "",
            "## Shalik / llama-server",
            "",
            "Aggregate tokens/s of the Shalik lane over its llama-server lane's: pooled over the rounds (client-side, "
            "as measured), the ratio of the per-round medians, of the best rounds (each lane's least disturbed run), "
            "and the pooled Shalik figure over llama-server's own server-side one. On a shared machine llama-server's "
            "rounds differ the most: its threads meet at a barrier after every op, so one core taken by another "
            "process stalls every step (compare the rounds and their load average in the table above).",
            "",
            "| concurrency | Shalik / llama-server | pooled | median of rounds | best round | over server-side |",
            "|---|---|---|---|---|---|",
        ]
        for c in concurrency:
            for a, b in pairs:
                ra, rb = cell.get((a, c)), cell.get((b, c))
                if ra is None or rb is None:
                    continue
                srv = rb.get("server", {}).get("tokens_per_s", float("nan"))
                lines.append(
                    f"| {c} | {a} / {b} | {ra['tokens_per_s'] / rb['tokens_per_s']:.2f} | "
                    f"{ra['tokens_per_s_median'] / rb['tokens_per_s_median']:.2f} | "
                    f"{max(ra['rounds_tokens_per_s']) / max(rb['rounds_tokens_per_s']):.2f} | "
                    f"{fmt(ra['tokens_per_s'] / srv)} |"
                )
    srv_rows = [r for r in rows if "server" in r]
    if srv_rows:
        lines += [
            "",
            "## llama-server: client side vs its own timings",
            "",
            "Server side from each stream's final `timings`: tokens/s = the cell's tokens / (longest stream's "
            "prompt_ms + predicted_ms), TTFT = prompt_ms, per token = predicted_ms / predicted_n. The gap to the "
            "client side is HTTP, SSE parsing in Python threads and queueing before a slot starts. merged: tokens "
            "llama.cpp held back (incomplete UTF-8) and sent with the next chunk.",
            "",
            "| engine | concurrency | tokens/s client | tokens/s server | client / server | TTFT p50 ms client "
            "| TTFT p50 ms server | ITL p50 ms client | per-token p50 ms server | merged |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in srv_rows:
            s = r["server"]
            lines.append(
                f"| {r['engine']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {fmt(s['tokens_per_s'], '.1f')} | "
                f"{fmt(r['tokens_per_s'] / s['tokens_per_s'])} | {r['ttft_p50_ms']:.1f} | "
                f"{fmt(s['ttft_p50_ms'], '.1f')} | {r['itl_p50_ms']:.1f} | {fmt(s['per_token_p50_ms'], '.1f')} | "
                f"{r['merged']} |"
            )
    if missing:
        lines += ["", f"llama-server: not measured ({missing}): {BUILD_HINT}."]
    atomic_write_text(path, "\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict], threads: int) -> None:
    """Aggregate tokens/s against concurrency, one line per engine (llama-server dashed, Shalik over HTTP dash-dotted), pooled over the rounds,
    with each engine's best round dotted; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in [e for e in ENGINES if any(r["engine"] == e for r in rows)]:
        mine = [r for r in rows if r["engine"] == name]
        (line,) = ax.plot([r["concurrency"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=name,
                          linestyle="--" if lane(name).runtime == "llama" else
                          "-." if name.startswith(HTTP_PREFIX) else "-")
        ax.plot([r["concurrency"] for r in mine], [max(r["rounds_tokens_per_s"]) for r in mine], marker="x",
                linestyle=":", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate completion tokens/s")
    ax.set_title(f"continuous batching, small, {threads} threads (o pooled, x best round)")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=bundles.preset_names())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32, help="prompt ids after <|endoftext|>")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="Engine prefill_chunk (default: the Engine's)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per (engine, concurrency), pooled")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary (default: benchmarks/build_llama_server.sh's build, else PATH)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve_batching")
    ap.add_argument("--replot", action="store_true", help="only rewrite OUT.md and OUT.png from OUT.json")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(args.out.with_suffix(".json").read_text())
        rows = saved["rows"]
        conc = sorted({r["concurrency"] for r in rows})
        md = args.out.with_suffix(".md")
        write_md(md, saved["meta"], rows, conc, saved.get("llama_server_missing"), page_notes(md))
        plot(args.out.with_suffix(".png"), rows, saved["meta"]["threads"])
        return

    binary = args.llama_server or default_llama_server()
    missing = None
    if any(lane(e).runtime == "llama" for e in args.engines):
        if binary is None:
            missing = "no llama-server binary found"
        elif not os.access(binary, os.X_OK):
            missing = f"{binary} is not an executable file"
    engines = [e for e in args.engines if not (missing and lane(e).runtime == "llama")]
    load_start = timing.loadavg()
    rows = []
    chunk = None
    per_slot = -(-(1 + args.prompt + args.new) // 64) * 64  # the context one stream needs, rounded up to 64
    bundle = bundles.init_bundle(args.preset, quantize=lanes.export_quantize(ENGINES[e] for e in engines))
    eot = bundles.eot_id(bundle)
    # rust and onnx: the lane's backend, loaded once; llama: the lane's GGUF, served by a llama-server per cell
    models = {name: bundles.gguf(bundle, lane(name).kind) if lane(name).runtime == "llama"
              else lanes.load(lane(name), bundle, args.threads) for name in engines if not name.startswith(HTTP_PREFIX)}
    with tempfile.TemporaryDirectory() as tmp:

        def open_client(name: str, c: int):
            runtime = lane(name).runtime
            if name.startswith(HTTP_PREFIX):
                return ShalikServer(bundle, lane(name).kind, c, args.threads,
                                    Path(tmp) / f"uvicorn-{lane(name).name}-{c}.log")
            if runtime == "rust":
                return RustClient(models[name].model, c, args.token_budget, args.prefill_chunk)
            if runtime == "llama":
                log = Path(tmp) / f"llama-server-{lane(name).kind}-{c}.log"
                return LlamaServer(binary, models[name], c, args.threads, c * per_slot, log)
            from serve.engine import DEFAULT_PREFILL_CHUNK

            return StepEngineClient(models[name], c, args.token_budget, args.prefill_chunk or DEFAULT_PREFILL_CHUNK)

        # rounds outermost, then concurrency, then engine: load from other jobs spreads over every cell alike
        runs: dict[tuple[str, int], list[dict]] = {(name, c): [] for c in args.concurrency for name in engines}
        servers: dict[tuple[str, int], list[dict]] = {(name, c): [] for c in args.concurrency for name in engines}
        for rnd in range(args.rounds):
            for c in args.concurrency:
                for name in engines:
                    client = open_client(name, c)
                    load1 = (timing.loadavg() or [float("nan")])[0]
                    try:
                        chunk = getattr(client, "prefill_chunk", chunk)
                        run_concurrency(client, 1, 4, 2, eot)  # warm-up
                        if isinstance(client, LlamaServer):
                            client.timings.clear()
                        r = run_concurrency(client, c, args.prompt, args.new, eot)
                        if isinstance(client, LlamaServer):
                            servers[(name, c)].append(server_figures(client.timings))
                    finally:
                        client.close()
                    r["loadavg_1m"] = float(load1)
                    runs[(name, c)].append(r)
                    short = "" if r["tokens"] == c * args.new else f"  ({r['tokens']} tokens, expected {c * args.new})"
                    print(f"round {rnd} {name:17s} C={c:2d}: {r['tokens'] / r['wall_s']:7.1f} tok/s{short}", flush=True)
        for c in args.concurrency:
            for name in engines:
                r = summarize(c, runs[(name, c)], servers[(name, c)])
                r["engine"] = name
                rows.append(r)
                print(
                    f"{name:17s} C={c:2d}: {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                    f"ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms",
                    flush=True,
                )
    meta = {
        "command": shlex.join(["python", "benchmarks/serve_batching.py", *sys.argv[1:]]),
        "cpu": timing.cpu_name(),
        "commit": timing.git_commit(),
        "threads": args.threads,
        "prompt": args.prompt,
        "new": args.new,
        "shape": args.preset,
        "bundle": timing.relative(bundle),
        "token_budget": args.token_budget,
        "prefill_chunk": chunk,
        "rounds": args.rounds,
        "llama_server_ctx_per_slot": per_slot,
        "loadavg_start": load_start,
        "loadavg_end": timing.loadavg(),
    }
    for r in rows:
        base = next(x for x in rows if x["engine"] == r["engine"] and x["concurrency"] == args.concurrency[0])
        r["tokens_per_s_x_c1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["itl_p99_x_c1"] = r["itl_p99_ms"] / base["itl_p99_ms"]
    atomic_write_json(args.out.with_suffix(".json"), {"meta": meta, "rows": rows, "llama_server_missing": missing})
    write_md(args.out.with_suffix(".md"), meta, rows, args.concurrency, missing)
    plot(args.out.with_suffix(".png"), rows, args.threads)


if __name__ == "__main__":
    main()
