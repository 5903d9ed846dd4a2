"""Batch-1 prefill time and decode speed of every CPU runtime on the same bundle, against the memory roofline.

    python benchmarks/decode.py [--bundle DIR ...] [--preset NAME ...] [--threads N ...] [--rounds 5]
                                [--prompt 64] [--new 64] [--backends NAME ...] [--out benchmarks/results] [--fresh]

Bundles: ``--bundle`` folders, and for each ``--preset`` (a config of ``configs/``) its untrained twin
``runs/NAME-init/bundle``, made by ``train.run`` and ``export.onnx`` (with the q8_0 graph when a q8_0 ONNX lane is
timed) when absent (benchmarks/bundles.py). Default: ``runs/small/bundle`` when it exists, else ``--preset small``.

Backends (``--backends``; the lanes of benchmarks/lanes.py): ``rust-f32``, ``rust-q8_0``, ``rust-q4_0``,
``rust-q4_mix`` (rust_runtime with that ``quantize``: its integer kernels), ``ort-fp32``, ``ort-q8_0`` (serve's
OnnxBackend on model.onnx / model.q8_0.onnx), ``torch`` (PyTorch eager: the bundle's model.safetensors through
train.model, with its KV cache), ``llama-f32``, ``llama-q8_0``, ``llama-q4_0``, ``llama-q4_k_m`` (llama.cpp via
llama-cpp-python on the GGUF, fed our token ids: f32 and q8_0 written by ``export.gguf``, Q4_0 and Q4_K_M by
llama.cpp's own quantizer from the f32 one). A backend whose library is absent is skipped and the table says why; a
missing GGUF is written first (``BUNDLE/model-<type>.gguf``, benchmarks.bundles.gguf).

Method (benchmarks/timing.py). Every backend runs in its own worker process (its own thread pools and OpenMP
runtime; workers sleep on a pipe while another measures), loaded once, warmed by one measurement — whose peak RSS
(``VmHWM``: load + prefill ``--prompt`` + decode ``--new``, in a fresh process) is the memory figure — then driven
round-robin: each round runs every backend once, in a rotated order, so load from other jobs hits all alike. (No
quiet pause before a measurement, as before the timing module: in an A/B at load ~1.5 the prefill that starts it
ran slower after one, 35-48 ms against 27-34 ms for rust f32.) One measurement = prefill of the prompt
(``<|endoftext|>`` + Bangla/English text, our token ids), then ``--new`` greedy steps through the backend's Sequence (``prefill``/``decode`` → logits → numpy
argmax → next id: the same Python loop for all). Reported: medians over rounds, and the median of per-round ratios
for the targets (rust f32 ≥ 1.5× ort fp32; rust q8_0 ≥ 1.0× llama.cpp q8_0; rust q4_0 ≥ 1.2× llama.cpp Q4_0;
rust q4_mix ≥ 1.0× llama.cpp Q4_K_M). Every backend gets the same
thread count; the default runs all cores and then 1 thread.

Roofline (benchmarks/roofline.py). Memory bandwidth is measured here (numpy: threads each ``dot`` two float32
arrays of 256 MiB total per pass; bytes read / time, best of several passes, before and after each group). Decode
must read every matmul weight once per token (the lm_head included, the embedding lookup not): roofline tok/s =
bandwidth ÷ weight bytes, at 4 bytes/weight for f32, 34/32 for q8_0 (a float16 scale per 32 int8s; ORT's
MatMulNBits keeps float32 scales: 36/32); the 4-bit lanes count each matrix at its own type (lanes.weight_bytes). A share above
100 % means the weights were (partly) served from cache (the 300 MiB L3 is shared with the host).

Output: ``--out``/decode.json (results keyed by bundle and thread count; a new run replaces only its own keys
unless ``--fresh``), decode.md (tables) and decode.png (bar chart). Times are wall-clock on a machine shared with
other jobs: the load average is recorded next to each group.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import bundles, lanes, roofline, timing  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from contract.bundle import CONFIG, TOKENIZER  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = (("rust-f32", "ort-fp32", 1.5), ("rust-q8_0", "llama-q8_0", 1.0),  # (lane, peer lane, target ratio)
           ("rust-q4_0", "llama-q4_0", 1.2), ("rust-q4_mix", "llama-q4_k_m", 1.0))
PROMPT_TEXT = ("বাংলা ভাষা দক্ষিণ এশিয়ার একটি ইন্দো-আর্য ভাষা। আমি বাংলায় গান গাই, আমি বাংলার গান গাই। "
               "The history of the river is the history of the people who live beside it. ")


# ---------------------------------------------------------------- worker side (one backend per process)

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
    """``--worker NAME``: load, warm up (report peak RSS), then answer each "run" with one measurement."""
    channel = timing.Channel()
    prompt = [int(x) for x in a.ids.split(",")]
    t = time.perf_counter()
    backend = lanes.load(lanes.LANES[a.worker], Path(a.bundle[0]), a.threads[0], len(prompt) + a.new + 1,
                         a.extra_bufts)
    load_s = time.perf_counter() - t
    warm = measure(backend, prompt, a.new)
    channel.send({"ready": True, "load_s": load_s, "peak_rss_mb": timing.rss_mb(), "rss_mb": timing.rss_mb("VmRSS"),
                  "warmup": warm})
    for _ in channel.requests():
        channel.send(measure(backend, prompt, a.new))
    if hasattr(backend, "close"):
        backend.close()  # llama-cpp-python frees its model here, not in a finalizer at interpreter exit
    return 0


def start_worker(name: str, bundle: Path, threads: int, ids: list[int], new: int, log: Path,
                 extra_bufts: bool) -> timing.Worker:
    """One backend's worker process, loaded and warmed (its ``ready`` message holds the warm-up)."""
    args = ["--worker", name, "--bundle", str(bundle), "--threads", str(threads), "--new", str(new),
            "--ids", ",".join(map(str, ids))] + (["--extra-bufts"] if extra_bufts else [])
    return timing.Worker(name, "benchmarks.decode", args, log, threads)


