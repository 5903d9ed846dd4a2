"""Text in, text out through llama.cpp (issue 28): does a bundle's GGUF tokenize and generate in llama.cpp as the
bundle does in Shalik?

Writes the bundle's f32 GGUF (``export.gguf``, no flags) into a scratch folder and, through llama-cpp-python
(``export.llamacpp_check``):

* token ids from llama.cpp's own tokenizer against the bundle's ``tokenizer.json`` on every val document of
  ``--data`` and on every script-edge string (``train.tokenizer.pretokenizers.SCRIPT_EDGES``), NFC input; then
  the raw text of the val documents that are not NFC, and the edge strings as written (llama.cpp applies no NFC);
* greedy text in, text out for 10 prompts per language: llama.cpp's completion (its tokenizer, the GGUF's BOS,
  greedy sampling, its detokenizer; f32 KV cache) against ``serve.load(BUNDLE).complete(prompt,
  temperature=0)``; a difference counts as a near-tie when the bundle's top-2 log-probs there are within 1e-3.

Writes benchmarks/results/llamacpp_parity.{md,json}.

    python benchmarks/llamacpp_parity.py BUNDLE [--data ../shared/corpus] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pretokenizers import not_nfc  # noqa: E402
from contract.bundle import TOKENIZER  # noqa: E402
from export.gguf import export_gguf  # noqa: E402
from export.llamacpp_check import GREEDY_PROMPTS, greedy_text_agreement, token_agreement  # noqa: E402
from train.corpus import list_input_files  # noqa: E402
from train.tokenizer.fertility import split_docs  # noqa: E402
from train.tokenizer.pretokenizers import SCRIPT_EDGES  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("--data", nargs="+", default=[str(ROOT.parent / "shared" / "corpus")])
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    bundle = Path(args.bundle)
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"error: llama-cpp-python is not installed ({e}); pip install -e \".[bench]\"", file=sys.stderr)
        return 2
    files = list_input_files(args.data)
    val = [d.text for d in split_docs(files, "val", args.val_fraction)]
    counts, raw_val = not_nfc(files, args.val_fraction)
    edges = list(SCRIPT_EDGES.values())
    tj = bundle / TOKENIZER
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="llamacpp-parity-") as tmp:
        gguf = export_gguf(bundle, Path(tmp) / "model-f32.gguf", "f32", log=lambda m: None)
        print(f"wrote the f32 GGUF in {time.time() - t0:.0f} s; tokenizing {len(val)} val documents", flush=True)
        ids = {"val (NFC)": token_agreement(gguf, tj, val), "script edges (NFC)": token_agreement(gguf, tj, edges),
               "val not NFC (raw)": token_agreement(gguf, tj, raw_val, nfc=False),
               "script edges (raw)": token_agreement(gguf, tj, edges, nfc=False)}
        for k, v in ids.items():
            print(f"{k}: {v.equal}/{v.total} equal", flush=True)
        t1 = time.time()
        greedy = greedy_text_agreement(gguf, bundle, GREEDY_PROMPTS, args.new_tokens)
        print(f"greedy: {sum(r.equal for r in greedy)}/{len(greedy)} equal in {time.time() - t1:.0f} s", flush=True)
    raw_edges = {k: unicodedata.is_normalized("NFC", v) for k, v in SCRIPT_EDGES.items()}
    result = {"bundle": str(bundle), "new_tokens": args.new_tokens, "not_nfc": counts,
              "ids": {k: v.as_dict() for k, v in ids.items()}, "edges_nfc": raw_edges,
              "greedy": [r.__dict__ for r in greedy]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp_parity.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    md = _markdown(result, ids, greedy)
    (out / "llamacpp_parity.md").write_text(md)
    print(md)
    ok = all(ids[k].equal == ids[k].total for k in ("val (NFC)", "script edges (NFC)")) and all(r.ok for r in greedy)
    return 0 if ok else 1


def _markdown(res: dict, ids: dict, greedy: list) -> str:
    lines = ["# llama.cpp against the bundle: token ids and greedy text (issue 28)", "",
             f"Bundle `{res['bundle']}`, its f32 GGUF (`python -m export.gguf`, no flags) in llama-cpp-python. "
             "`python benchmarks/llamacpp_parity.py BUNDLE`.", "",
             "| texts | llama.cpp ids = tokenizer.json | tokens (ours / llama.cpp) | first difference |",
             "|---|---:|---:|---|"]
    for k, v in ids.items():
        first = v.differences[0][0].replace("\n", " ")[:50] if v.differences else ""
        lines.append(f"| {k} | {v.equal} / {v.total} | {v.tokens:,} / {v.tokens_llama_cpp:,} | {first} |")
    not_nfc = [k for k, is_nfc in res["edges_nfc"].items() if not is_nfc]
    lines += ["", f"Script-edge strings not in NFC as written: {', '.join(not_nfc) or 'none'}.", "",
              f"Greedy text in, text out, {res['new_tokens']} new tokens: "
              f"**{sum(r.equal for r in greedy)} / {len(greedy)} identical**"
              + (f", {sum(r.near_tie is not None for r in greedy)} near-ties" if any(not r.equal for r in greedy)
                 else "") + ".", "", "| lang | prompt | Shalik (serve.load, greedy) | llama.cpp | |", "|---|---|---|---|---|"]
    for r in greedy:
        mark = "=" if r.equal else ("near-tie" if r.near_tie is not None else "**differs**")
        lines.append(f"| {r.lang} | {r.prompt} | {r.ours.replace(chr(10), ' ')[:60]} | "
                     f"{r.theirs.replace(chr(10), ' ')[:60]} | {mark} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
