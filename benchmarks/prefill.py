"""Batch-1 prefill of the base-400m shape: Rust f32 against onnxruntime fp32, beside the compute roofline.

    python benchmarks/prefill.py [--preset base-400m] [--kind f32|q8_0|q4_0|q4_mix] [--tokens 64 512] [--threads 2]
                                 [--rounds 4] [--out benchmarks/results]

The model is ``runs/PRESET-init/bundle``, the untrained twin of ``configs/PRESET.toml`` made by ``train.run`` and
``export.onnx`` when absent (benchmarks/bundles.py; base-400m: 10–20 minutes once, then reused). The pair of lanes
(benchmarks/lanes.py) is ``PAIRS[--kind]``: rust f32 against onnxruntime fp32, or with ``--kind q8_0`` Rust q8_0
(``quantize="q8_0"``) against onnxruntime q8_0 (the bundle's model.q8_0.onnx: export.quantize's MatMulNBits
holding the same q8_0 blocks), written to prefill_q8_0.json / .md (prefill_int8.* hold the figures of the old
per-channel graph); ``--kind q4_0`` / ``q4_mix``: Rust at those 4-bit
kinds against the same onnxruntime q8_0 graph (the issue's target for 4 bits). Each lane runs as serving runs it, in its own
worker process (its own thread pool; the worker sleeps on a pipe while the other measures) with ``--threads``
threads: ``new_sequence().prefill(ids)`` of serve's RustBackend and OnnxBackend (the bundle's graph with its
attention mask, every ``present.*`` fetched, logits at every position as model.onnx returns them; no spinning
between calls). After a warm-up prefill at every length, rounds run A B A B (per length, the order rotated every
round, each prefill after the quiet pause of benchmarks/timing.py so that the other engine's idle threads have
stopped spinning); reported are medians over rounds and the median of per-round ratios ORT ms / Rust ms (> 1:
Rust faster).

Memory: the Rust worker's ``VmHWM`` right after loading (peak at load: the safetensors pages are read, packed once
into the panels that prefill and decode share, and dropped) against its ``VmRSS`` after the timed prefills
(steady), both in MB, beside those of a bare ``python -c 'import numpy'``.

Roofline (benchmarks/roofline.py). FLOPs of one prefill of T tokens = 2 · P · T (P = the weights of every layer's
matmuls) + 2 · V · H (the lm_head, last position only) + 4 · L · H · T(T+1)/2 (causal QKᵀ and PV); the ONNX graph
also runs the lm_head on the other T − 1 positions (2 · V · H · (T − 1) more, counted apart). The peak is measured
in the same run: numpy (OpenBLAS) float32 ``matmul`` of 2048 × 2048 matrices with ``--threads`` BLAS threads, best
of several, in a fresh process, before and after the rounds (on a loaded machine it lands far below the
hardware), and stated: cores × FLOP a cycle × clock. Share = achieved GFLOP/s ÷ the highest of these.

Writes ``--out``/prefill.json and prefill.md (prefill_KIND.* for another kind). Times are wall-clock on a machine
shared with other jobs (load average before/after is recorded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bundles, lanes, roofline, timing  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from contract.bundle import CONFIG  # noqa: E402

# kind → (Rust lane, onnxruntime lane): the lanes compared at that quantization kind
PAIRS = {"f32": ("rust-f32", "ort-fp32"), "q8_0": ("rust-q8_0", "ort-q8_0"), "q4_0": ("rust-q4_0", "ort-q8_0"),
         "q4_mix": ("rust-q4_mix", "ort-q8_0")}
ROLES = ("rust", "ort")  # the keys of each pair's lanes in the results


def prompt_ids(n: int) -> list[int]:
    """n token ids in [2, 30002), spread over the vocabulary (every preset's is 32,000)."""
    return [(7 * i + 3) % 30000 + 2 for i in range(n)]


# ---------------------------------------------------------------- worker side

def worker(a: argparse.Namespace) -> int:
    """``--worker LANE``: load, report RSS, then answer each request ``T`` with {"ms": prefill ms of T ids}."""
    channel = timing.Channel()
    t0 = time.perf_counter()
    backend = lanes.load(lanes.LANES[a.worker], a.bundle, a.threads)
    channel.send({"load_s": time.perf_counter() - t0, "peak_rss_mb_load": timing.rss_mb(),
                  "rss_mb_load": timing.rss_mb("VmRSS")})
    for request in channel.requests():
        ids = prompt_ids(int(request))
        t = time.perf_counter()
        backend.new_sequence().prefill(ids)
        ms = (time.perf_counter() - t) * 1e3
        channel.send({"ms": ms, "rss_mb": timing.rss_mb("VmRSS"), "peak_rss_mb": timing.rss_mb()})
    return 0


# ---------------------------------------------------------------- orchestrator

def write_md(res: dict, path: Path) -> None:
    r = res
    pair = " vs ".join(lanes.LANES[name].label for name in r["lanes"].values())
    extra_gf = 2 * r["vocab_size"] * r["hidden_size"] / 1e9  # the lm_head on one more position, GFLOP
    longest = r["results"][-1]
    lines = [
        f"# Prefill, {r['shape']} (batch 1, {r['threads']} threads): {pair}",
        "",
        f"`{r['command']}` — {r['rounds']} rounds (A B A B, order swapped each round), medians. "
        f"Load average before {r['loadavg_before']}, after {r['loadavg_after']} (2 cores, shared). "
        f"simd: {r['simd']}. Peak (numpy float32 2048³ matmul, {r['threads']} threads): "
        f"{r['peak_gflops_before']:.1f} GFLOP/s before, {r['peak_gflops_after']:.1f} after; stated peak {r['threads']} cores × {r['flop_per_cycle']} FLOP/cycle × "
        f"{r['clock_ghz']:.2f} GHz = "
        f"{r['stated_peak_gflops']:.0f} GFLOP/s. The ONNX graph also computes the logits of the T − 1 earlier "
        f"positions ({extra_gf:.3f} GFLOP each: +{extra_gf * (longest['tokens'] - 1) / longest['gflop']:.0%} at "
        f"{longest['tokens']} tokens), counted in neither GFLOP/s column.",
        "",
        "| tokens | GFLOP | Rust ms | ORT ms | ORT/Rust (median of rounds) | Rust GFLOP/s (% of peak) "
        "| ORT GFLOP/s (% of peak) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if r["kind"] != "f32":
        lines[2] += (" GFLOP/s counts the same FLOPs as f32, and % of peak is of the f32 peak: integer dot products "
                     "(VNNI) can exceed it.")
    for row in r["results"]:
        lines.append(
            f"| {row['tokens']} | {row['gflop']:.1f} | {row['rust_ms']:.0f} | {row['ort_ms']:.0f} "
            f"| **{row['ratio_ort_over_rust']:.2f}×** | {row['rust_gflops']:.1f} ({row['rust_share']:.0%}) "
            f"| {row['ort_gflops']:.1f} ({row['ort_share']:.0%}) |"
        )
    m = r["memory"]
    lines += [
        "",
        f"Rust process memory: peak RSS at load (VmHWM after `Model.load`) {m['rust_peak_rss_mb_load']:.0f} MB, "
        f"steady RSS after the timed prefills {m['rust_rss_mb_steady']:.0f} MB (peak over the whole run "
        f"{m['rust_peak_rss_mb_end']:.0f} MB); fp32 weights {m['weights_mb']:.0f} MB; a bare "
        f"`python -c 'import numpy'` {m['bare_numpy_rss_mb']:.0f} MB. ORT worker: {m['ort_peak_rss_mb_load']:.0f} MB "
        f"peak at load, {m['ort_rss_mb_steady']:.0f} MB steady.",
        "",
        "Per-round ms (Rust, ORT): "
        + "; ".join(f"{row['tokens']} tok: {row['rust_ms_rounds']} / {row['ort_ms_rounds']}" for row in r["results"]),
        "",
    ]
    atomic_write_text(path, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base-400m", choices=bundles.preset_names())
    ap.add_argument("--kind", default="f32", choices=list(PAIRS),
                    help="f32: rust f32 vs onnxruntime fp32; q8_0 / q4_0 / q4_mix: Rust at that kind vs "
                         "onnxruntime's q8_0 graph (writes prefill_KIND.json/.md)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--worker", choices=list(lanes.LANES), help=argparse.SUPPRESS)
    ap.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        sys.exit(worker(a))
    ctx = bundles.shape(a.preset)["max_position_embeddings"]
    if min(a.tokens) < 1 or max(a.tokens) > ctx:
        sys.exit(f"--tokens must lie in 1..{ctx} (the context of {a.preset}), got {a.tokens}")
    import rust_runtime

    command = "python benchmarks/prefill.py " + " ".join(sys.argv[1:])
    load_before = timing.loadavg()
    bundle = bundles.init_bundle(a.preset, quantize=lanes.export_quantize(PAIRS[a.kind]))
    shape = json.loads((bundle / CONFIG).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        peak0 = roofline.matmul_peak_gflops(a.threads)
        workers = {role: timing.Worker(lane, "benchmarks.prefill",
                                       ["--worker", lane, "--bundle", str(bundle), "--threads", str(a.threads)],
                                       Path(tmp) / f"{role}.log", a.threads)
                   for role, lane in zip(ROLES, PAIRS[a.kind], strict=True)}
        for role, w in workers.items():
            print(f"{role} ({w.name}) loaded: {w.ready}", flush=True)
        try:
            for n in a.tokens:  # warm-up, dropped
                for w in workers.values():
                    w.ask(str(n))
            ms = {(k, n): [] for k in workers for n in a.tokens}
            last: dict = {}
            for r in range(a.rounds):
                for n in a.tokens:
                    for k in timing.rotated(ROLES, r):
                        timing.quiet()  # the other worker's idle threads may still spin
                        last[k] = workers[k].ask(str(n))
                        ms[(k, n)].append(last[k]["ms"])
                print(f"round {r + 1}: " + ", ".join(f"{k} {n}: {v[-1]:.0f} ms" for (k, n), v in ms.items()),
                      flush=True)
        finally:
            for w in workers.values():
                w.close()
        peak1 = roofline.matmul_peak_gflops(a.threads)
    avx512 = "512" in str(rust_runtime.simd_level)
    stated = roofline.stated_peak_gflops(a.threads, avx512)
    peak = max(peak0, peak1, stated[1])
    rows = []
    for n in a.tokens:
        gf = roofline.prefill_gflop(shape, n)
        rust, ort_ = ms[("rust", n)], ms[("ort", n)]
        rm, om = timing.median(rust), timing.median(ort_)
        rows.append(dict(
            tokens=n, gflop=gf, rust_ms=rm, ort_ms=om, ratio_ort_over_rust=timing.median_ratio(ort_, rust),
            rust_gflops=gf / rm * 1e3, ort_gflops=gf / om * 1e3,
            rust_share=gf / rm * 1e3 / peak, ort_share=gf / om * 1e3 / peak,
            rust_ms_rounds=[round(x) for x in rust], ort_ms_rounds=[round(x) for x in ort_],
        ))
    params = shape["vocab_size"] * shape["hidden_size"] + roofline.layer_matmul_weights(shape)  # tied: one V × H
    res = dict(
        shape=a.preset, bundle=timing.relative(bundle), lanes=dict(zip(ROLES, PAIRS[a.kind], strict=True)),
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        threads=a.threads, rounds=a.rounds, command=command, kind=a.kind,
        loadavg_before=load_before, loadavg_after=timing.loadavg(), simd=str(rust_runtime.simd_level),
        peak_gflops_before=peak0, peak_gflops_after=peak1, clock_ghz=stated[0], stated_peak_gflops=stated[1],
        flop_per_cycle=roofline.flop_per_cycle(avx512), results=rows,
        memory=dict(
            rust_peak_rss_mb_load=workers["rust"].ready["peak_rss_mb_load"],
            rust_rss_mb_steady=last["rust"]["rss_mb"], rust_peak_rss_mb_end=last["rust"]["peak_rss_mb"],
            ort_peak_rss_mb_load=workers["ort"].ready["peak_rss_mb_load"], ort_rss_mb_steady=last["ort"]["rss_mb"],
            weights_mb=params * 4 / 1e6, bare_numpy_rss_mb=timing.bare_python_rss_mb(),
        ),
    )
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "prefill" if a.kind == "f32" else f"prefill_{a.kind}"
    atomic_write_json(a.out / f"{stem}.json", res)
    write_md(res, a.out / f"{stem}.md")
    print((a.out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
