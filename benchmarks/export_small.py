"""Export figures for the `small` preset: wall time, bundle sizes, parity (max |Δlogit| per case), q8_0 NLL change.

    python benchmarks/export_small.py [RUN] [--dtype float32|float16] [--no-int8] [--json OUT] [--md OUT]

RUN defaults to ``runs/small`` when it has a checkpoint, else ``runs/small-init``; make the latter (an untrained
step-0 checkpoint) with

    python -m train.run --config small --name small-init --no-preflight --set train.max_steps=0

The bundle is written to a temporary folder and deleted; the figures go to ``benchmarks/results/export_small.json``
and ``.md`` (and stdout). The parity gate, q8_0 quantisation and its validation NLL are exactly
``python -m export.onnx``'s; times are wall-clock on whatever else the machine is running.
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

from contract.bundle import ONNX_Q8_0, read_manifest  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def default_run() -> Path:
    """runs/small when it has checkpoints, else runs/small-init; exits with the command to make one."""
    for name in ("small", "small-init"):
        run = ROOT / "runs" / name
        if (run / "checkpoints").is_dir():
            return run
    sys.exit("no runs/small or runs/small-init; make one with:\n  python -m train.run --config small --name "
             "small-init --no-preflight --set train.max_steps=0")


def figures(run: Path, dtype: str, int8: bool) -> dict:
    """Export ``run`` into a temporary folder and return the figures (the manifest's, plus timings)."""
    from export.onnx import export_bundle

    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(msg)
        print(msg, flush=True)

    with tempfile.TemporaryDirectory(prefix="export-small-") as td:
        t0 = time.time()
        out = export_bundle(run, Path(td) / "bundle", dtype=dtype, quantize="int8" if int8 else None, log=log)
        wall = time.time() - t0
        m = read_manifest(out)
    steps = {k: v for k, v in ((ln.split(":")[0], ln) for ln in lines) if k in ("onnx", "quantize")}
    return {
        "run": str(run), "step": m["source"]["step"], "untrained": m["source"]["step"] == 0, "params": m["params"],
        "dtype": dtype, "exporter": m["exporter"], "opset": m["opset"], "wall_s": round(wall, 1),
        "log": steps, "bytes": {k: v["bytes"] for k, v in m["files"].items()},
        "parity": [{k: c[k] for k in ("runtime", "case", "value", "tol", "ok")} for c in m["parity"]["cases"]],
        "parity_ok": m["parity"]["ok"], "quantization": m.get("quantization"), "versions": m["versions"],
    }


def markdown(f: dict) -> str:
    """The figures as a Markdown page (sizes, parity table, the quantized forms' gate)."""
    out = [f"# Export of `{f['run']}` ({'untrained, step 0' if f['untrained'] else 'step ' + str(f['step'])})", "",
           f"{f['params']:,} parameters, {f['dtype']}, {f['exporter']} exporter, opset {f['opset']}; "
           f"export + gate{' + q8_0' if f.get('quantization') else ''}: **{f['wall_s']} s** wall "
           f"({'; '.join(f['log'].values())}).", "", "| file | MB |", "|---|---:|"]
    out += [f"| {k} | {v / 1e6:.1f} |" for k, v in sorted(f["bytes"].items(), key=lambda kv: -kv[1])]
    out += ["", "| runtime | case | max \\|Δlogit\\| / tokens | ok |", "|---|---|---:|---|"]
    for c in f["parity"]:
        v = "—" if c["value"] is None else (f"{int(c['value'])}" if c["case"].startswith("greedy")
                                            else f"{c['value']:.2e}")
        out.append(f"| {c['runtime']} | {c['case']} | {v} | {'ok' if c['ok'] else 'FAIL'} |")
    for name, r in ((f.get("quantization") or {}).get("forms") or {}).items():
        if r.get("ok") is None:
            continue
        a = r["all"]
        out += ["", f"{name} val NLL change: {a['delta']:+.5f} nats/token over {a['tokens']:,} tokens (fp32 "
                f"{a['nll_f32']:.4f}, {r['scheme']} {a['nll']:.4f})."]
        out += [f"- {lang}: Δ NLL {v['delta']:+.5f}, top-1 agreement {v['top1_agreement']:.3f}, mean |Δ log p| of "
                f"fp32's top token {v['mean_abs_top_logprob_delta']:.4f} nats" for lang, v in r["by_lang"].items()]
    v = f["versions"]
    out += ["", f"torch {v.get('torch')}, onnx {v.get('onnx')}, onnxruntime {v.get('onnxruntime')}, "
            f"transformers {v.get('transformers')}.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Export, print and write the figures; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", nargs="?", default=None, help="run folder (default: runs/small, else runs/small-init)")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    p.add_argument("--no-q8_0", dest="q8_0", action="store_false", help=f"skip {ONNX_Q8_0}")
    p.add_argument("--json", default=str(RESULTS / "export_small.json"))
    p.add_argument("--md", default=str(RESULTS / "export_small.md"))
    a = p.parse_args(argv)
    f = figures(Path(a.run) if a.run else default_run(), a.dtype, a.int8)
    md = markdown(f)
    print("\n" + md)
    from contract.atomic import atomic_write_json, atomic_write_text

    atomic_write_json(a.json, f)
    atomic_write_text(a.md, md)
    print(f"wrote {a.json} and {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
