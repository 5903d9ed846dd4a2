"""Batch-1 serving latency through ``serve.load``, against PyTorch eager on the same checkpoint, and bits per
character through ``LM.score`` on a validation split.

    python benchmarks/serve_latency.py [BUNDLE] [--prompt-tokens 64] [--new-tokens 64] [--rounds 5]
                                       [--threads N] [--val PATH...] [--val-chars 100000] [--out benchmarks/results]

BUNDLE defaults to the newest ``runs/*/bundle``. Engines: ``onnx`` (fp32), ``onnx-q8_0`` (when the bundle has
model.q8_0.onnx), ``rust`` / ``rust-q8_0`` (when ``rust_runtime`` is built) and ``torch`` (this repository's
PyTorch model, eager, with its KV cache, behind the same backend protocol — so every engine shares the
tokenizer, sampler and detokenizer and only the model differs). Engines run interleaved, round by round, so
load from other jobs on the machine hits them alike (in an order rotated every round, benchmarks/timing.py);
figures are medians over rounds.

``torch-1t`` is the same model at one thread (OpenMP's spinning barriers make PyTorch at N threads collapse
when other jobs share the cores). ``vs torch`` compares with the faster of the two.

* TTFT: from the call (prompt text → tokens included) to the first sampled token — one prefill;
* decode tok/s: tokens after the first / time after the first, greedy, end-of-text ignored (fixed length).

Bits per character: ``LM.score`` over the val documents of ``--val`` (default ``data/sample``; a document is
val when ``contract.text.is_val`` says so at the run's ``val_fraction``), documents split into windows of at
most the context length (each window's first token is predicted from ``<|endoftext|>``), per language, up to
``--val-chars`` characters per language. Writes ``serve_latency.md`` and ``serve_latency.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bundles, timing  # noqa: E402
from benchmarks.lanes import TorchBackend  # noqa: E402

PROMPT_TEXT = ("বাংলা ভাষা দক্ষিণ এশিয়ার একটি ইন্দো-আর্য ভাষা। আমি বাংলায় গান গাই। "
               "The river runs through the old town, and the boats come in at dusk. ") * 40


def engines(bundle: Path, threads: int | None) -> dict:
    """name → LM for every engine available here."""
    from tokenizers import Tokenizer

    from contract.bundle import TOKENIZER, onnx_graph
    from serve import LM, load

    out = {"onnx": load(bundle, backend="onnx", threads=threads)}
    if (bundle / onnx_graph(bundle, "q8_0")).exists():
        # latency, not quality: an untrained twin's forms have no gate verdict
        out["onnx-q8_0"] = load(bundle, backend="onnx", quantize="q8_0", threads=threads, allow_ungated=True)
    try:
        import rust_runtime  # noqa: F401

        out["rust"] = load(bundle, backend="rust", threads=threads)
        out["rust-q8_0"] = load(bundle, backend="rust", quantize="q8_0", threads=threads, allow_ungated=True)
    except ImportError:
        pass
    tok = Tokenizer.from_file(str(bundle / TOKENIZER))
    n = threads or os.cpu_count() or 1
    torch_backend = TorchBackend(bundle, n)
    out["torch"] = LM(torch_backend, tok, name="torch")
    if n > 1:  # OpenMP barriers spin: on a busy machine one thread is often faster, so time both
        out["torch-1t"] = LM(TorchBackend(bundle, 1, model=torch_backend.model), tok, name="torch-1t")
    return out


def prompt_ids(lm, n: int) -> list[int]:
    ids = lm.tokenize(PROMPT_TEXT)
    if len(ids) < n:
        raise SystemExit(f"the prompt text has only {len(ids)} tokens; ask for fewer --prompt-tokens")
    return ids[:n]


def time_one(lm, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s) of one greedy generation of exactly ``new_tokens``."""
    t0 = time.perf_counter()
    gen = lm.start(ids, new_tokens, temperature=0, ignore_eos=True)
    for _ in gen:
        pass
    assert gen.tokens_generated == new_tokens, (gen.tokens_generated, new_tokens)
    ttft = gen.first_token_at - t0
    decode = (new_tokens - 1) / (gen.finished_at - gen.first_token_at)
    return ttft, decode


def latency(lms: dict, prompt_tokens: int, new_tokens: int, rounds: int) -> dict:
    ids = prompt_ids(next(iter(lms.values())), prompt_tokens)
    for lm in lms.values():  # warm-up: first-run allocations, thread pools
        time_one(lm, ids[:8], 4)
    raw = {name: {"ttft_s": [], "decode_tok_s": []} for name in lms}
    for r in range(rounds):
        for name in timing.rotated(list(lms), r):
            ttft, dec = time_one(lms[name], ids, new_tokens)
            raw[name]["ttft_s"].append(ttft)
            raw[name]["decode_tok_s"].append(dec)
    return {name: {"ttft_ms": 1000 * timing.median(r["ttft_s"]),
                   "decode_tok_s": timing.median(r["decode_tok_s"]),
                   "rounds": {"ttft_s": r["ttft_s"], "decode_tok_s": r["decode_tok_s"]}} for name, r in raw.items()}


