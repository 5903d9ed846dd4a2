"""Batched decode in serve's onnx backend: ``OnnxBackend.decode_batch`` (B sequences in one session run, caches
left-padded) against B ``OnnxSequence.decode`` calls, over the same sequences, at B = 1, 2, 4, 8, 16, for the fp32
graph and its q8_0 one.

The model is ``runs/PRESET-init/bundle`` (default ``small``: configs/small.toml untrained, made by ``train.run``
and ``export.onnx --quantize q8_0`` when absent; benchmarks/bundles.py); its model.onnx and model.q8_0.onnx are
opened with serve's OnnxBackend. For each B and graph, three sets of B sequences get the same prompts (lengths 8 to
32, all different, so the batch is padded) and then the same greedy tokens, round by round, interleaved:

* ``batched``: ``decode_batch`` (the padded presents kept between steps);
* ``single``: one ``decode`` per sequence per step;
* ``repadded``: ``decode_batch`` with ``keep_batched_cache = False``, so every step copies each cache into a fresh
  padded batch (what the kept cache saves).

Decode tokens/s = tokens appended / wall time of the steps; per B the median over rounds is reported, with the
ratio batched / single, and max |logit| difference of batched and repadded against single (same tokens).
Writes benchmarks/results/onnx_batching.{json,md}.

    nice python benchmarks/onnx_batching.py [--preset small] [--threads 2] [--batch 1 2 4 8 16] [--rounds 5]
        [--steps 16] [--graphs fp32 q8_0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bundles, timing  # noqa: E402

MODES = ("batched", "single", "repadded")


def prompts(b: int, vocab_size: int) -> list[list[int]]:
    """B prompts of different lengths (8..32 tokens), ids spread over the vocabulary."""
    return [[(17 + 131 * j + 7919 * i) % vocab_size for i in range(8 + (j * 11) % 25)] for j in range(b)]


def step(backend, mode: str, seqs, toks):
    """One decode step of every sequence in ``seqs``: logits [B, V]."""
    import numpy as np

    if mode == "single":
        return np.stack([s.decode(t) for s, t in zip(seqs, toks, strict=True)])
    backend.keep_batched_cache = mode == "batched"
    return backend.decode_batch(seqs, toks)


def run_batch(backend, b: int, rounds: int, steps: int) -> dict:
    """Interleaved rounds (batched, single, repadded in turn) over three sets of the same B sequences."""
    import numpy as np

    sets = {m: [backend.new_sequence() for _ in range(b)] for m in MODES}
    toks = []
    for m in MODES:
        toks = [int(s.prefill(p).argmax()) for s, p in zip(sets[m], prompts(b, backend.vocab_size), strict=True)]
    times = {m: [] for m in MODES}
    diff = {m: 0.0 for m in MODES}
    agree, total = 0, 0
    for _ in range(rounds):
        logits = {}
        inputs = [toks]  # every mode gets the same tokens: the batched run's greedy choices
        for m in MODES:
            out = []
            t0 = time.perf_counter()
            for k in range(steps):
                out.append(step(backend, m, sets[m], inputs[k]))
                greedy = [int(t) for t in out[-1].argmax(-1)]  # every mode picks its tokens (a generation loop)
                if m == "batched":
                    inputs.append(greedy)
            times[m].append(time.perf_counter() - t0)
            logits[m] = out
        for m in MODES:
            diff[m] = max(diff[m], max(float(np.abs(a - s).max())
                                       for a, s in zip(logits[m], logits["single"], strict=True)))
        toks = inputs[-1]
        for a, s in zip(logits["batched"], logits["single"], strict=True):
            agree += int((a.argmax(-1) == s.argmax(-1)).sum())
            total += a.shape[0]
    tps = {m: [b * steps / t for t in times[m]] for m in MODES}
    med = {m: timing.median(v) for m, v in tps.items()}
    return {
        "batch": b, "rounds": rounds, "steps": steps,
        "prompt_lengths": [len(p) for p in prompts(b, backend.vocab_size)],
        "tokens_per_s": med, "tokens_per_s_rounds": tps,
        "ratio_batched_vs_single": med["batched"] / med["single"],
        "ratio_repadded_vs_batched": med["repadded"] / med["batched"],
        "max_abs_logit_diff_vs_single": {m: diff[m] for m in ("batched", "repadded")},
        "greedy_agreement_vs_single": agree / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=bundles.preset_names())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--graphs", nargs="+", choices=["fp32", "q8_0"], default=["fp32", "q8_0"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "onnx_batching")
    args = ap.parse_args()

    import onnxruntime as ort

    from contract.atomic import atomic_write_json, atomic_write_text
    from contract.quant import parse
    from serve.backends.onnx import OnnxBackend

    load_before = timing.loadavg()
    rows = []
    bundle = bundles.init_bundle(args.preset, quantize="q8_0" if "q8_0" in args.graphs else None)
    backends = {g: OnnxBackend(bundle, quantize=None if g == "fp32" else parse(g), threads=args.threads)
                for g in args.graphs}
    for backend in backends.values():
        run_batch(backend, 2, 1, 2)  # warm-up
    for b in args.batch:
        for graph, backend in backends.items():
            r = {"graph": graph, **run_batch(backend, b, args.rounds, args.steps)}
            rows.append(r)
            t = r["tokens_per_s"]
            print(f"{graph} B={b:2d}: batched {t['batched']:7.1f}  single {t['single']:7.1f}  repadded "
                  f"{t['repadded']:7.1f} tok/s  batched/single {r['ratio_batched_vs_single']:.2f}  max|dlogit| "
                  f"{r['max_abs_logit_diff_vs_single']['batched']:.1e}", flush=True)
    commit = timing.git_commit()
    meta = {"shape": args.preset, "bundle": timing.relative(bundle), "threads": args.threads, "rounds": args.rounds,
            "steps": args.steps, "onnxruntime": ort.__version__, "cores": timing.cores(), "commit": commit,
            "loadavg_before": load_before, "loadavg_after": timing.loadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out.with_suffix(".json"), {"meta": meta, "rows": rows})
    lines = [
        "# onnx_batching: OnnxBackend.decode_batch vs one decode per sequence",
        "",
        f"`{args.preset}` random-init, onnxruntime {meta['onnxruntime']}, {args.threads} threads, {args.rounds} "
        f"interleaved rounds of {args.steps} steps per B (median), commit {commit}; load average "
        f"{' '.join(map(str, load_before))} before, {' '.join(map(str, meta['loadavg_after']))} after, on "
        f"{meta['cores']} cores.",
        "",
        "| graph | B | batched tok/s | single tok/s | batched / single | repadded tok/s | repadded / batched "
        "| max abs logit diff batched vs single | same greedy token as single |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["tokens_per_s"]
        lines.append(f"| {r['graph']} | {r['batch']} | {t['batched']:.1f} | {t['single']:.1f} | {r['ratio_batched_vs_single']:.2f} "
                     f"| {t['repadded']:.1f} | {r['ratio_repadded_vs_batched']:.2f} "
                     f"| {r['max_abs_logit_diff_vs_single']['batched']:.1e} "
                     f"| {100 * r['greedy_agreement_vs_single']:.1f} % |")
    lines += ["", "B = 1: decode_batch is that one decode call, so its ratio shows the noise of the measurement.",
              "", "repadded: decode_batch with `keep_batched_cache = False` (every step copies each cache into a "
              "fresh padded batch). q8_0: the max |logit| difference shows how far a row's logits move with the other "
              "rows of the batch (fp32 rows do not, up to float noise)."]
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
