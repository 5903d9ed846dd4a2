"""Batch-1 prefill time and decode speed of every CPU runtime on the same bundle, against the memory roofline.

    python benchmarks/decode.py [--bundle DIR ...] [--threads N ...] [--rounds 5] [--prompt 64] [--new 64]
                                [--backends NAME ...] [--out benchmarks/results] [--fresh]

Backends (names for ``--backends``): ``rust-f32``, ``rust-int8`` (rust_runtime, quantize="int8" = candle q8_0),
``ort-fp32``, ``ort-int8`` (serve's OnnxBackend on model.onnx / model.int8.onnx), ``torch`` (PyTorch eager: the
bundle's model.safetensors through train.model, with its KV cache), ``llama-f32``, ``llama-q8_0`` (llama.cpp via
llama-cpp-python on ``export.gguf``'s GGUF, fed our token ids). A backend whose library is absent is skipped and
the table says why; a missing model.int8.onnx or GGUF is made first (``export.onnx --quantize int8`` has to be run
by hand; the GGUF is written to ``BUNDLE/model-<type>.gguf``).

Method. Every backend runs in its own worker process (its own thread pools and OpenMP runtime; workers sleep on
a pipe while another measures), loaded once, warmed by one measurement — whose peak RSS (``VmHWM``: load +
prefill ``--prompt`` + decode ``--new``, in a fresh process) is the memory figure — then driven round-robin:
each round runs every backend once, in a rotated order, so load from other jobs hits all alike. One measurement =
prefill of the prompt (``<|endoftext|>`` + Bangla/English text, our token ids), then ``--new`` greedy steps through
the backend's Sequence (``prefill``/``decode`` → logits → numpy argmax → next id: the same Python loop for all).
Reported: medians over rounds, and the median of per-round ratios for the two targets (rust f32 ≥ 1.5× ort
fp32; rust int8 ≥ 1.0× llama.cpp q8_0). Every backend gets the same thread count; the default runs all cores and
then 1 thread.

Roofline. Memory bandwidth is measured here (numpy: threads each ``dot`` two float32 arrays of 256 MiB total per
pass; bytes read / time, best of several passes, before and after each group). Decode must read every matmul
weight once per token (the lm_head included, the embedding lookup not): roofline tok/s = bandwidth ÷ weight
bytes, at 4 bytes/weight for f32, 34/32 for q8_0 (a float16 scale per 32 int8s) and 1 for ORT's per-channel int8.
A share above 100 % means the weights were (partly) served from cache (the 300 MiB L3 is shared with the host).

Output: ``--out``/decode.json (results keyed by bundle and thread count; a new run replaces only its own keys
unless ``--fresh``), decode.md (tables) and decode.png (bar chart). Times are wall-clock on a machine shared with
other jobs: the load average is recorded next to each group.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from serve.bundle import CONFIG, ONNX_INT8, gguf_file  # noqa: E402
from train.atomic import atomic_write_json, atomic_write_text  # noqa: E402

# name → (label, bytes read per matmul weight per token, GGUF type for llama.cpp or None)
BACKENDS: dict[str, tuple[str, float, str | None]] = {
    "rust-f32": ("rust f32", 4.0, None),
    "rust-int8": ("rust int8 (q8_0)", 34 / 32, None),
    "ort-fp32": ("onnxruntime fp32", 4.0, None),
    "ort-int8": ("onnxruntime int8", 1.0, None),
    "torch": ("PyTorch eager fp32", 4.0, None),
    "llama-f32": ("llama.cpp f32", 4.0, "f32"),
    "llama-q8_0": ("llama.cpp q8_0", 34 / 32, "q8_0"),
}
TARGETS = (("rust-f32", "ort-fp32", 1.5), ("rust-int8", "llama-q8_0", 1.0))
PROMPT_TEXT = ("বাংলা ভাষা দক্ষিণ এশিয়ার একটি ইন্দো-আর্য ভাষা। আমি বাংলায় গান গাই, আমি বাংলার গান গাই। "
               "The history of the river is the history of the people who live beside it. ")
WORKER_TIMEOUT_S = 1800


# ---------------------------------------------------------------- worker side (one backend per process)

def rss_mb(field: str = "VmHWM") -> float:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident set in MB (1e6 bytes); file-backed mapped
    pages (memory-mapped weights) included."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e6
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def load_backend(name: str, bundle: Path, threads: int, n_ctx: int, extra_bufts: bool):
    """An object with ``new_sequence()`` whose sequences have ``prefill(ids)`` / ``decode(id)`` → float32 [V].
    Raises ImportError when the backend's library is absent."""
    if name.startswith("rust"):
        from serve.backends.rust import RustBackend

        return RustBackend(bundle, quantize="int8" if name == "rust-int8" else None, threads=threads)
    if name.startswith("ort"):
        from serve.backends.onnx import OnnxBackend

        return OnnxBackend(bundle, quantize="int8" if name == "ort-int8" else None, threads=threads)
    if name == "torch":
        import torch

        from export.parity import TorchSequence
        from train.checkpoint import load_model

        torch.set_num_threads(threads)
        model = load_model(bundle)[0].eval()

        class TorchBackend:
            def new_sequence(self):
                return TorchSequence(model)

        return TorchBackend()
    from serve.backends.llamacpp import LlamaCppBackend

    # llama.cpp's default f16 KV cache, as users run it; a context just large enough (it is allocated up front)
    return LlamaCppBackend(bundle / gguf_file(BACKENDS[name][2]), threads=threads, n_ctx=n_ctx,
                           f32_cache=False, extra_bufts=extra_bufts)