def val_documents(paths: list[str], val_fraction: float, max_chars: int) -> dict[str, list[str]]:
    """lang → val documents (NFC), up to ``max_chars`` characters per language."""
    from contract.text import detect_language, is_val, nfc
    from train.corpus import iter_documents, list_input_files

    docs: dict[str, list[str]] = {}
    chars: dict[str, int] = {}
    resolved = [str(ROOT / p) if not Path(p).exists() and (ROOT / p).exists() else p for p in paths]
    for doc in iter_documents(list_input_files(resolved)):
        text = nfc(doc.text)
        if not is_val(text, val_fraction):
            continue
        lang = detect_language(text)
        if chars.get(lang, 0) >= max_chars:
            continue
        docs.setdefault(lang, []).append(text)
        chars[lang] = chars.get(lang, 0) + len(text)
    return docs


def bits_per_char(lm, docs: dict[str, list[str]]) -> dict:
    """lang → {bpc, nll_per_token, tokens, chars, docs} through ``lm.score`` on context-sized windows."""
    out = {}
    for lang, texts in docs.items():
        nll = tokens = chars = 0.0
        for text in texts:
            ids = lm.tokenize(text)
            for i in range(0, len(ids), lm.context_length):
                s = lm.score(ids[i:i + lm.context_length])
                nll += s.nll_sum
                tokens += len(s.token_ids)
            chars += len(text)
        out[lang] = {"bpc": nll / math.log(2) / chars, "nll_per_token": nll / tokens, "tokens": int(tokens),
                     "chars": int(chars), "docs": len(texts)}
    return out


def run_val_fraction(bundle: Path) -> float:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    cfg = bundle.parent / "config.toml"
    if cfg.exists():
        return float(tomllib.loads(cfg.read_text()).get("data", {}).get("val_fraction", 0.01))
    return 0.01


def markdown(result: dict) -> str:
    lat, m = result["latency"], result["meta"]
    lines = [f"# Serving latency — `{m['bundle']}`", "",
             f"{m['params']} parameters, context {m['context']}, vocab {m['vocab']}; batch 1, prompt "
             f"{m['prompt_tokens']} tokens, {m['new_tokens']} new tokens (greedy, end-of-text ignored), "
             f"{m['threads']} threads (torch-1t: 1), median of {m['rounds']} interleaved rounds; {m['machine']}; "
             f"load average at start {m['loadavg']} (the machine is shared: figures move with it).", "",
             "| engine | TTFT (ms) | decode (tok/s) | decode vs best torch |", "|---|---:|---:|---:|"]
    base = max((r["decode_tok_s"] for n, r in lat.items() if n.startswith("torch")), default=None)
    for name, r in lat.items():
        rel = f"{r['decode_tok_s'] / base:.2f}×" if base else "—"
        lines.append(f"| {name} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.0f} | {rel} |")
    if result.get("bpc"):
        lines += ["", f"Bits per character through `score` (onnx fp32), val split of {m['val']}:", "",
                  "| language | bpc | nats/token | tokens | chars | docs |", "|---|---:|---:|---:|---:|---:|"]
        for lang, r in result["bpc"].items():
            lines.append(f"| {lang} | {r['bpc']:.3f} | {r['nll_per_token']:.3f} | {r['tokens']:,} | {r['chars']:,} "
                         f"| {r['docs']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bundle", nargs="?", default=None, help="bundle folder (default: newest runs/*/bundle)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="compute threads for every engine (default: all cores)")
    p.add_argument("--val", nargs="*", default=["data/sample"], help="inputs for the bpc split (a relative path not found here is taken from the repository root)")
    p.add_argument("--val-chars", type=int, default=100_000, help="characters per language to score (0 = skip)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    bundle = bundles.given_or_newest(args.bundle)
    lms = engines(bundle, args.threads)
    onnx = lms["onnx"]
    ctx = onnx.context_length
    if args.prompt_tokens + 1 + args.new_tokens > ctx:
        raise SystemExit(f"prompt {args.prompt_tokens} + 1 + new {args.new_tokens} exceed the context {ctx}")
    lat = latency(lms, args.prompt_tokens, args.new_tokens, args.rounds)
    bpc = {}
    if args.val_chars > 0:
        bpc = bits_per_char(onnx, val_documents(args.val, run_val_fraction(bundle), args.val_chars))
    from contract.bundle import MANIFEST, read_manifest

    manifest = read_manifest(bundle) if (bundle / MANIFEST).exists() else {}
    result = {"meta": {"bundle": timing.relative(bundle), "params": manifest.get("params"), "context": ctx,
                       "vocab": onnx.vocab_size, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                       "rounds": args.rounds, "threads": args.threads or os.cpu_count(), "val": args.val,
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                       "loadavg": ", ".join(f"{x:.1f}" for x in timing.loadavg())},
              "latency": lat, "bpc": bpc}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_latency.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    (args.out / "serve_latency.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