# ---------------------------------------------------------------- orchestrator

def prompt_ids(bundle: Path, n: int) -> list[int]:
    """``<|endoftext|>`` + PROMPT_TEXT's ids from the bundle's tokenizer, repeated to exactly ``n`` ids."""
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(bundle / TOKENIZER)).encode(PROMPT_TEXT).ids
    ids = [bundles.eot_id(bundle)] + (text * (n // max(1, len(text)) + 1))
    return ids[:n]


def prepare(bundle: Path, names: list[str], log: Callable[[str], None]) -> dict[str, str]:
    """Make the GGUF files the llama.cpp backends need; returns {backend: why it is skipped}."""
    skipped = {}
    for name in names:
        lane = lanes.LANES[name]
        why = lanes.unavailable(lane, bundle)
        if why is None and lane.runtime == "llama":
            bundles.gguf(bundle, lane.kind, log=log)
        if why:
            skipped[name] = why
            log(f"skip {name}: {why}")
    return skipped


def start_workers(bundle: Path, names: list[str], threads: int, ids: list[int], new: int, logdir: Path,
                  log: Callable[[str], None]) -> tuple[dict[str, timing.Worker], dict[str, str], dict[str, str]]:
    """Start (one after the other) and warm every worker. llama.cpp q8_0 first tries its extra buffer types (AMX,
    repacking) and falls back to ``use_extra_bufts=False`` if the worker dies (the AMX SIGILL of rust-facts §8).
    Returns (workers, {name: why it failed}, {name: note})."""
    workers, failed, notes = {}, {}, {}
    for name in names:
        llama = lanes.LANES[name].runtime == "llama"
        for extra in [True, False] if llama else [False]:
            try:
                workers[name] = start_worker(name, bundle, threads, ids, new, logdir / f"{name}-{threads}t.log",
                                             extra)
                if llama:
                    notes[name] = f"use_extra_bufts={extra}"
                break
            except timing.WorkerDied as e:
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


def summarize(per: dict[str, list[dict]], ready: dict[str, dict], cfg: dict, bw: float) -> dict[str, dict]:
    """Medians and roofline shares per backend; also how many leading greedy tokens agree with torch's."""
    ref = ready.get("torch", {}).get("warmup", {}).get("tokens")
    out = {}
    for name, runs in per.items():
        lane = lanes.LANES[name]
        dec = [r["decode_tok_s"] for r in runs]
        wb = lanes.weight_bytes(lane, cfg)
        roof = bw * 1e9 / wb
        toks = ready[name]["warmup"]["tokens"]
        agree = None
        if ref is not None:
            agree = next((i for i, (x, y) in enumerate(zip(ref, toks)) if x != y), min(len(ref), len(toks)))
        out[name] = {
            "label": lane.label, "prefill_ms": timing.median(r["prefill_ms"] for r in runs),
            "decode_tok_s": timing.median(dec), "decode_tok_s_min": min(dec), "decode_tok_s_max": max(dec),
            "decode_tok_s_rounds": [round(x, 2) for x in dec], "weight_bytes_per_token": wb,
            "roofline_tok_s": roof, "share_of_roofline": timing.median(dec) / roof,
            "peak_rss_mb": ready[name]["peak_rss_mb"], "rss_mb": ready[name].get("rss_mb"),
            "load_s": ready[name]["load_s"],
            "greedy_agree_with_torch": agree, "tokens_first8": toks[:8],
        }
    return out


def target_ratios(per: dict[str, list[dict]]) -> list[dict]:
    """The targets as medians of per-round decode-speed ratios (same round = same machine load)."""
    rows = []
    for a, b, target in TARGETS:
        if a in per and b in per:
            rs = timing.ratios([x["decode_tok_s"] for x in per[a]], [y["decode_tok_s"] for y in per[b]])
            med = timing.median(rs)
            rows.append({"what": f"{a} / {b}", "target": target, "median": med, "min": min(rs), "max": max(rs),
                         "met": med >= target})
    return rows


def run_group(bundle: Path, names: list[str], threads: int, a: argparse.Namespace, skipped: dict[str, str],
              logdir: Path, log: Callable[[str], None]) -> dict:
    """All rounds for one bundle at one thread count; ``skipped`` ({backend: why}) goes into the result."""
    cfg = json.loads((bundle / CONFIG).read_text())
    ids = prompt_ids(bundle, a.prompt)
    load0 = timing.loadavg()[0]
    bw0 = roofline.bandwidth_gbs(threads)
    log(f"[{timing.relative(bundle)}] {threads} thread(s): bandwidth {bw0:.1f} GB/s, load average {load0:.1f}")
    workers, failed, notes = start_workers(bundle, names, threads, ids, a.new, logdir, log)
    per: dict[str, list[dict]] = {n: [] for n in workers}
    loads = [timing.loadavg()[0]]
    try:
        order = list(workers)
        for r in range(a.rounds):
            for name in timing.rotated(order, r):
                per[name].append(workers[name].ask("run"))
            loads.append(timing.loadavg()[0])
            log(f"  round {r + 1}/{a.rounds}: " + ", ".join(
                f"{n} {per[n][-1]['decode_tok_s']:.1f}" for n in order) + f" tok/s (load {loads[-1]:.1f})")
    finally:
        ends = {n: w.close() for n, w in workers.items()}
    bw1 = roofline.bandwidth_gbs(threads)
    bw = timing.median([bw0, bw1])
    ready = {n: w.ready for n, w in workers.items()}
    for n, e in ends.items():
        ready[n]["peak_rss_mb_end"] = e.get("peak_rss_mb_end")
    weights = roofline.matmul_weights(cfg)
    return {
        "bundle": timing.relative(bundle),
        "name": bundle.resolve().parent.name if bundle.name == "bundle" else bundle.name,
        "threads": threads, "prompt": a.prompt, "new": a.new, "rounds": a.rounds,
        "matmul_weights": weights, "bandwidth_gbs": bw, "bandwidth_gbs_before_after": [bw0, bw1],
        "load_avg": {"start": load0, "min": min(loads), "max": max(loads), "median": timing.median(loads)},
        "backends": summarize(per, ready, cfg, bw), "ratios": target_ratios(per),
        "skipped": {**skipped, **failed}, "notes": notes,
    }


# ---------------------------------------------------------------- report

def markdown(res: dict) -> str:
    m = res["machine"]
    shown = [lanes.LANES[n] for n in lanes.LANES if any(n in g["backends"] for g in res["groups"])]
    per_weight = ", ".join(f"{lane.label} {lane.bytes_per_weight:.4g} B" if lane.bytes_per_weight is not None
                           else f"{lane.label} per matrix" for lane in shown)
    lines = [
        "# Decode speed at batch 1: Rust, onnxruntime, PyTorch, llama.cpp",
        "",
        f"Written by `python benchmarks/decode.py` on {m['cpu']} ({m['cores']} cores, shared with other jobs), "
        f"Python {m['python']}. Prompt of {res['groups'][0]['prompt'] if res['groups'] else '?'} token ids, then "
        "greedy decode; each backend in its own worker process, interleaved round by round; medians over rounds. "
        f"Roofline = measured read bandwidth ÷ matmul weight bytes per token (per weight: {per_weight}; "
        "lm_head included). Peak RSS = VmHWM of the backend's fresh worker after load + prefill + "
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
        colors = [f"C{list(lanes.LANES).index(n)}" for n in names]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", action="append", default=None,
                   help="bundle folder (repeatable; default runs/small/bundle, else --preset small)")
    p.add_argument("--preset", action="append", default=None, choices=bundles.preset_names(),
                   help="time runs/NAME-init/bundle, the untrained twin of configs/NAME.toml, built when absent "
                        "(repeatable)")
    p.add_argument("--threads", type=int, action="append", default=None,
                   help="thread count for every backend (repeatable; default: all cores, then 1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--prompt", type=int, default=64, help="prompt length in tokens (default 64)")
    p.add_argument("--new", type=int, default=64, help="greedy tokens decoded (default 64)")
    p.add_argument("--backends", nargs="+", choices=list(lanes.LANES), default=list(lanes.LANES))
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

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "decode.json"
    if a.report:
        res = json.loads(jpath.read_text())
        atomic_write_text(out / "decode.md", markdown(res))
        plot(res, out / "decode.png")
        return 0
    trained = ROOT / "runs" / "small" / "bundle"
    presets = a.preset or ([] if a.bundle or trained.is_dir() else ["small"])
    folders = [Path(b) for b in a.bundle or ([] if presets else [trained])]
    quantize = lanes.export_quantize(a.backends)
    folders += [bundles.init_bundle(name, quantize=quantize, log=log) for name in presets]
    cores = timing.cores()
    threads = a.threads or sorted({cores, 1}, reverse=True)
    old = [] if a.fresh or not jpath.is_file() else json.loads(jpath.read_text()).get("groups", [])
    logdir = Path(tempfile.mkdtemp(prefix="decode-bench-"))
    log(f"worker logs: {logdir}")
    groups = []
    for bundle in folders:
        if not (bundle / CONFIG).is_file():
            sys.exit(f"{bundle}: not a bundle (export one with python -m export.onnx RUN --quantize q8_0)")
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
    res = {"machine": {"cpu": timing.cpu_name(), "cores": cores, "python": platform.python_version(),
                       "python_baseline_mb": timing.bare_python_rss_mb()},
           "versions": versions, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "groups": merged}
    atomic_write_json(jpath, res)
    atomic_write_text(out / "decode.md", markdown(res))
    plot(res, out / "decode.png")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
