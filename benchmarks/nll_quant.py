"""Every quantized form of a bundle against its float32 graph, on the run's val shards: the export's quality gate
(:mod:`export.gate`), one row per form, with the float32 of each runtime as a control.

    python benchmarks/nll_quant.py [BUNDLE] [--max-tokens 4096] [--threads N] [--runtimes onnx rust llama.cpp]
                                   [--out benchmarks/results]

BUNDLE defaults to runs/small/bundle. Windows: the shards of its run folder (the bundle's parent) made with the
bundle's tokenizer, as ``export.onnx --quantize`` finds them (``export.valdata.bundle_val_data``): the run's
``train.seq_len`` + 1 ids, up to ``--max-tokens`` predicted positions per language. Reference: the bundle's
float32 ``model.onnx`` (onnxruntime), run once per window; every form runs the same windows.

Forms (the schemes and their runtimes: contract/quant.py): onnxruntime's quantized graphs, rust_runtime at load (the
schemes it offers), llama.cpp reading each GGUF type (f32 KV cache). A graph or GGUF the bundle holds
(``model.<scheme>.onnx``, ``model-<type>.gguf``) is used as it is; one it lacks is made in a scratch folder without
the gate (``export.quantize.write_onnx_form``, ``export.gguf.write_gguf``) so that a form the gate would refuse is
measured too (the table says "made here"). Control rows: rust_runtime and llama.cpp in float32 (the runtimes' own
float differences). Writes ``nll_quant.json``, ``.md`` and ``.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from contract.atomic import atomic_path, atomic_write_json, atomic_write_text  # noqa: E402
from contract.bundle import CONFIG, ONNX, ONNX_GRAPHS, TOKENIZER, WEIGHTS, gguf_file  # noqa: E402
from contract.quant import GATE, SCHEMES  # noqa: E402
from export import gate as G  # noqa: E402
from export.gguf_quant import BY_TYPE  # noqa: E402
from export.valdata import bundle_val_data  # noqa: E402

RUNTIMES = ("onnx", "rust", "llama.cpp")
GGUF_TYPES = ("f32", *BY_TYPE)    # f32: the control row


def shown(path: str | Path) -> str:
    """``path`` relative to the repository when inside it (no machine's absolute path in a results file)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return Path(path).name


def forms(bundle: Path, scratch: Path, runtimes: list[str], threads: int | None,
          opened: list) -> tuple[list[G.Form], dict[str, str], set[str]]:
    """(the forms to measure, {form name: why it is skipped}, the names of those made in ``scratch``); llama.cpp
    backends are appended to ``opened`` (close them before exit: llama-cpp-python's finalizer fails at interpreter
    shutdown)."""
    from export.errors import ExportError

    out: list[G.Form] = []
    skipped: dict[str, str] = {}
    made: set[str] = set()
    if "onnx" in runtimes:
        from export.quantize import write_onnx_form
        from serve.backends.onnx import OnnxBackend

        for name in (CONFIG, TOKENIZER):
            shutil.copyfile(bundle / name, scratch / name)
        for s in SCHEMES.values():
            if not s.onnx:
                continue
            where, graph = bundle, ONNX_GRAPHS[s.name]
            if not (bundle / graph).is_file():
                t = time.time()
                write_onnx_form(s, bundle / ONNX, scratch / graph, bundle / WEIGHTS)
                print(f"made {graph} in {time.time() - t:.0f} s", flush=True)
                where = scratch
                made.add(f"onnx {s.name}")
            out.append(G.Form("onnx", s, OnnxBackend(where, quantize=s, threads=threads).logits, graph))
    if "rust" in runtimes:
        try:
            import rust_runtime as rr
        except ImportError as e:
            skipped["rust"] = f"rust_runtime not importable ({e})"
        else:
            out.append(G.Form("rust", None, rr.Model.load(str(bundle), threads=threads, verify=False).logits))
            for s in SCHEMES.values():
                if s.rust:
                    out.append(G.Form("rust", s, rr.Model.load(str(bundle), threads=threads, quantize=s.name,
                                                               verify=False, allow_ungated=True).logits))
                else:
                    skipped[f"rust {s.name}"] = "rust_runtime does not offer it yet (contract/quant.py)"
    if "llama.cpp" in runtimes:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            skipped["llama.cpp"] = f"llama-cpp-python not importable ({e})"
        else:
            from export.gguf import write_gguf
            from serve.backends.llamacpp import LlamaCppBackend

            for type in GGUF_TYPES:
                s = BY_TYPE.get(type)
                name = f"llama.cpp {s.name if s else 'f32'}"
                path = bundle / gguf_file(type)
                if not path.is_file():
                    path = scratch / path.name
                    try:
                        t = time.time()
                        write_gguf(bundle, path, type, approximate_pretokenizer=True)  # we feed it our ids
                        print(f"made {path.name} in {time.time() - t:.0f} s", flush=True)
                    except ExportError as e:
                        skipped[name] = str(e)
                        continue
                    made.add(name)
                lc = LlamaCppBackend(path, threads=threads, logits_all=True)
                opened.append(lc)
                out.append(G.Form("llama.cpp", s, lambda ids, lc=lc: lc.new_sequence().prefill(ids, all_logits=True),
                                  path.name))
    return out, skipped, made


def markdown(res: dict) -> str:
    langs = res["langs"]
    lines = [f"# Quantized forms against float32: `{res['bundle']}`", "",
             f"Written by `python benchmarks/nll_quant.py`. {res['tokens']:,} predicted positions from the run's "
             f"validation shards (windows of {res['seq_len']} + 1 ids, ≤ {res['max_tokens']} positions per "
             f"language); reference: {G.REFERENCE}; {res['seconds']:.0f} s. Δ NLL in nats/token (form minus "
             "float32), top-1 = share of positions whose argmax equals float32's, |Δ log p| = mean absolute change "
             "of the log-probability of float32's top token (nats). The gate (contract/quant.py) holds every language: "
             + "; ".join(f"{b} bits Δ NLL ≤ {t.val_nll_delta_max}, top-1 ≥ {t.top1_agreement_min}, |Δ log p| ≤ "
                         f"{t.mean_abs_top_logprob_delta_max}" for b, t in sorted(GATE.items(), reverse=True)) + ".", "",
             "| form | bits | file (MB) | Δ NLL all | " + " | ".join(f"Δ NLL {k}" for k in langs) + " | "
             + " | ".join(f"top-1 {k}" for k in langs) + " | " + " | ".join(f"\\|Δ log p\\| {k}" for k in langs)
             + " | gate |", "|---|---:|---|---:|" + "---:|" * (3 * len(langs)) + "---|"]
    for name, r in res["forms"].items():
        if "skipped" in r:
            lines.append(f"| {name} | | skipped: {r['skipped']} |")
            continue
        by = r["by_lang"]
        size = (f"{r['file']} ({r['mb']:.1f}{', made here' if r.get('made_here') else ''})" if r.get("file")
                else "at load")
        gate = "—" if r.get("ok") is None else ("pass" if r["ok"] else "**FAIL**")
        lines.append(f"| {name} | {r.get('bits') or 32} | {size} | {r['all']['delta']:+.4f} | "
                     + " | ".join(f"{by[k]['delta']:+.4f}" for k in langs) + " | "
                     + " | ".join(f"{by[k]['top1_agreement']:.3f}" for k in langs) + " | "
                     + " | ".join(f"{by[k]['mean_abs_top_logprob_delta']:.4f}" for k in langs) + f" | {gate} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """Per form and language: Δ NLL, top-1 agreement and mean |Δ log p| (bars, log scale for the last), with the
    gate's 8- and 4-bit limits as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = {n: r for n, r in res["forms"].items() if "by_lang" in r and r.get("bits")}
    if not rows:
        return
    names, langs = list(rows), res["langs"]
    x = np.arange(len(names))
    w = 0.8 / len(langs)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("delta", "val_nll_delta_max", "Δ NLL vs float32 (nats/token)"),
              ("top1_agreement", "top1_agreement_min", "top-1 agreement with float32"),
              ("mean_abs_top_logprob_delta", "mean_abs_top_logprob_delta_max", "mean |Δ log p| of float32's top token"))
    for ax, (key, limit, title) in zip(axes, panels):
        for i, lang in enumerate(langs):
            ax.bar(x + i * w - 0.4 + w / 2, [rows[n]["by_lang"][lang][key] for n in names], w, label=lang)
        for bits, style in ((8, ":"), (4, "--")):
            ax.axhline(GATE[bits].as_dict()[limit], color="red", lw=1, ls=style, label=f"{bits}-bit gate")
        ax.set_xticks(x, names, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    axes[1].set_ylim(min(0.8, min(rows[n]["by_lang"][lg]["top1_agreement"] for n in names for lg in langs) - 0.02),
                     1.005)
    axes[2].set_yscale("log")
    fig.suptitle(f"{res['bundle']}: every quantized form against float32, {res['tokens']:,} validation tokens")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", default=str(ROOT / "runs" / "small" / "bundle"))
    p.add_argument("--max-tokens", type=int, default=4096, help="predicted positions per language (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: each runtime's, all cores)")
    p.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    bundle = Path(a.bundle)
    val, why = bundle_val_data(bundle, max_tokens=a.max_tokens)
    if val is None:
        sys.exit(f"{bundle}: {why}")
    opened: list = []
    t = time.time()
    with tempfile.TemporaryDirectory(prefix="nll-quant-") as td:
        try:
            todo, skipped, made = forms(bundle, Path(td), a.runtimes, a.threads, opened)
            stats = G.measure(G.reference_logits(bundle, a.threads), todo, val, desc="forms")
            sizes = {f.name: ((bundle if f.name not in made else Path(td)) / f.file).stat().st_size / 1e6
                     for f in todo if f.file}
        finally:
            for lc in opened:
                lc.close()
    res = {"bundle": shown(bundle), "data": shown(val.origin), "tokens": val.tokens, "max_tokens": a.max_tokens,
           "seq_len": max(len(w) for ws in val.windows.values() for w in ws) - 1, "langs": list(val.windows),
           "seconds": time.time() - t, "thresholds": {b: th.as_dict() for b, th in GATE.items()}, "forms": {}}
    for f in todo:
        r = G.judge(f, stats[f.name]) if f.scheme else {**stats[f.name], "runtime": f.runtime, "file": f.file}
        r["made_here"] = f.name in made
        if f.file:
            r["mb"] = sizes[f.name]
        res["forms"][f.name] = r
        print(f"{f.name}: ΔNLL {r['all']['delta']:+.4f}, top-1 {r['all']['top1_agreement']:.3f}, "
              f"|Δ log p| {r['all']['mean_abs_top_logprob_delta']:.4f}", flush=True)
    res["forms"].update({n: {"skipped": why} for n, why in skipped.items()})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "nll_quant.json", res)
    atomic_write_text(out / "nll_quant.md", markdown(res))
    plot(res, out / "nll_quant.png")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