def measure(backend, prompt: list[int], new: int) -> dict:
    """One prefill of ``prompt`` and ``new`` greedy decode steps: {prefill_ms, decode_tok_s, tokens}."""
    seq = backend.new_sequence()
    t0 = time.perf_counter()
    logits = seq.prefill(prompt)
    t1 = time.perf_counter()
    tokens = []
    for _ in range(new):
        tokens.append(int(np.argmax(logits)))
        logits = seq.decode(tokens[-1])
    t2 = time.perf_counter()
    return {"prefill_ms": (t1 - t0) * 1e3, "decode_tok_s": new / (t2 - t1), "tokens": tokens}


def worker(a: argparse.Namespace) -> int:
    """``--worker NAME``: load, warm up (report peak RSS), then answer "run" lines with one JSON line each."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a native library prints goes to stderr, never into the protocol

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    prompt = [int(x) for x in a.ids.split(",")]
    t = time.perf_counter()
    backend = load_backend(a.worker, Path(a.bundle[0]), a.threads[0], len(prompt) + a.new + 1, a.extra_bufts)
    load_s = time.perf_counter() - t
    warm = measure(backend, prompt, a.new)
    send({"ready": True, "load_s": load_s, "peak_rss_mb": rss_mb(), "rss_mb": rss_mb("VmRSS"), "warmup": warm})
    for line in sys.stdin:
        if line.strip() == "run":
            send(measure(backend, prompt, a.new))
        elif line.strip() == "quit":
            break
    if hasattr(backend, "close"):
        backend.close()  # llama-cpp-python frees its model here, not in a finalizer at interpreter exit
    send({"bye": True, "peak_rss_mb_end": rss_mb()})
    return 0


class WorkerDied(RuntimeError):
    """A worker exited (or timed out) instead of answering; ``returncode`` < 0 is the signal that killed it."""

    def __init__(self, msg: str, returncode: int | None):
        super().__init__(msg)
        self.returncode = returncode


class Worker:
    """The orchestrator's handle on one worker process (stdin/stdout JSON lines, stderr to a log file)."""

    def __init__(self, name: str, bundle: Path, threads: int, ids: list[int], new: int, log: Path,
                 extra_bufts: bool = False):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), RAYON_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--bundle", str(bundle),
               "--threads", str(threads), "--new", str(new), "--ids", ",".join(map(str, ids))]
        if extra_bufts:
            cmd.append("--extra-bufts")
        self.name, self.log = name, log
        self._err = open(log, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                  env=env, cwd=ROOT)
        self.ready = self._read()

    def _read(self) -> dict:
        r, _, _ = select.select([self.p.stdout], [], [], WORKER_TIMEOUT_S)
        line = self.p.stdout.readline() if r else ""
        if not line:
            self.close(kill=True)
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise WorkerDied(f"{self.name} worker exited with {self.p.returncode}: {' | '.join(tail)}",
                             self.p.returncode)
        return json.loads(line)

    def run(self) -> dict:
        """One measurement (see :func:`measure`)."""
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        return self._read()

    def close(self, kill: bool = False) -> dict:
        """Stop the worker; returns its last message (peak RSS at the end) when it exits cleanly."""
        last: dict = {}
        if not kill and self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.flush()
                last = self._read()
            except (OSError, WorkerDied):
                pass
        if self.p.poll() is None:
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._err.close()
        return last


