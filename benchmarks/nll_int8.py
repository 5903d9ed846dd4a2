"""Validation NLL of the 8-bit paths against their float32 twins, on the run's own val shards.

    python benchmarks/nll_int8.py [BUNDLE] [--max-tokens 4096] [--threads N] [--backends rust ort llama]
                                  [--out benchmarks/results]

BUNDLE defaults to runs/small/bundle. Its run folder (the bundle's parent) gives the val shards, as
``export.onnx --quantize int8`` finds them: ``config.toml`` → ``data.cache_dir``/shards/<fp>/val-*.bin, the shard
set whose tokenizer sha256 equals the bundle's; windows of the run's ``train.seq_len`` + 1 ids, up to
``--max-tokens`` predicted positions per language (``export.valdata``). NLL is nats/token over every predicted
position, computed from all-position logits of one forward per window (``export.quantize.nll_sum``).

Pairs: rust f32 vs rust int8 (rust_runtime, candle q8_0; target Δ ≤ 0.05 nats/token), onnxruntime fp32 vs int8
(model.int8.onnx) and llama.cpp f32 vs q8_0 (export.gguf's files, f32 KV cache) where available. Writes
``decode_nll_int8.json`` and ``.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from export.quantize import nll_sum  # noqa: E402
from export.valdata import ValData, find_run_shards, from_shards, run_seq_len  # noqa: E402
from serve.bundle import CONFIG, ONNX_INT8, TOKENIZER, gguf_file  # noqa: E402
from train.atomic import atomic_write_json, atomic_write_text, sha256_file  # noqa: E402

TARGET = 0.05


def val_windows(bundle: Path, max_tokens: int) -> ValData:
    """The run's val windows for ``bundle`` (a ``runs/NAME/bundle`` folder). Exits with a message when the run
    has no shards made with the bundle's tokenizer."""
    run = bundle.resolve().parent
    tok = bundle / TOKENIZER
    shards = find_run_shards(run, tok)
    if shards is None:
        sys.exit(f"{run}: no val shards found through its config.toml for this tokenizer")
    cfg = json.loads((bundle / CONFIG).read_text())
    return from_shards(shards, cfg["vocab_size"], sha256_file(tok), run_seq_len(run, cfg["max_position_embeddings"]),
                       max_tokens)


def nll(logits_fn: Callable[[list[int]], np.ndarray], val: ValData) -> dict[str, dict]:
    """``{lang: {nll, tokens}, "all": {…}}`` in nats/token; ``logits_fn(ids)`` → float32 ``[len(ids), V]``."""
    out, tot, n_all = {}, 0.0, 0
    for lang, windows in val.windows.items():
        s, n = 0.0, 0
        for w in windows:
            s += nll_sum(logits_fn(w[:-1].tolist()), w[1:])
            n += len(w) - 1
        out[lang] = {"nll": s / n, "tokens": n}
        tot, n_all = tot + s, n_all + n
    return {"all": {"nll": tot / n_all, "tokens": n_all}, **out}


