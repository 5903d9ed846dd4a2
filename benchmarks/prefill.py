"""Batch-1 prefill of the base-400m shape: Rust f32 against onnxruntime fp32, beside the compute roofline.

    python benchmarks/prefill.py [--shape base-400m] [--tokens 64 512] [--threads 2] [--rounds 4]
                                 [--out benchmarks/results] [--cache FOLDER] [--int8]

Builds the random-init model of benchmarks/rust_decode.py's ``--shape`` (transformers save_pretrained) and its
plain-op ONNX decoder with KV cache (TorchScript exporter, checked against transformers), exported with logits
for the last position only, as Rust's ``Sequence.prefill`` returns. Each engine runs in its own worker process
(its own thread pool; the worker sleeps on a pipe while the other measures) with ``--threads`` threads: Rust
``Model.load(threads=…)`` → ``new_sequence().prefill(ids)``; ORT ``intra_op_num_threads`` → one ``run`` with an
empty past, every ``present.*`` fetched (what a serving prefill needs). After a warm-up prefill at every length,
rounds run A B A B (Rust, ORT, per length, the order swapped every round, each prefill after a 0.5 s pause so that
the other engine's idle threads have stopped spinning); reported are medians over rounds and
the median of per-round ratios ORT ms / Rust ms (> 1: Rust faster).

Memory: the Rust worker's ``VmHWM`` right after ``Model.load`` (peak at load: the safetensors pages are read,
packed once into the panels that prefill and decode share, and dropped) against its ``VmRSS`` after the timed
prefills (steady), both in MB, beside those of a bare ``python -c 'import numpy'``.

Roofline. FLOPs of one prefill of T tokens = 2 · P · T (P = the weights of every layer's matmuls) + 2 · V · H (the
lm_head, last position only) + 4 · L · heads · head_dim · T(T+1)/2 (causal QKᵀ and PV). The peak is measured in
the same run: numpy (OpenBLAS) float32 ``matmul`` of 2048 × 2048 matrices with ``--threads`` BLAS threads, best
of several, in a fresh process, before and after the rounds (on a loaded machine it lands far below the
hardware), and stated: cores × FLOP a cycle × clock. Share = achieved GFLOP/s ÷ the highest of these.

``--int8`` times Rust q8_0 (``quantize="int8"``) against onnxruntime int8 (the decoder quantized with
export.quantize's recipe: dynamic, per-channel QInt8 MatMuls) instead, into prefill_int8.json / .md.

Writes ``--out``/prefill.json and prefill.md. Times are wall-clock on a machine shared with other jobs (load
average before/after is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import QUIET_S, load_by_path  # noqa: E402
from train.atomic import atomic_write_json, atomic_write_text  # noqa: E402


def prompt_ids(n: int) -> list[int]:
    """The prompt of rust_decode.py: n ids in [2, 30002)."""
    return [(7 * i + 3) % 30000 + 2 for i in range(n)]


def load_avg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ---------------------------------------------------------------- worker side

def worker(a: argparse.Namespace) -> int:
    """``--worker rust|ort``: load, report RSS, then answer each line ``T`` with {"ms": prefill ms of T ids}."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a native library prints goes to stderr, never into the protocol
    rss_mb = load_by_path("decode").rss_mb
    import numpy as np

    t0 = time.perf_counter()
    if a.worker == "rust":
        import rust_runtime

        model = rust_runtime.Model.load(str(a.bundle), threads=a.threads, quantize="int8" if a.int8 else None)

        def prefill(ids: list[int]) -> None:
            model.new_sequence().prefill(ids)
    else:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = a.threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(a.onnx), so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values")]
        outs = [o.name for o in sess.get_outputs()]
        nkv, hd = sess.get_inputs()[2].shape[1], sess.get_inputs()[2].shape[3]
        empty = np.zeros((1, nkv, 0, hd), np.float32)

        def prefill(ids: list[int]) -> None:
            feed = {"input_ids": np.array([ids], np.int64), "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
            feed.update({n: empty for n in names})
            sess.run(outs, feed)
    load_s = time.perf_counter() - t0
    proto.write(json.dumps({"load_s": load_s, "peak_rss_mb_load": rss_mb(), "rss_mb_load": rss_mb("VmRSS")}) + "\n")
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        ids = prompt_ids(int(line))
        t = time.perf_counter()
        prefill(ids)
        ms = (time.perf_counter() - t) * 1e3
        proto.write(json.dumps({"ms": ms, "rss_mb": rss_mb("VmRSS"), "peak_rss_mb": rss_mb()}) + "\n")
    return 0


class Worker:
    """One engine's worker process (stdin/stdout JSON lines, stderr to ``log``)."""

    def __init__(self, kind: str, a: argparse.Namespace, bundle: Path, onnx: Path, log: Path):
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--bundle", str(bundle),
               "--onnx", str(onnx), "--threads", str(a.threads)] + (["--int8"] if a.int8 else [])
        self.kind, self.log = kind, log
        self._err = open(log, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                  env=env, cwd=ROOT)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{self.kind} worker exited with {self.p.poll()}: {' | '.join(tail)}")
        return json.loads(line)

    def prefill(self, n: int) -> dict:
        self.p.stdin.write(f"{n}\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=60)
        self._err.close()


# ---------------------------------------------------------------- orchestrator

def matmul_peak_gflops(threads: int, n: int = 2048, reps: int = 5) -> float:
    """float32 GEMM peak of this CPU as numpy (OpenBLAS) reaches it with ``threads`` threads, GFLOP/s (best of
    ``reps`` n × n × n matmuls, in a fresh process so the BLAS thread count takes)."""
    code = (
        "import numpy as np, time\n"
        f"a = np.random.rand({n}, {n}).astype(np.float32); b = np.random.rand({n}, {n}).astype(np.float32)\n"
        "a @ b\nbest = 1e9\n"
        f"for _ in range({reps}):\n"
        "    t = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t)\n"
        f"print(2 * {n}**3 / best / 1e9)\n"
    )
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip())