# ---------------------------------------------------------------- orchestrator

def bandwidth_gbs(threads: int, mib: int = 256, passes: int = 5) -> float:
    """Read bandwidth in GB/s: ``threads`` Python threads each ``np.dot`` their share of two float32 arrays
    (``mib`` MiB in all, far beyond the per-core L2); bytes read / wall time, best of ``passes``."""
    from concurrent.futures import ThreadPoolExecutor

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


def matmul_weights(cfg: dict) -> int:
    """Matmul weights read per decoded token: q, k, v, o, gate, up, down in every layer, plus the lm_head."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    kvd = kv * h // cfg["num_attention_heads"]
    return layers * (2 * h * h + 2 * h * kvd + 3 * h * inter) + cfg["vocab_size"] * h


def prompt_ids(bundle: Path, n: int) -> list[int]:
    """``<|endoftext|>`` + PROMPT_TEXT's ids from the bundle's tokenizer, repeated to exactly ``n`` ids."""
    from tokenizers import Tokenizer

    from serve.bundle import TOKENIZER, eot_id

    tok = Tokenizer.from_file(str(bundle / TOKENIZER))
    eot = eot_id(tok)
    text = tok.encode(PROMPT_TEXT).ids
    ids = [eot] + (text * (n // max(1, len(text)) + 1))
    return ids[:n]


def available(name: str) -> str | None:
    """None when the backend's library imports here, else why not."""
    mod = {"rust": "rust_runtime", "ort": "onnxruntime", "torch": "torch", "llama": "llama_cpp"}[name.split("-")[0]]
    try:
        __import__(mod)
    except ImportError as e:
        return f"{mod} not importable ({e})"
    return None


def prepare(bundle: Path, names: list[str], log: Callable[[str], None]) -> dict[str, str]:
    """Make the GGUF files the llama.cpp backends need; returns {backend: why it is skipped}."""
    skipped = {}
    for name in names:
        why = available(name)
        if why is None and name == "ort-int8" and not (bundle / ONNX_INT8).is_file():
            why = f"no {ONNX_INT8} (python -m export.onnx RUN --quantize int8 --out {bundle} --force)"
        if why is None and BACKENDS[name][2]:
            path = bundle / gguf_file(BACKENDS[name][2])
            if not path.is_file():
                from export.gguf import export_gguf

                export_gguf(bundle, path, BACKENDS[name][2], log=log, approximate_pretokenizer=True)
        if why:
            skipped[name] = why
            log(f"skip {name}: {why}")
    return skipped


def start_workers(bundle: Path, names: list[str], threads: int, ids: list[int], new: int, logdir: Path,
                  log: Callable[[str], None]) -> tuple[dict[str, Worker], dict[str, str], dict[str, str]]:
    """Start (one after the other) and warm every worker. llama.cpp q8_0 first tries its extra buffer types (AMX,
    repacking) and falls back to ``use_extra_bufts=False`` if the worker dies (the AMX SIGILL of rust-facts §8).
    Returns (workers, {name: why it failed}, {name: note})."""
    workers, failed, notes = {}, {}, {}
    for name in names:
        tries = [True, False] if name.startswith("llama") else [False]
        for extra in tries:
            try:
                workers[name] = Worker(name, bundle, threads, ids, new, logdir / f"{name}-{threads}t.log", extra)
                if name.startswith("llama"):
                    notes[name] = f"use_extra_bufts={extra}"
                break
            except WorkerDied as e:
                if extra and e.returncode is not None and e.returncode < 0:
                    notes[name] = f"extra buffer types crashed (signal {-e.returncode}); use_extra_bufts=False"
                    log(f"{name}: {notes[name]}")
                    continue
                failed[name] = str(e)[:300]
                log(f"{name}: failed: {failed[name]}")
                break
        if name in workers:
            w = workers[name].ready
            log(f"  {name}: loaded in {w['load_s']:.1f} s, peak RSS {w['peak_rss_mb']:.0f} MB, warm-up "
                f"{w['warmup']['decode_tok_s']:.1f} tok/s")
    return workers, failed, notes


