"""Continuous batching in rust_runtime.Engine: aggregate completion tokens/s, time to first token (TTFT) and
inter-token latency (ITL p50/p99) at 1, 2, 4, 8, 16 and 32 concurrent streams, each as a ratio to one stream.

ITL is the gap between consecutive tokens of one stream, from its first token on (the wait for the first token
is TTFT, not ITL), pooled over the streams of a run (and over --rounds runs).

Builds the random-init `small` model of benchmarks/rust_decode.py in a temporary folder, then for each engine
(rust f32, rust int8 = q8_0) and each concurrency C, submits C requests at once (same prompt length and
max_tokens, greedy; a stream may end early at end-of-text, so the tokens actually produced are counted) to an Engine with max_batch = C, each stream read by a
Python thread of its own. Runs are interleaved (each round: every concurrency, every engine) so that load from
other jobs hits every cell alike; tokens/s pools a cell's rounds (all tokens / all wall time). Writes benchmarks/results/serve_batching.{json,md,png}.

    python benchmarks/serve_batching.py [--threads 2] [--prompt 32] [--new 64] [--concurrency 1 2 4 8 16 32]
        [--rounds 1] [--token-budget 256] [--prefill-chunk N] [--engines "rust f32" "rust int8"]

``onnx f32``: serve's own engine (serve.engine.StepEngine, the Python scheduler the onnx backend serves through)
over onnxruntime with OnnxBackend.decode_batch, on the `small` graph of benchmarks/onnx_batching.py (same shape,
other random weights), with the same max_batch / token_budget / prefill_chunk.

Not here: llama.cpp's llama-server (no build at hand; building it from the llama-cpp-python sdist takes 40+ minutes
on these 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_benchmark(name: str):
    """benchmarks/ is not a package: load one of its scripts (e.g. rust_decode.py: the `small` shape and its bundle
    builder) by path."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class StepEngineClient:
    """serve.engine.StepEngine behind rust_runtime.Engine's ``submit(...)`` → event tuples and ``close()``."""

    def __init__(self, backend, max_batch: int, token_budget: int, prefill_chunk: int):
        from serve.engine import StepEngine

        self.engine = StepEngine(backend, eot_id=0, max_batch=max_batch, token_budget=token_budget,
                                 prefill_chunk=prefill_chunk)

    def submit(self, prompt, new, temperature=0.0):
        from serve.sampling import SamplingParams

        sub = self.engine.submit([0, *prompt], new, SamplingParams(temperature=temperature))
        return ((0, e.token, e.logprob, e.top, None if e.token is not None and e.finish is None else e.finish or "end")
                for e in sub.events(0))

    def close(self) -> None:
        self.engine.close()