def layer_matmul_params(shape: dict) -> int:
    """Weights of every decoder layer's matmuls (q, k, v, o, gate, up, down), all layers together."""
    h, nh, nkv, inter = (shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                            "intermediate_size"))
    hd = h // nh
    return shape["num_hidden_layers"] * (h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter)


def stated_peak_gflops(threads: int, avx512: bool) -> tuple[float, float]:
    """(GHz, GFLOP/s): ``threads`` cores × float32 FLOP a cycle × the clock /proc/cpuinfo reports (0, 0 when it
    reports none). FLOP a cycle: two FMA pipes × 16 lanes × 2 with AVX-512 (full-width on Zen 5 and Intel server
    cores; Zen 4 double-pumps, half that), × 8 lanes × 2 with AVX2 only."""
    try:
        mhz = [float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines()
               if ln.startswith("cpu MHz")]
    except OSError:
        mhz = []
    ghz = max(mhz) / 1e3 if mhz else 0.0
    return ghz, threads * (64 if avx512 else 32) * ghz


def prefill_gflop(shape: dict, t: int) -> float:
    """FLOPs of one batch-1 prefill of t tokens (see the module docstring), in GFLOP."""
    h, L, nh, vocab = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
    attn = 4 * L * nh * (h // nh) * t * (t + 1) // 2
    return (2 * layer_matmul_params(shape) * t + 2 * vocab * h + attn) / 1e9


def bare_numpy_rss_mb() -> float:
    code = ("import numpy; print([int(l.split()[1]) for l in open('/proc/self/status').read()"
            ".splitlines() if l.startswith('VmHWM:')][0] * 1024 / 1e6)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def write_md(res: dict, path: Path) -> None:
    r = res
    pair = ("Rust q8_0 vs onnxruntime int8 (dynamic, per channel)" if r.get("int8")
            else "Rust f32 vs onnxruntime fp32")
    lines = [
        f"# Prefill, {r['shape']} (batch 1, {r['threads']} threads): {pair}",
        "",
        f"`{r['command']}` — {r['rounds']} rounds (A B A B, order swapped each round), medians. "
        f"Load average before {r['loadavg_before']}, after {r['loadavg_after']} (2 cores, shared). "
        f"simd: {r['simd']}. Peak (numpy float32 2048³ matmul, {r['threads']} threads): "
        f"{r['peak_gflops_before']:.1f} GFLOP/s before, {r['peak_gflops_after']:.1f} after; stated peak {r['threads']} cores × {r['flop_per_cycle']} FLOP/cycle × "
        f"{r['clock_ghz']:.2f} GHz = "
        f"{r['stated_peak_gflops']:.0f} GFLOP/s.",
        "",
        "| tokens | GFLOP | Rust ms | ORT ms | ORT/Rust (median of rounds) | Rust GFLOP/s (% of peak) "
        "| ORT GFLOP/s (% of peak) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if r.get("int8"):
        lines[2] += (" GFLOP/s counts the same FLOPs as f32, and % of peak is of the f32 peak: int8 dot products "
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


def argv_without_cache(argv: list[str]) -> list[str]:
    """The command line as recorded in the results: ``--cache FOLDER`` only saves rebuilding the inputs (and would
    write a path of this machine into the results)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--cache":
            skip = True
        elif not arg.startswith("--cache="):
            out.append(arg)
    return out


def build_once(done: Path, outputs: list[Path], build, what: str) -> None:
    """Run ``build()`` unless the marker file ``done`` and every path of ``outputs`` exist; write the marker last,
    so an interrupted build is redone on the next run."""
    if done.exists() and all(p.exists() for p in outputs):
        print(f"reusing {what} in {done.parent}", flush=True)
        return
    t = time.perf_counter()
    build()
    atomic_write_text(done, "built\n")
    print(f"{what} in {time.perf_counter() - t:.0f} s", flush=True)


def build_inputs(rd, shape: str, folder: Path, int8: bool = False) -> tuple[Path, Path]:
    """The random-init bundle of ``shape`` and its ONNX decoder (logits of the last position) in ``folder``, built
    there once (see build_once). With ``int8`` the decoder returned is its int8 twin (export.quantize.write_onnx_form, scheme int8),
    made once likewise. Raises NotADirectoryError when ``folder`` is an existing file."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"--cache {folder}: not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    bundle, onnx = folder / f"bundle-{shape}", folder / f"decoder-{shape}.onnx"

    def build_fp32() -> None:
        rd.build_bundle(bundle, shape)
        rd.export_onnx(bundle, onnx, last_logits=True)

    from serve.bundle import CONFIG

    build_once(folder / f"{shape}.done", [bundle / CONFIG, onnx], build_fp32,
               "bundle + ONNX export (checked against transformers)")
    if not int8:
        return bundle, onnx
    q8 = folder / f"decoder-{shape}.int8.onnx"

    def build_int8() -> None:
        from export.quantize import write_onnx_form
        from serve.quant import SCHEMES

        write_onnx_form(SCHEMES["int8"], onnx, q8)

    build_once(folder / f"{shape}.int8.done", [q8], build_int8, "int8 decoder (dynamic, per channel)")
    return bundle, q8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="base-400m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--cache", type=Path, default=None,
                    help="keep the built bundle and ONNX decoder in this folder and reuse them on the next run "
                         "(default: build both in a temporary folder, about a minute for base-400m)")
    ap.add_argument("--int8", action="store_true",
                    help="Rust q8_0 (quantize='int8') against onnxruntime int8 (the decoder through "
                         "export.quantize's dynamic per-channel recipe); writes prefill_int8.json/.md")
    ap.add_argument("--worker", choices=["rust", "ort"], help=argparse.SUPPRESS)
    ap.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--onnx", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        sys.exit(worker(a))
    rd = load_by_path("rust_decode")
    if a.shape not in rd.SHAPES:
        sys.exit(f"--shape is {a.shape!r}; expected one of {sorted(rd.SHAPES)}")
    shape = rd.SHAPES[a.shape]
    if min(a.tokens) < 1 or max(a.tokens) > shape["max_position_embeddings"]:
        sys.exit(f"--tokens must lie in 1..{shape['max_position_embeddings']} (the context), got {a.tokens}")
    import rust_runtime

    command = "python benchmarks/prefill.py " + " ".join(argv_without_cache(sys.argv[1:]))
    load_before = load_avg()
    if a.cache is not None and a.cache.exists() and not a.cache.is_dir():
        sys.exit(f"--cache {a.cache}: not a folder (give a folder to keep the built bundle and ONNX decoder in)")
    with tempfile.TemporaryDirectory() as tmp:
        bundle, onnx = build_inputs(rd, a.shape, a.cache or Path(tmp), a.int8)
        peak0 = matmul_peak_gflops(a.threads)
        workers = {k: Worker(k, a, bundle, onnx, Path(tmp) / f"{k}.log") for k in ("rust", "ort")}
        for w in workers.values():
            print(f"{w.kind} loaded: {w.ready}", flush=True)
        try:
            for n in a.tokens:  # warm-up, dropped
                for w in workers.values():
                    w.prefill(n)
            ms = {(k, n): [] for k in workers for n in a.tokens}
            last: dict = {}
            for r in range(a.rounds):
                order = ["rust", "ort"] if r % 2 == 0 else ["ort", "rust"]
                for n in a.tokens:
                    for k in order:
                        time.sleep(QUIET_S)  # the other worker's idle threads may still spin (benchmarks.common)
                        last[k] = workers[k].prefill(n)
                        ms[(k, n)].append(last[k]["ms"])
                print(f"round {r + 1}: " + ", ".join(f"{k} {n}: {v[-1]:.0f} ms" for (k, n), v in ms.items()),
                      flush=True)
        finally:
            for w in workers.values():
                w.close()
        peak1 = matmul_peak_gflops(a.threads)
    avx512 = "512" in str(rust_runtime.simd_level)
    stated = stated_peak_gflops(a.threads, avx512)
    peak = max(peak0, peak1, stated[1])
    rows = []
    for n in a.tokens:
        gf = prefill_gflop(shape, n)
        rust, ort_ = ms[("rust", n)], ms[("ort", n)]
        rm, om = statistics.median(rust), statistics.median(ort_)
        rows.append(dict(
            tokens=n, gflop=gf, rust_ms=rm, ort_ms=om,
            ratio_ort_over_rust=statistics.median(o / r for o, r in zip(ort_, rust, strict=True)),
            rust_gflops=gf / rm * 1e3, ort_gflops=gf / om * 1e3,
            rust_share=gf / rm * 1e3 / peak, ort_share=gf / om * 1e3 / peak,
            rust_ms_rounds=[round(x) for x in rust], ort_ms_rounds=[round(x) for x in ort_],
        ))
    params = shape["vocab_size"] * shape["hidden_size"] + layer_matmul_params(shape)  # tied: one V × H matrix
    res = dict(
        shape=a.shape, threads=a.threads, rounds=a.rounds, command=command, int8=a.int8,
        loadavg_before=load_before, loadavg_after=load_avg(), simd=str(rust_runtime.simd_level),
        peak_gflops_before=peak0, peak_gflops_after=peak1, clock_ghz=stated[0], stated_peak_gflops=stated[1],
        flop_per_cycle=64 if avx512 else 32, results=rows,
        memory=dict(
            rust_peak_rss_mb_load=workers["rust"].ready["peak_rss_mb_load"],
            rust_rss_mb_steady=last["rust"]["rss_mb"], rust_peak_rss_mb_end=last["rust"]["peak_rss_mb"],
            ort_peak_rss_mb_load=workers["ort"].ready["peak_rss_mb_load"], ort_rss_mb_steady=last["ort"]["rss_mb"],
            weights_mb=params * 4 / 1e6, bare_numpy_rss_mb=bare_numpy_rss_mb(),
        ),
    )
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "prefill_int8" if a.int8 else "prefill"
    atomic_write_json(a.out / f"{stem}.json", res)
    write_md(res, a.out / f"{stem}.md")
    print((a.out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