def pairs(bundle: Path, threads: int | None, which: list[str],
          opened: list) -> dict[str, tuple[Callable, Callable] | str]:
    """{pair name: (f32 logits_fn, 8-bit logits_fn)} or {pair name: why it is skipped}; llama.cpp backends are
    appended to ``opened`` (close them before exit: llama-cpp-python's finalizer fails at interpreter shutdown)."""
    out: dict[str, tuple[Callable, Callable] | str] = {}
    if "rust" in which:
        try:
            import rust_runtime as rr

            f32, q8 = (rr.Model.load(str(bundle), threads=threads, quantize=q) for q in (None, "int8"))
            out["rust f32 → int8 (q8_0)"] = (f32.logits, q8.logits)
        except ImportError as e:
            out["rust f32 → int8 (q8_0)"] = f"rust_runtime not importable ({e})"
    if "ort" in which:
        from serve.backends.onnx import OnnxBackend

        if (bundle / ONNX_INT8).is_file():
            out["onnxruntime fp32 → int8"] = tuple(OnnxBackend(bundle, quantize=q, threads=threads).logits
                                                   for q in (None, "int8"))
        else:
            out["onnxruntime fp32 → int8"] = f"no {ONNX_INT8} in the bundle"
    if "llama" in which:
        try:
            import llama_cpp  # noqa: F401

            from export.gguf import export_gguf
            from serve.backends.llamacpp import LlamaCppBackend

            fns = []
            for t in ("f32", "q8_0"):
                path = bundle / gguf_file(t)
                if not path.is_file():
                    export_gguf(bundle, path, t, approximate_pretokenizer=True)
                lc = LlamaCppBackend(path, threads=threads, logits_all=True)
                opened.append(lc)
                fns.append(lambda ids, lc=lc: lc.new_sequence().prefill(ids, all_logits=True))
            out["llama.cpp f32 → q8_0"] = tuple(fns)
        except ImportError as e:
            out["llama.cpp f32 → q8_0"] = f"llama-cpp-python not importable ({e})"
    return out


def markdown(res: dict) -> str:
    lines = [f"# Validation NLL of the 8-bit paths: `{res['bundle']}`", "",
             f"Written by `python benchmarks/nll_int8.py`. {res['tokens']:,} predicted positions from `{res['data']}` "
             f"(windows of {res['seq_len']} + 1 ids, ≤ {res['max_tokens']} positions per language); nats/token. "
             f"Target for rust int8: Δ ≤ {TARGET} nats/token.", "",
             "| pair | f32 NLL | 8-bit NLL | Δ all | " + " | ".join(f"Δ {k}" for k in res["langs"]) + " | seconds |",
             "|---|---:|---:|---:|" + "---:|" * len(res["langs"]) + "---:|"]
    for name, r in res["pairs"].items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |")
            continue
        lines.append(f"| {name} | {r['f32']['all']['nll']:.4f} | {r['q8']['all']['nll']:.4f} | {r['delta']:+.4f} | "
                     + " | ".join(f"{r['delta_by_lang'][k]:+.4f}" for k in res["langs"]) + f" | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", default=str(ROOT / "runs" / "small" / "bundle"))
    p.add_argument("--max-tokens", type=int, default=4096, help="predicted positions per language (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: each runtime's, all cores)")
    p.add_argument("--backends", nargs="+", choices=["rust", "ort", "llama"], default=["rust", "ort", "llama"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    bundle = Path(a.bundle)
    val = val_windows(bundle, a.max_tokens)
    res = {"bundle": str(bundle), "data": val.origin, "tokens": val.tokens, "max_tokens": a.max_tokens,
           "seq_len": max(len(w) for ws in val.windows.values() for w in ws) - 1, "langs": list(val.windows),
           "target": TARGET, "pairs": {}}
    opened: list = []
    try:
        for name, fns in pairs(bundle, a.threads, a.backends, opened).items():
            if isinstance(fns, str):
                res["pairs"][name] = {"skipped": fns}
                print(f"{name}: skipped ({fns})", flush=True)
                continue
            t = time.time()
            f32, q8 = nll(fns[0], val), nll(fns[1], val)
            r = {"f32": f32, "q8": q8, "delta": q8["all"]["nll"] - f32["all"]["nll"],
                 "delta_by_lang": {k: q8[k]["nll"] - f32[k]["nll"] for k in val.windows}, "seconds": time.time() - t}
            res["pairs"][name] = r
            print(f"{name}: {f32['all']['nll']:.4f} → {q8['all']['nll']:.4f} (Δ {r['delta']:+.4f}) "
                  f"in {r['seconds']:.0f} s", flush=True)
    finally:
        for lc in opened:
            lc.close()
    rust = res["pairs"].get("rust f32 → int8 (q8_0)", {})
    res["rust_int8_ok"] = None if "delta" not in rust else bool(rust["delta"] <= TARGET)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "decode_nll_int8.json", res)
    atomic_write_text(out / "decode_nll_int8.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