def loadavg() -> list[str]:
    """The 1, 5 and 15 minute load averages (empty where /proc/loadavg is missing)."""
    p = Path("/proc/loadavg")
    return p.read_text().split()[:3] if p.exists() else []


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_concurrency(engine, c: int, prompt_len: int, new: int) -> dict:
    """C requests at once; each stream read by its own thread. Returns the figures of one run: tokens, wall_s,
    and the raw latencies in seconds, `ttft` (one per stream) and `itl` (consecutive-token gaps within a stream,
    after its first token)."""
    results: list[dict] = [{} for _ in range(c)]
    barrier = threading.Barrier(c + 1)

    def client(j: int) -> None:
        prompt = [2 + (j * 37 + i * 11) % 390 for i in range(prompt_len)]
        barrier.wait()
        t0 = time.perf_counter()
        stamps = []
        for _index, _tok, _lp, _top, finish in engine.submit(prompt, new, temperature=0.0):
            if finish is None:
                stamps.append(time.perf_counter())
        results[j] = {"t0": t0, "stamps": stamps}

    threads = [threading.Thread(target=client, args=(j,)) for j in range(c)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(len(r["stamps"]) for r in results)
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    return {"tokens": tokens, "wall_s": wall, "ttft": ttft, "itl": itl}


def summarize(c: int, runs: list[dict]) -> dict:
    """Pool the runs of one (engine, concurrency): aggregate tokens/s = all tokens / all wall time."""
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    ttft = [x for r in runs for x in r["ttft"]]
    itl = [x for r in runs for x in r["itl"]]
    return {
        "concurrency": c,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_n": len(itl),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "itl_max_ms": 1e3 * max(itl, default=float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="Engine prefill_chunk (default: the Engine's)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per (engine, concurrency), pooled")
    ap.add_argument("--engines", nargs="+", default=["rust f32", "rust int8", "onnx f32"],
                    choices=["rust f32", "rust int8", "onnx f32"])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve_batching")
    args = ap.parse_args()

    import rust_runtime

    load_start = loadavg()
    rd = load_benchmark("rust_decode")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        rd.build_bundle(bundle, "small")
        quant = {"rust f32": None, "rust int8": "int8"}
        models = {
            name: rust_runtime.Model.load(str(bundle), threads=args.threads, quantize=quant[name])
            for name in args.engines if name in quant
        }
        if "onnx f32" in args.engines:
            from serve.backends.onnx import OnnxBackend
            from serve.engine import DEFAULT_PREFILL_CHUNK

            onnx_dir = Path(tmp) / "onnx"
            load_benchmark("onnx_batching").build_bundle(onnx_dir, int8=False)
            models["onnx f32"] = OnnxBackend(onnx_dir, threads=args.threads)
        kw = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
        chunk = None
        # rounds outermost, then concurrency, then engine: load from other jobs spreads over every cell alike
        runs: dict[tuple[str, int], list[dict]] = {(name, c): [] for c in args.concurrency for name in models}
        for rnd in range(args.rounds):
            for c in args.concurrency:
                for name, model in models.items():
                    if name == "onnx f32":
                        eng = StepEngineClient(model, c, args.token_budget, args.prefill_chunk or DEFAULT_PREFILL_CHUNK)
                    else:
                        eng = rust_runtime.Engine(model, max_batch=c, token_budget=args.token_budget, **kw)
                        chunk = eng.prefill_chunk
                    run_concurrency(eng, 1, 4, 2)  # warm-up
                    r = run_concurrency(eng, c, args.prompt, args.new)
                    eng.close()
                    runs[(name, c)].append(r)
                    print(f"round {rnd} {name:10s} C={c:2d}: {r['tokens'] / r['wall_s']:7.1f} tok/s", flush=True)
        for c in args.concurrency:
            for name in models:
                r = summarize(c, runs[(name, c)])
                r["engine"] = name
                rows.append(r)
                print(
                    f"{name:10s} C={c:2d}: {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                    f"ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms",
                    flush=True,
                )
    meta = {
        "threads": args.threads,
        "prompt": args.prompt,
        "new": args.new,
        "shape": "small",
        "token_budget": args.token_budget,
        "prefill_chunk": chunk,
        "rounds": args.rounds,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
    }
    for r in rows:
        base = next(x for x in rows if x["engine"] == r["engine"] and x["concurrency"] == args.concurrency[0])
        r["tokens_per_s_x_c1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["itl_p99_x_c1"] = r["itl_p99_ms"] / base["itl_p99_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"# serve_batching ({meta})",
        "",
        f"× C={args.concurrency[0]}: the figure over the same engine's at concurrency {args.concurrency[0]}. "
        "ITL: gaps between consecutive tokens of one stream after its first token, pooled over streams.",
        "",
        "| engine | concurrency | tokens/s | tokens/s × C=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| ITL p99 × C=1 | ITL max ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s_x_c1']:.2f} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
            f"{r['itl_p99_x_c1']:.2f} | {r['itl_max_ms']:.1f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["engine"] for r in rows}):
        pts = [(r["concurrency"], r["tokens_per_s"]) for r in rows if r["engine"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate completion tokens/s")
    ax.set_title(f"rust_runtime.Engine, small, {args.threads} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
