"""The ONNX form of q8_0: the graph export writes (``MatMulNBits`` bits 8 holding ggml's q8_0 blocks,
``export.quantize.to_q8_0``) against the 8-bit graphs it could have written — onnxruntime's dynamic per-channel
quantization (``quantize_dynamic``, QInt8 weights, one scale per row: the ``model.int8.onnx`` of bundles before
format minor 1) and onnxruntime's own 8-bit ``MatMulNBitsQuantizer`` (blocks of 32, d = the weight of largest |w| /
−128).

    python benchmarks/onnx_q8_0.py [--bundle DIR | --preset small] [--threads 2] [--rounds 7] [--prompt 64]
                                   [--new 64] [--out benchmarks/results]

Numbers: the logits of one prompt (``<|endoftext|>`` + ``--prompt`` − 1 seeded random ids) from each graph against
the float32 ``model.onnx`` and against ``rust_runtime`` at q8_0 (when built): relative RMS, max |Δ|, top-1 agreement.
Speed: each graph in serve's OnnxBackend, in this one process, round-robin in a rotated order (so load from other
jobs hits all alike): prefill of the prompt, then ``--new`` greedy decode steps; medians over rounds and the median
of per-round ratios against the per-channel graph. Writes ``--out``/onnx_q8_0.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import bundles, timing  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from contract.bundle import ONNX, WEIGHTS  # noqa: E402

GRAPHS = ("per-channel", "ort-8bit", "q8_0")
LABELS = {"per-channel": "onnxruntime dynamic, per channel (before format minor 1)",
          "ort-8bit": "MatMulNBits 8-bit, onnxruntime's quantizer (d = w_max / -128)",
          "q8_0": "MatMulNBits 8-bit holding ggml's q8_0 blocks (what export writes)"}


def write_graphs(bundle: Path, out: Path) -> dict[str, Path]:
    """The three 8-bit graphs of ``bundle``'s model.onnx, written into ``out``."""
    import onnx
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    from contract.quant import SCHEMES
    from export.quantize import ACCURACY_LEVEL, MatMulNBitsQuantizer, write_onnx_form

    pre = out / "pre.onnx"
    quant_pre_process(str(bundle / ONNX), str(pre), skip_symbolic_shape=True, save_as_external_data=True,
                      all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
    paths = {g: out / f"{g}.onnx" for g in GRAPHS}
    quantize_dynamic(str(pre), str(paths["per-channel"]), weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"])
    q = MatMulNBitsQuantizer(onnx.load(str(pre)), bits=8, block_size=32, is_symmetric=True,
                             accuracy_level=ACCURACY_LEVEL)
    q.process()
    onnx.save(q.model.model, str(paths["ort-8bit"]))
    write_onnx_form(SCHEMES["q8_0"], bundle / ONNX, paths["q8_0"], bundle / WEIGHTS)
    return paths


def closeness(a: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Relative RMS of ``a - ref``, max |a - ref| and the share of positions with ref's argmax."""
    return {"rel_rms": float(np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref ** 2))),
            "max_abs": float(np.abs(a - ref).max()),
            "top1": float(np.mean(a.argmax(-1) == ref.argmax(-1)))}


def run_once(backend, prompt: list[int], new: int) -> tuple[float, float]:
    """(prefill ms, decode tokens/s) of one prefill and ``new`` greedy steps."""
    seq = backend.new_sequence()
    t0 = time.perf_counter()
    logits = seq.prefill(prompt)
    t1 = time.perf_counter()
    for _ in range(new):
        logits = seq.decode(int(np.argmax(logits)))
    return 1e3 * (t1 - t0), new / (time.perf_counter() - t1)


def measure(bundle: Path, threads: int, rounds: int, prompt_len: int, new: int) -> dict:
    from serve.backends.onnx import OnnxBackend

    with tempfile.TemporaryDirectory(prefix=".onnx_q8_0-", dir=bundle) as td:
        paths = write_graphs(bundle, Path(td))
        f32 = OnnxBackend(bundle, threads=threads)
        backs = {g: OnnxBackend(bundle, threads=threads, model_file=str(p.resolve())) for g, p in paths.items()}
        rng = np.random.default_rng(0)
        prompt = [bundles.eot_id(bundle)] + [int(x) for x in rng.integers(2, f32.vocab_size, prompt_len - 1)]
        ref = f32.logits(prompt)
        rust = None
        try:
            import rust_runtime

            rust = np.asarray(rust_runtime.Model.load(str(bundle), threads=threads, quantize="q8_0", verify=False,
                                                      allow_ungated=True).logits(prompt))
        except ImportError:
            pass
        logits = {g: b.logits(prompt) for g, b in backs.items()}
        numbers = {g: {"vs_fp32": closeness(lg, ref), "vs_rust_q8_0": closeness(lg, rust) if rust is not None else None}
                   for g, lg in logits.items()}
        if rust is not None:
            numbers["rust q8_0"] = {"vs_fp32": closeness(rust, ref), "vs_rust_q8_0": None}
        for b in backs.values():
            run_once(b, prompt, new)   # warm
        times: dict[str, list[tuple[float, float]]] = {g: [] for g in GRAPHS}
        load = [timing.loadavg()]
        for r in range(rounds):
            for g in timing.rotated(GRAPHS, r):
                times[g].append(run_once(backs[g], prompt, new))
        load.append(timing.loadavg())
    base = times["per-channel"]
    speed = {g: {"prefill_ms": timing.median(p for p, _ in t), "decode_tok_s": timing.median(d for _, d in t),
                 "prefill_time_ratio": timing.median_ratio([p for p, _ in t], [p for p, _ in base]),
                 "decode_ratio": timing.median_ratio([d for _, d in t], [d for _, d in base])}
             for g, t in times.items()}
    return {"bundle": timing.relative(bundle), "cpu": timing.cpu_name(), "threads": threads, "rounds": rounds,
            "prompt": prompt_len, "new": new, "loadavg": load, "numbers": numbers, "speed": speed,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def markdown(res: dict, command: str) -> str:
    lines = [f"# The ONNX form of q8_0: `{res['bundle']}`", "",
             f"{res['cpu']}, {res['threads']} threads, {res['date']}; other jobs ran beside at normal priority "
             f"(load average {res['loadavg'][0][0]:.1f} → {res['loadavg'][-1][0]:.1f}). Command: `{command}`", "",
             "| graph | rel. RMS vs fp32 | max abs Δ vs fp32 | top-1 vs fp32 | rel. RMS vs rust q8_0 | "
             "max abs Δ vs rust q8_0 |", "|---|---:|---:|---:|---:|---:|"]
    for g, n in res["numbers"].items():
        f, r = n["vs_fp32"], n["vs_rust_q8_0"]
        rust = f"{r['rel_rms']:.4f} | {r['max_abs']:.4f}" if r else "– | –"
        lines.append(f"| {LABELS.get(g, g)} | {f['rel_rms']:.4f} | {f['max_abs']:.4f} | {f['top1']:.3f} | {rust} |")
    lines += ["", f"Speed (serve's OnnxBackend, prefill {res['prompt']} tokens then {res['new']} greedy decode steps, "
              f"{res['rounds']} interleaved rounds; ratios are medians of per-round ratios against the per-channel "
              "graph):", "", "| graph | prefill ms | prefill time ÷ per-channel | decode tok/s | decode ÷ per-channel |",
              "|---|---:|---:|---:|---:|"]
    for g, s in res["speed"].items():
        lines.append(f"| {LABELS[g]} | {s['prefill_ms']:.1f} | {s['prefill_time_ratio']:.2f} | "
                     f"{s['decode_tok_s']:.1f} | {s['decode_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=None, help="a bundle folder (default: --preset's untrained twin)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    bundle = a.bundle or bundles.init_bundle(a.preset)
    res = measure(bundle, a.threads, a.rounds, a.prompt, a.new)
    command = "python benchmarks/onnx_q8_0.py " + " ".join(argv if argv is not None else sys.argv[1:])
    atomic_write_json(a.out / "onnx_q8_0.json", res)
    md = markdown(res, command.strip())
    atomic_write_text(a.out / "onnx_q8_0.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