def summarize(per: dict[str, list[dict]], ready: dict[str, dict], weights: int, bw: float) -> dict[str, dict]:
    """Medians and roofline shares per backend; also how many leading greedy tokens agree with torch's."""
    ref = ready.get("torch", {}).get("warmup", {}).get("tokens")
    out = {}
    for name, runs in per.items():
        label, bpw, _ = BACKENDS[name]
        dec = [r["decode_tok_s"] for r in runs]
        roof = bw * 1e9 / (weights * bpw)
        toks = ready[name]["warmup"]["tokens"]
        agree = None
        if ref is not None:
            agree = next((i for i, (x, y) in enumerate(zip(ref, toks)) if x != y), min(len(ref), len(toks)))
        out[name] = {
            "label": label, "prefill_ms": statistics.median(r["prefill_ms"] for r in runs),
            "decode_tok_s": statistics.median(dec), "decode_tok_s_min": min(dec), "decode_tok_s_max": max(dec),
            "decode_tok_s_rounds": [round(x, 2) for x in dec], "weight_bytes_per_token": weights * bpw,
            "roofline_tok_s": roof, "share_of_roofline": statistics.median(dec) / roof,
            "peak_rss_mb": ready[name]["peak_rss_mb"], "rss_mb": ready[name].get("rss_mb"),
            "load_s": ready[name]["load_s"],
            "greedy_agree_with_torch": agree, "tokens_first8": toks[:8],
        }
    return out


def ratios(per: dict[str, list[dict]]) -> list[dict]:
    """The two targets as medians of per-round decode-speed ratios (same round = same machine load)."""
    rows = []
    for a, b, target in TARGETS:
        if a in per and b in per:
            rs = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(per[a], per[b])]
            med = statistics.median(rs)
            rows.append({"what": f"{a} / {b}", "target": target, "median": med, "min": min(rs), "max": max(rs),
                         "met": med >= target})
    return rows


def run_group(bundle: Path, names: list[str], threads: int, a: argparse.Namespace, skipped: dict[str, str],
              logdir: Path, log: Callable[[str], None]) -> dict:
    """All rounds for one bundle at one thread count; ``skipped`` ({backend: why}) goes into the result."""
    cfg = json.loads((bundle / CONFIG).read_text())
    ids = prompt_ids(bundle, a.prompt)
    load0 = os.getloadavg()
    bw0 = bandwidth_gbs(threads)
    log(f"[{bundle}] {threads} thread(s): bandwidth {bw0:.1f} GB/s, load average {load0[0]:.1f}")
    workers, failed, notes = start_workers(bundle, names, threads, ids, a.new, logdir, log)
    per: dict[str, list[dict]] = {n: [] for n in workers}
    loads = [os.getloadavg()[0]]
    try:
        order = list(workers)
        for r in range(a.rounds):
            rot = order[r % len(order):] + order[:r % len(order)] if order else []
            for name in rot:
                res = workers[name].run()
                per[name].append(res)
            loads.append(os.getloadavg()[0])
            log(f"  round {r + 1}/{a.rounds}: " + ", ".join(
                f"{n} {per[n][-1]['decode_tok_s']:.1f}" for n in order) + f" tok/s (load {loads[-1]:.1f})")
    finally:
        ends = {n: w.close() for n, w in workers.items()}
    bw1 = bandwidth_gbs(threads)
    bw = statistics.median([bw0, bw1])
    ready = {n: w.ready for n, w in workers.items()}
    for n, e in ends.items():
        ready[n]["peak_rss_mb_end"] = e.get("peak_rss_mb_end")
    weights = matmul_weights(cfg)
    return {
        "bundle": str(bundle), "name": bundle.resolve().parent.name if bundle.name == "bundle" else bundle.name,
        "threads": threads, "prompt": a.prompt, "new": a.new, "rounds": a.rounds,
        "matmul_weights": weights, "bandwidth_gbs": bw, "bandwidth_gbs_before_after": [bw0, bw1],
        "load_avg": {"start": load0[0], "min": min(loads), "max": max(loads), "median": statistics.median(loads)},
        "backends": summarize(per, ready, weights, bw), "ratios": ratios(per),
        "skipped": {**skipped, **failed}, "notes": notes,
    }


