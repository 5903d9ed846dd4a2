"""The throughput cost of batch invariance: rust_runtime's packed f32 matmul against peers that are not invariant.

    python benchmarks/batch_invariance_cost.py [--threads 2] [--rounds 5] [--ms 1 16 64 512]
                                               [--shapes small base-400m] [--out benchmarks/results]

Shapes: the linears of the presets of configs/ as the Rust model runs them (y = x · Wᵀ, W out × in;
benchmarks/roofline.py's ``linears``):
hidden → qkv (q, k, v fused), hidden → 2·intermediate (gate and up fused), intermediate → hidden (down) and
hidden → vocab (lm_head), at m = 1 and 16 rows (a decode step of 1 and 16 sequences) and 64, 512 (prefill).

Kernels, each on ``--threads`` threads, x and W float32 from a fixed seed:
  * packed: the serving matmul (``rust_runtime/examples/bench_matmul.rs packed``, which cargo builds on first use,
    W packed once before the timing): every output element is the same fma chain over k in order, whatever m and
    the thread split;
  * gemm: the gemm crate as candle's f32 matmul calls it (``bench_matmul gemm``), in a rayon pool of the same size;
  * numpy: OpenBLAS, ``np.matmul(x, W.T, out=y)`` (BLAS threads = ``--threads``; the script re-executes itself
    with OPENBLAS_NUM_THREADS set, since OpenBLAS reads it once at import).
The peers choose kernels, blocking and threading by shape, so a row's result may change with m: shown by
max |Δ| between row 0 of the m-row product and the 1-row product of the same x row (packed: 0 by construction).

Timing: for each (shape, m) the three kernels run in turn, the order rotated every round (interleaved), each a
warm-up call (two for the Rust kernels, whose hook starts a fresh pool each time: dropped) then ``repeats`` calls
sized to about 40 ms, each kernel after a 0.5 s pause (OpenBLAS's idle threads spin for about 0.1 s after a call and
would take a core from the next kernel); reported are medians over rounds of the mean
time a call, medians over rounds of the ratios packed / peer and packed / the faster peer of that round (> 1: the
invariant kernel is slower, the cost of invariance) and GFLOP/s
beside the physical limit: cores × 64 FLOP/cycle (two 512-bit FMA pipes) × the clock /proc/cpuinfo states, and
numpy's measured 2048³ float32 GEMM (benchmarks/roofline.py). Times are wall-clock on a shared machine:
the load average before and after is recorded. Writes ``--out``/batch_invariance_cost.json and .md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bundles, roofline, timing  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402

KERNELS = ("packed", "gemm", "numpy")
PEERS = ("gemm", "numpy")
TIMED = ("hidden→qkv", "hidden→2·intermediate", "intermediate→hidden", "hidden→vocab")  # of roofline.linears


def linears(shape: dict) -> list[tuple[str, int, int]]:
    """(name, out, in) of the matmuls of one preset that are timed (:data:`TIMED`), fused as rust_runtime's model
    fuses them."""
    return [lin for lin in roofline.linears(shape) if lin[0] in TIMED]


WARMUP = 2  # untimed calls before a Rust kernel's timed ones (see time_kernel)


def time_kernel(kernel: str, w, x, threads: int, repeats: int):
    """(y float32 [m, out], seconds a call): one warm-up call, then the mean of ``repeats`` calls."""
    import numpy as np

    if kernel == "numpy":
        wt = w.T
        y = np.empty((x.shape[0], w.shape[0]), np.float32)
        np.matmul(x, wt, out=y)
        t = time.perf_counter()
        for _ in range(repeats):
            np.matmul(x, wt, out=y)
        return y, (time.perf_counter() - t) / repeats
    # each call starts a fresh pool: its first two calls fault in the threads' scratch (one per pool thread), so
    # both are dropped, as numpy's warm-up call above is
    y, secs = bench_matmul(w, x, threads=threads, repeats=repeats + WARMUP, kernel=kernel)
    return y, sum(secs[WARMUP:]) / repeats


_BENCH_MATMUL: list[Path] = []  # the built example, once per process


def bench_matmul(w, x, threads: int, repeats: int, kernel: str):
    """rust_runtime/examples/bench_matmul.rs (built with cargo here, with the caller's RUSTFLAGS, on first use):
    y = x · wᵀ ``repeats`` times with ``kernel``; returns (y float32 [m, out], the seconds of each repeat)."""
    import json
    import subprocess
    import tempfile

    import numpy as np

    crate = ROOT / "rust_runtime"
    if not _BENCH_MATMUL:
        subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "bench_matmul"], cwd=crate,
                       check=True)
        _BENCH_MATMUL.append(crate / "target" / "release" / "examples" / "bench_matmul")
    with tempfile.TemporaryDirectory() as tmp:
        wf, xf, yf = (Path(tmp) / n for n in ("w.f32", "x.f32", "y.f32"))
        np.ascontiguousarray(w, np.float32).tofile(wf)
        np.ascontiguousarray(x, np.float32).tofile(xf)
        (out, inp), m = w.shape, x.shape[0]
        res = subprocess.run([str(_BENCH_MATMUL[0]), kernel, str(threads), str(repeats), str(wf), str(out), str(inp),
                              str(xf), str(m), str(yf)], check=True, capture_output=True, text=True)
        return np.fromfile(yf, np.float32).reshape(m, out), json.loads(res.stdout)


def measure(a: argparse.Namespace) -> dict:
    import numpy as np

    import rust_runtime

    load_before = timing.loadavg()
    peak0 = roofline.matmul_peak_gflops(a.threads)
    rng = np.random.default_rng(0)
    rows = []
    for shape_name in a.shapes:
        for name, out, inp in linears(bundles.shape(shape_name)):
            w = (rng.standard_normal((out, inp), np.float32) / math.sqrt(inp)).astype(np.float32)
            xall = rng.standard_normal((max(a.ms), inp), np.float32)
            alone = {k: time_kernel(k, w, xall[:1], a.threads, 1)[0][0] for k in KERNELS}
            for m in a.ms:
                x = np.ascontiguousarray(xall[:m])
                flop = 2 * m * out * inp
                # about 40 ms a measurement, judged from a 100 GFLOP/s kernel
                repeats = max(1, min(2000, round(0.04 / (flop / 100e9))))
                secs: dict[str, list[float]] = {k: [] for k in KERNELS}
                delta: dict[str, float] = {}
                for r in range(a.rounds):
                    for k in timing.rotated(KERNELS, r):
                        timing.quiet()  # let the previous kernel's threads go idle
                        y, s = time_kernel(k, w, x, a.threads, repeats)
                        secs[k].append(s)
                        delta[k] = float(np.max(np.abs(y[0] - alone[k])))
                med = {k: timing.median(v) for k, v in secs.items()}
                row = dict(shape=shape_name, linear=name, out=out, inp=inp, m=m, repeats=repeats,
                           us={k: med[k] * 1e6 for k in KERNELS},
                           gflops={k: flop / med[k] / 1e9 for k in KERNELS},
                           ratio={p: timing.median_ratio(secs["packed"], secs[p]) for p in PEERS},
                           max_abs_delta_row0=delta, us_rounds={k: [round(s * 1e6, 1) for s in v]
                                                                 for k, v in secs.items()})
                row["ratio_best_peer"] = timing.median_ratio(
                    secs["packed"], [min(secs[p][i] for p in PEERS) for i in range(a.rounds)])
                rows.append(row)
                print(f"{shape_name} {name} {out}x{inp} m={m}: "
                      + ", ".join(f"{k} {row['us'][k]:.0f} us ({row['gflops'][k]:.0f} GFLOP/s)" for k in KERNELS)
                      + f"; packed/best peer {row['ratio_best_peer']:.2f}; row-0 |Δ| {delta}", flush=True)
    peak1 = roofline.matmul_peak_gflops(a.threads)
    ghz, stated = roofline.stated_peak_gflops(a.threads, "512" in str(rust_runtime.simd_level))
    return dict(command="python benchmarks/batch_invariance_cost.py " + " ".join(sys.argv[1:]),
                threads=a.threads, rounds=a.rounds, simd=str(rust_runtime.simd_level),
                loadavg_before=load_before, loadavg_after=timing.loadavg(), peak_gflops_before=peak0,
                peak_gflops_after=peak1, clock_ghz=ghz, stated_peak_gflops=stated, results=rows,
                summary=summary(rows))


def geomean(v: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def summary(rows: list[dict]) -> dict:
    """Geometric means of packed / best peer (and / each peer) over decode (m ≤ 16) and prefill (m > 16) rows."""
    out = {}
    for part, keep in (("decode", lambda m: m <= 16), ("prefill", lambda m: m > 16)):
        sel = [r for r in rows if keep(r["m"])]
        out[part] = dict(best_peer=geomean([r["ratio_best_peer"] for r in sel]),
                         **{p: geomean([r["ratio"][p] for r in sel]) for p in PEERS})
    return out


def write_md(res: dict, path: Path) -> None:
    r = res
    lines = [
        f"# The cost of batch invariance: packed f32 matmul vs gemm and OpenBLAS ({r['threads']} threads)",
        "",
        f"`{r['command']}` — {r['rounds']} interleaved rounds, medians. Load average before {r['loadavg_before']}, "
        f"after {r['loadavg_after']} (2 cores, shared). simd: {r['simd']}. Physical limit: stated "
        f"{r['threads']} cores × 64 FLOP/cycle × {r['clock_ghz']:.2f} GHz = {r['stated_peak_gflops']:.0f} GFLOP/s; "
        f"numpy float32 2048³ matmul {r['peak_gflops_before']:.0f} GFLOP/s before, {r['peak_gflops_after']:.0f} "
        "after.",
        "",
        "Ratio = packed time / peer time, median of the rounds' ratios; best = against the faster peer of each "
        "round (> 1: the invariant kernel is slower). |Δ| row 0 = max |row 0 of the m-row "
        "product − the 1-row product of the same x row| (packed, gemm, numpy): a peer with |Δ| > 0 is not "
        "batch-invariant.",
        "",
        "| preset | linear | out × in | m | packed µs | gemm µs | numpy µs | packed/gemm | packed/numpy "
        "| packed/best | GFLOP/s packed / gemm / numpy | \\|Δ\\| row 0 packed / gemm / numpy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["results"]:
        us, g, d = row["us"], row["gflops"], row["max_abs_delta_row0"]
        lines.append(
            f"| {row['shape']} | {row['linear']} | {row['out']} × {row['inp']} | {row['m']} | {us['packed']:.0f} "
            f"| {us['gemm']:.0f} | {us['numpy']:.0f} | {row['ratio']['gemm']:.2f} | {row['ratio']['numpy']:.2f} "
            f"| **{row['ratio_best_peer']:.2f}** | {g['packed']:.0f} / {g['gemm']:.0f} / {g['numpy']:.0f} "
            f"| {d['packed']:.1e} / {d['gemm']:.1e} / {d['numpy']:.1e} |")
    s = r["summary"]
    lines += ["", "Geometric means of packed / peer: "
              + "; ".join(f"{part} (m {'≤' if part == 'decode' else '>'} 16): best peer {v['best_peer']:.2f}, "
                          f"gemm {v['gemm']:.2f}, numpy {v['numpy']:.2f}" for part, v in s.items()) + ".", ""]
    atomic_write_text(path, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 512])
    ap.add_argument("--shapes", nargs="+", default=["small", "base-400m"])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()
    shapes = bundles.preset_names()
    bad = [s for s in a.shapes if s not in shapes]
    if bad or a.threads < 1 or a.rounds < 1 or min(a.ms) < 1:
        sys.exit(f"--shapes must be among {sorted(shapes)} (got {a.shapes}); --threads, --rounds and --ms >= 1")
    if os.environ.get("OPENBLAS_NUM_THREADS") != str(a.threads):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    res = measure(a)
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "batch_invariance_cost.json", res)
    write_md(res, a.out / "batch_invariance_cost.md")
    print((a.out / "batch_invariance_cost.md").read_text())


if __name__ == "__main__":
    main()
