"""HTTP load test of ``uvicorn serve.app:app`` on loopback: latency, throughput, errors, lost requests, and
an overload run that must answer 429 at once instead of timing out.

    python benchmarks/serve_load.py [BUNDLE] [--clients 32] [--requests 256] [--max-tokens 16]
                                    [--backend onnx] [--concurrency 2] [--out benchmarks/results]

Starts its own server (a subprocess; BUNDLE defaults to the newest ``runs/*/bundle``) for each run:

1. **normal**: ``--clients`` concurrent clients send ``--requests`` completions in all, alternating streaming
   and non-streaming, seeded sampling, with ``SHALIK_MAX_QUEUE`` sized for the load (clients). Reports
   p50/p99 latency (request → last byte), streamed time to first token, throughput (requests/s and
   completion tokens/s), errors (any non-200 or exception) and lost requests (no complete answer: a
   non-streamed body without choices, a stream without ``data: [DONE]``). Target: zero of both.
2. **overload**: ``SHALIK_MAX_CONCURRENCY=1``, ``SHALIK_MAX_QUEUE=2``; ``--clients`` clients open their
   connections, then all send one ``--overload-tokens`` completion at the same moment.
   The ones that do not fit must get 429 (with Retry-After) within milliseconds, never a timeout.

Writes ``serve_load.md`` and ``serve_load.json`` to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import bundles, timing  # noqa: E402
from benchmarks.common import free_port  # noqa: E402

PROMPTS = ["বাংলা ভাষা", "আমি বাংলায় গান গাই", "The river", "Once upon a time", "কলকাতা শহরের", "In the morning"]


@contextmanager
def server(bundle: Path, backend: str, **env_settings: int):
    """A uvicorn subprocess serving ``bundle``; yields its base URL; stops it afterwards."""
    port = free_port()
    env = {**os.environ, "SHALIK_MODEL": str(bundle), "SHALIK_BACKEND": backend,
           **{f"SHALIK_{k.upper()}": str(v) for k, v in env_settings.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with status {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit("the server did not become healthy within 120 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(client: httpx.AsyncClient, url: str, i: int, stream: bool, max_tokens: int) -> dict:
    """Send request ``i``; returns {status, seconds, ttft, tokens, complete, error}."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    t0 = time.perf_counter()
    out = {"stream": stream, "status": None, "ttft": None, "tokens": 0, "complete": False, "error": None}
    try:
        if stream:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - t0
                    if line == "data: [DONE]":
                        out["complete"] = True
                    else:
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            out["tokens"] = usage["completion_tokens"]
        else:
            r = await client.post(f"{url}/v1/completions", json=body)
            out["status"] = r.status_code
            if r.status_code == 200:
                data = r.json()
                out["complete"] = bool(data.get("choices"))
                out["tokens"] = data["usage"]["completion_tokens"]
            out["retry_after"] = r.headers.get("retry-after")
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - t0
    return out


