"""The physical limits a benchmark's figure is read against, and the work a model does for it.

Limits, measured in the same run as the figure (a shared machine's limits move with its load) or stated from the
hardware: memory read bandwidth (:func:`bandwidth_gbs`, the decode roofline), float32 GEMM throughput as numpy
(OpenBLAS) reaches it (:func:`matmul_peak_gflops`) and the peak the CPU states (:func:`stated_peak_gflops`).

Work, from a model config (Hugging Face LlamaConfig names, as ``config.json`` and :func:`benchmarks.bundles.shape`
give them): the weights of the matmuls (:func:`matmul_weights`, :func:`linears`) and the FLOPs of a prefill
(:func:`prefill_gflop`). Counts follow the usual dense-transformer accounting (Kaplan et al. 2020, table 1;
PaLM's appendix B for attention): 2 FLOPs a weight a token for the matmuls, 4 · layers · hidden · T(T+1)/2 for the
causal QKᵀ and PV of T tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from contract.cpu import cpu_mhz


def linears(cfg: dict) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's matmuls as rust_runtime fuses them (q, k, v in one; gate and up in
    one), then the lm_head (``hidden→vocab``, tied or not)."""
    h, nh, inter, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = h // nh
    return [("hidden→qkv", (nh + 2 * nkv) * hd, h), ("attention→hidden", h, nh * hd),
            ("hidden→2·intermediate", 2 * inter, h), ("intermediate→hidden", h, inter), ("hidden→vocab", vocab, h)]


def layer_matmul_weights(cfg: dict) -> int:
    """Weights of every decoder layer's matmuls (q, k, v, o, gate, up, down), all layers together."""
    per_layer = sum(out * inp for name, out, inp in linears(cfg) if name != "hidden→vocab")
    return cfg["num_hidden_layers"] * per_layer


def matmul_weights(cfg: dict) -> int:
    """Matmul weights read per decoded token: every layer's plus the lm_head's (the embedding lookup reads one row,
    not counted)."""
    return layer_matmul_weights(cfg) + cfg["vocab_size"] * cfg["hidden_size"]


def prefill_gflop(cfg: dict, tokens: int) -> float:
    """GFLOP of one batch-1 prefill of ``tokens`` tokens: 2 · layer weights · T + 2 · vocab · hidden (the lm_head on
    the last position, as a prefill that returns the next token's logits needs) + the causal attention products."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    attn = 4 * layers * h * tokens * (tokens + 1) // 2
    return (2 * layer_matmul_weights(cfg) * tokens + 2 * cfg["vocab_size"] * h + attn) / 1e9


def bandwidth_gbs(threads: int, mib: int = 256, passes: int = 5) -> float:
    """Read bandwidth in GB/s: ``threads`` Python threads each ``np.dot`` their share of two float32 arrays
    (``mib`` MiB in all, far beyond the per-core L2); bytes read / wall time, best of ``passes``."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    n = mib * 2**20 // 8
    a, b = np.ones(n, np.float32), np.full(n, 0.5, np.float32)
    parts = list(zip(np.array_split(a, threads), np.array_split(b, threads)))
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(passes):
            t = time.perf_counter()
            list(ex.map(lambda p: float(np.dot(p[0], p[1])), parts))
            best = max(best, (a.nbytes + b.nbytes) / (time.perf_counter() - t) / 1e9)
    return best


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


def flop_per_cycle(avx512: bool) -> int:
    """float32 FLOP a core issues a cycle: two FMA pipes × 16 lanes × 2 with AVX-512 (full-width on Zen 5 and Intel
    server cores; Zen 4 double-pumps, half that), × 8 lanes × 2 with AVX2 only."""
    return 64 if avx512 else 32


def stated_peak_gflops(threads: int, avx512: bool) -> tuple[float, float]:
    """(GHz, GFLOP/s): ``threads`` cores × :func:`flop_per_cycle` × the clock /proc/cpuinfo reports (0, 0 when it
    reports none)."""
    ghz = (cpu_mhz() or 0.0) / 1e3
    return ghz, threads * flop_per_cycle(avx512) * ghz