def python_baseline_mb() -> float:
    """Peak RSS (VmHWM) of a fresh Python that imports numpy: what every worker pays before loading anything, MB.
    (The child reports it itself: ``wait4``'s ru_maxrss would include the parent's memory copied at fork.)"""
    code = ("import numpy, pathlib; print([l.split()[1] for l in pathlib.Path('/proc/self/status').read_text()"
            ".splitlines() if l.startswith('VmHWM:')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip()) * 1024 / 1e6


# ---------------------------------------------------------------- report

def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# Decode speed at batch 1: Rust, onnxruntime, PyTorch, llama.cpp",
        "",
        f"Written by `python benchmarks/decode.py` on {m['cpu']} ({m['cores']} cores, shared with other jobs), "
        f"Python {m['python']}. Prompt of {res['groups'][0]['prompt'] if res['groups'] else '?'} token ids, then "
        "greedy decode; each backend in its own worker process, interleaved round by round; medians over rounds. "
        "Roofline = measured read bandwidth ÷ matmul weight bytes per token (f32 4 B, q8_0 34/32 B, ORT int8 1 B "
        "per weight, lm_head included). Peak RSS = VmHWM of the backend's fresh worker after load + prefill + "
        "decode, steady = its VmRSS then (both count memory-mapped weight pages; a bare `python -c 'import numpy'` "
        f"peaks at {m['python_baseline_mb']:.0f} MB). \"greedy = torch\": leading greedy tokens equal to PyTorch's.",
        "",
        "How to read: a share above 100 % means weights were served from cache rather than DRAM (the 300 MiB L3 is "
        "shared with the host), so the roofline means most for the larger model. On 2 shared vCPUs the 2-thread "
        "figures swing with other jobs' load — engines that synchronise threads with spinning barriers (OpenMP in "
        "PyTorch and llama.cpp) can collapse for a whole round when the second core is taken — so read the "
        "per-round ratios and min–max, not single numbers. Untrained models have near-flat logits: their 8-bit "
        "greedy continuations leave PyTorch's early without meaning anything.",
        "",
    ]
    for g in res["groups"]:
        la = g["load_avg"]
        lines += [
            f"## `{g['name']}` — {g['matmul_weights'] / 1e6:.1f} M matmul weights, {g['threads']} thread(s)",
            "",
            f"Bandwidth {g['bandwidth_gbs']:.1f} GB/s (before/after: {g['bandwidth_gbs_before_after'][0]:.1f} / "
            f"{g['bandwidth_gbs_before_after'][1]:.1f}); load average {la['min']:.1f}–{la['max']:.1f} "
            f"(median {la['median']:.1f}) on {m['cores']} cores; {g['rounds']} rounds of prefill {g['prompt']} + "
            f"decode {g['new']}.",
            "",
            "| backend | prefill ms | decode tok/s (min–max) | roofline tok/s | share of roofline | peak / steady RSS MB "
            "| greedy = torch |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for b in g["backends"].values():
            agree = "–" if b["greedy_agree_with_torch"] is None else f"{b['greedy_agree_with_torch']}/{g['new']}"
            lines.append(f"| {b['label']} | {b['prefill_ms']:.1f} | {b['decode_tok_s']:.1f} "
                         f"({b['decode_tok_s_min']:.1f}–{b['decode_tok_s_max']:.1f}) | {b['roofline_tok_s']:.0f} | "
                         f"{100 * b['share_of_roofline']:.0f} % | {b['peak_rss_mb']:.0f} / "
                         f"{'?' if b.get('rss_mb') is None else format(b['rss_mb'], '.0f')} | {agree} |")
        lines.append("")
        for r in g["ratios"]:
            lines.append(f"- **{r['what']}** = {r['median']:.2f}× (per-round {r['min']:.2f}–{r['max']:.2f}); "
                         f"target ≥ {r['target']:.1f}× — **{'met' if r['met'] else 'not met'}**")
        for n, why in g["skipped"].items():
            lines.append(f"- {n} skipped: {why}")
        for n, note in g["notes"].items():
            lines.append(f"- {n}: {note}")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """One column per (bundle, threads) group: decode tok/s (label: share of the roofline) above peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = res["groups"]
    if not groups:
        return
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7.5), squeeze=False)
    for col, g in enumerate(groups):
        names = list(g["backends"])
        colors = [f"C{list(BACKENDS).index(n)}" for n in names]
        top, bottom = axes[0][col], axes[1][col]
        bars = top.bar(range(len(names)), [g["backends"][n]["decode_tok_s"] for n in names], color=colors)
        for bar, n in zip(bars, names):
            top.annotate(f"{100 * g['backends'][n]['share_of_roofline']:.0f}%", (bar.get_x() + bar.get_width() / 2,
                         bar.get_height()), ha="center", va="bottom", fontsize=7)
        top.set_title(f"{g['name']}, {g['threads']} thread(s)\nload {g['load_avg']['median']:.1f}, "
                      f"{g['bandwidth_gbs']:.1f} GB/s", fontsize=9)
        top.set_ylabel("decode tok/s (batch 1, median)")
        bottom.bar(range(len(names)), [g["backends"][n]["peak_rss_mb"] for n in names], color=colors)
        bottom.set_ylabel("peak RSS, MB")
        for ax in (top, bottom):
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    fig.suptitle("Decode speed (label: share of the memory roofline) and peak memory", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", action="append", default=None,
                   help="bundle folder (repeatable; default runs/small/bundle, else runs/small-init/bundle)")
    p.add_argument("--threads", type=int, action="append", default=None,
                   help="thread count for every backend (repeatable; default: all cores, then 1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--prompt", type=int, default=64, help="prompt length in tokens (default 64)")
    p.add_argument("--new", type=int, default=64, help="greedy tokens decoded (default 64)")
    p.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    p.add_argument("--fresh", action="store_true", help="drop earlier results in decode.json instead of merging")
    p.add_argument("--report", action="store_true", help="only re-render decode.md and decode.png from decode.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    p.add_argument("--extra-bufts", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)

    def log(msg: str) -> None:
        print(msg, flush=True)

    bundles = [Path(b) for b in a.bundle] if a.bundle else [
        next((ROOT / "runs" / n / "bundle" for n in ("small", "small-init") if (ROOT / "runs" / n / "bundle").is_dir()),
             ROOT / "runs" / "small" / "bundle")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = a.threads or sorted({cores, 1}, reverse=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "decode.json"
    if a.report:
        res = json.loads(jpath.read_text())
        atomic_write_text(out / "decode.md", markdown(res))
        plot(res, out / "decode.png")
        return 0
    old = [] if a.fresh or not jpath.is_file() else json.loads(jpath.read_text()).get("groups", [])
    logdir = Path(tempfile.mkdtemp(prefix="decode-bench-"))
    log(f"worker logs: {logdir}")
    groups = []
    for bundle in bundles:
        if not (bundle / CONFIG).is_file():
            sys.exit(f"{bundle}: not a bundle (export one with python -m export.onnx RUN --quantize int8)")
        skipped = prepare(bundle, a.backends, log)
        names = [n for n in a.backends if n not in skipped]
        for t in threads:
            groups.append(run_group(bundle, names, t, a, skipped, logdir, log))
    keys = {(g["name"], g["threads"]) for g in groups}
    merged = [g for g in old if (g["name"], g["threads"]) not in keys] + groups
    from importlib import metadata

    versions = {}
    for pkg in ("onnxruntime", "torch", "llama_cpp_python", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        import rust_runtime

        versions["rust_runtime"] = f"{rust_runtime.__version__} ({rust_runtime.simd_level})"
    except ImportError:
        versions["rust_runtime"] = None
    res = {"machine": {"cpu": cpu_name(), "cores": cores, "python": platform.python_version(),
                       "python_baseline_mb": python_baseline_mb()},
           "versions": versions, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "groups": merged}
    atomic_write_json(jpath, res)
    atomic_write_text(out / "decode.md", markdown(res))
    plot(res, out / "decode.png")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