async def drive(url: str, clients: int, requests: int, max_tokens: int, mixed: bool = True,
                together: bool = False) -> tuple[list[dict], float]:
    """``clients`` workers share ``requests`` requests; returns the results and the wall time. ``together``:
    every worker first opens its connection (GET /health), then all send at the same moment."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    ready, go = asyncio.Semaphore(0), asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def worker() -> None:
            if together:
                await client.get(f"{url}/health")
                ready.release()
                await go.wait()
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, url, i, mixed and i % 2 == 1, max_tokens))

        tasks = [asyncio.create_task(worker()) for _ in range(clients)]
        if together:
            for _ in range(clients):
                await ready.acquire()
        t0 = time.perf_counter()
        go.set()
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["complete"] and not r["error"]]
    lat = [r["seconds"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["stream"] and r["ttft"] is not None]
    codes: dict[str, int] = {}
    for r in results:
        key = str(r["status"] or r["error"].split(":")[0])
        codes[key] = codes.get(key, 0) + 1
    rejected = [r for r in results if r["status"] == 429]
    return {
        "requests": len(results), "ok": len(ok), "status_counts": codes,
        "errors": sum(1 for r in results if r["error"] or (r["status"] not in (200, 429))),
        "lost": sum(1 for r in results if r["status"] == 200 and not r["complete"]),
        "timeouts": sum(1 for r in results if r["error"] and "Timeout" in r["error"]),
        "rejected_429": len(rejected),
        "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "max_s": max(lat) if lat else None,
        "stream_ttft_p50_s": pct(ttft, 50), "stream_ttft_p99_s": pct(ttft, 99),
        "reject_p50_ms": 1000 * pct([r["seconds"] for r in rejected], 50) if rejected else None,
        "reject_max_ms": 1000 * max(r["seconds"] for r in rejected) if rejected else None,
        "wall_s": wall, "requests_per_s": len(ok) / wall,
        "completion_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "retry_after": sorted({r.get("retry_after") for r in rejected if r.get("retry_after")}),
    }


def fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "—" if x is None else f"{x * scale:.{digits}f}"


def markdown(res: dict) -> str:
    m, n, o = res["meta"], res["normal"], res["overload"]
    return "\n".join([
        f"# HTTP load test — `{m['bundle']}` ({m['backend']})", "",
        f"Loopback, uvicorn, {m['machine']}, load average at start {m['loadavg']}. Completions of "
        f"{m['max_tokens']} tokens, seeded sampling, alternating streamed / not.", "",
        "| run | clients | requests | ok | errors | lost | 429 | p50 (s) | p99 (s) | stream TTFT p50 (s) | req/s | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| normal (concurrency {m['concurrency']}, queue {m['clients']}) | {m['clients']} | {n['requests']} | {n['ok']} | "
        f"{n['errors']} | {n['lost']} | {n['rejected_429']} | {fmt(n['p50_s'])} | {fmt(n['p99_s'])} | "
        f"{fmt(n['stream_ttft_p50_s'])} | {n['requests_per_s']:.1f} | {n['completion_tokens_per_s']:.0f} |",
        f"| overload (concurrency 1, queue 2) | {m['clients']} | {o['requests']} | {o['ok']} | {o['errors']} | "
        f"{o['lost']} | {o['rejected_429']} | {fmt(o['p50_s'])} | {fmt(o['p99_s'])} | "
        f"{fmt(o['stream_ttft_p50_s'])} | {o['requests_per_s']:.1f} | {o['completion_tokens_per_s']:.0f} |",
        "",
        f"Overload: {o['rejected_429']} requests refused with 429 (Retry-After {', '.join(o['retry_after']) or '—'}) "
        f"in {fmt(o['reject_p50_ms'], digits=1)} ms median, {fmt(o['reject_max_ms'], digits=1)} ms at most; "
        f"{o['timeouts']} timeouts.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bundle", nargs="?", default=None, help="bundle folder (default: newest runs/*/bundle)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--overload-tokens", type=int, default=64, help="max_tokens of the overload run's requests")
    p.add_argument("--backend", choices=["onnx", "rust"], default="onnx")
    p.add_argument("--concurrency", type=int, default=2, help="SHALIK_MAX_CONCURRENCY of the normal run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    bundle = bundles.given_or_newest(args.bundle)
    meta = {"bundle": timing.relative(bundle), "backend": args.backend, "clients": args.clients,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "loadavg": ", ".join(f"{x:.1f}" for x in timing.loadavg()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"}
    with server(bundle, args.backend, max_concurrency=args.concurrency, max_queue=args.clients) as url:
        normal = summarize(*asyncio.run(drive(url, args.clients, args.requests, args.max_tokens)))
    with server(bundle, args.backend, max_concurrency=1, max_queue=2) as url:
        overload = summarize(*asyncio.run(drive(url, args.clients, args.clients, args.overload_tokens, mixed=False,
                                                together=True)))
    res = {"meta": meta, "normal": normal, "overload": overload}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_load.json").write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    (args.out / "serve_load.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if normal["errors"] == normal["lost"] == 0 and overload["timeouts"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
