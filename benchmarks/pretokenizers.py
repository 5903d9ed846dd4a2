"""Which llama.cpp pre-tokenizer should Shalik's tokenizer use? Issue 28's measurement.

For today's split (tokenizer format 2) and every split in ``train.tokenizer.pretokenizers.PRETOKENIZERS`` (the
names llama.cpp implements whose words keep Bangla combining marks), train the default config's tokenizer (32,000,
the same 20 M-character sample of the train split that ``python -m train.run`` trains on) and measure:

* fertility — NFC characters per token — on the val split, per input file and per language, and on the
  script-edge strings (``pretokenizers.SCRIPT_EDGES``);
* when llama-cpp-python is installed: llama.cpp's own token ids on a vocabulary-only GGUF of that tokenizer
  (``export.gguf.write_vocab_gguf``) against tokenizers' on every val document and edge string (NFC input);
* the speed of each split (the pre-tokenizer alone, interleaved);
* the share of the corpus that is not NFC (documents and characters, raw input before ``train.corpus`` normalises).

The decision rule (issue 28's, with English held to the same 2 % as Bangla): among the splits llama.cpp
reproduces exactly and detokenizes without cleaning spaces, and that lose at most 2 % of characters per token on
every input file (Bangla literature, Bangla modern, English) against today's, adopt the one whose worse Bangla file
loses least. Writes benchmarks/results/pretokenizers.{md,json,png}.

    python benchmarks/pretokenizers.py [--data ../shared/corpus] [--only deepseek-v3 qwen35]
    python benchmarks/pretokenizers.py --report benchmarks/results/pretokenizers.json   # table and plot only
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fertility import grouped_bars  # noqa: E402
from contract.bundle import TOKENIZER  # noqa: E402
from contract.text import is_val  # noqa: E402
from train.config import load_config  # noqa: E402
from train.corpus import list_input_files  # noqa: E402
from train.parallel import resolve_workers  # noqa: E402
from train.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402
from train.tokenizer.fertility import fertility, load_any_tokenizer, split_docs  # noqa: E402
from train.tokenizer.pretokenizers import LEGACY, PRETOKENIZERS, SCRIPT_EDGES  # noqa: E402
from train.tokenizer.sample import choose_sample  # noqa: E402

TODAY = "format 2 (today)"
MAX_LOSS = 0.02
BN_FILES = ("bn-literature", "bn-modern")


def _raw_texts(f: str):
    opener = gzip.open if f.endswith(".gz") else open
    with opener(f, "rt", encoding="utf-8") as fh:
        for line in fh:
            try:
                text = json.loads(line).get("text")
            except ValueError:
                continue
            if isinstance(text, str) and text.strip():
                yield text


def not_nfc(files: list[str], val_fraction: float) -> tuple[dict, list[str]]:
    """Per file of the raw corpus (JSON Lines ``text`` before ``train.corpus`` normalises it): documents and
    whitespace-separated words that NFC changes, and the characters of those words; plus the raw text of the
    val documents that are not NFC (for llama.cpp, which applies no NFC)."""
    out, raw_val = {}, []
    for f in files:
        c = {"docs": 0, "not_nfc_docs": 0, "words": 0, "not_nfc_words": 0, "chars": 0, "chars_in_not_nfc_words": 0}
        for text in _raw_texts(f):
            n = unicodedata.normalize("NFC", text)
            c["docs"] += 1
            c["chars"] += len(text)
            words = text.split()
            c["words"] += len(words)
            if n != text:
                c["not_nfc_docs"] += 1
                bad = [w for w in words if not unicodedata.is_normalized("NFC", w)]
                c["not_nfc_words"] += len(bad)
                c["chars_in_not_nfc_words"] += sum(map(len, bad))
                if is_val(n, val_fraction):
                    raw_val.append(text)
        out[Path(f).name.split(".")[0]] = c
    return out, raw_val


def llama_cpp_agreement(tok_dir: Path, texts: list[str], approximate: bool, nfc: bool = True) -> dict | None:
    """:func:`export.llamacpp_check.token_agreement` of a tokenizer folder's vocabulary-only GGUF (as a dict), or
    None without llama-cpp-python."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    from export.gguf import write_vocab_gguf
    from export.llamacpp_check import token_agreement

    path = write_vocab_gguf(tok_dir, tok_dir / "vocab.gguf", approximate_pretokenizer=approximate)
    return token_agreement(path, tok_dir / TOKENIZER, texts, nfc=nfc).as_dict()


def split_throughput(splits: list, texts: list[str], rounds: int = 5) -> list[float]:
    """MB/s of each split's pre-tokenizer (``pre_tokenize_str``: the regexes and the byte-level mapping, the part
    of encoding that differs between rows) on ``texts``, one thread, the median of ``rounds`` rounds that visit
    every split in turn (interleaved, so the load of a shared machine hits all alike)."""
    from benchmarks import timing

    pts = [s.pre_tokenizer() for s in splits]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    times: list[list[float]] = [[] for _ in pts]
    for _ in range(rounds):
        for i, pt in enumerate(pts):
            t0 = time.perf_counter()
            for x in texts:
                pt.pre_tokenize_str(x)
            times[i].append(time.perf_counter() - t0)
    return [mb / timing.median(ts) for ts in times]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=[str(ROOT.parent / "shared" / "corpus")])
    p.add_argument("--only", nargs="*", default=None, help="measure these llama.cpp names only (plus today's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--report", metavar="JSON", help="only rewrite the table and plot from a pretokenizers.json")
    p.add_argument("--speed", action="store_true", help="with --report: measure the splits' speed again")
    args = p.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text(encoding="utf-8"))
        if args.speed:
            cfg = load_config("small", ["data.paths=" + json.dumps(args.data)])
            add_speeds(result, [d.text for d in split_docs(list_input_files(args.data), "val", cfg.data.val_fraction)])
        report(result, Path(args.out))
        return 0
    files = list_input_files(args.data)
    cfg = load_config("small", ["data.paths=" + json.dumps(args.data)])
    val = list(split_docs(files, "val", cfg.data.val_fraction))
    by_file = lambda d: Path(d.origin).name.split(".")[0]  # noqa: E731
    nfc, raw_val = not_nfc(files, cfg.data.val_fraction)
    print(f"not NFC: {nfc}; {len(raw_val)} val documents are not NFC", flush=True)

    t = cfg.tokenizer
    texts, stats = choose_sample(files, cfg.data.languages, t.sample_weights, t.sample_chars, cfg.data.val_fraction,
                                 workers=resolve_workers(cfg.data.num_workers))
    print(f"sample: {stats}", flush=True)
    names = [n for n in PRETOKENIZERS if args.only is None or n in args.only]
    splits = [(TODAY, LEGACY)] + [(n, PRETOKENIZERS[n]) for n in names]
    edges = list(SCRIPT_EDGES.values())
    work = Path(tempfile.mkdtemp(prefix="pretokenizers-"))
    rows, t_start = [], time.time()
    try:
        for i, (name, split) in enumerate(splits):
            t0 = time.time()
            tok = train_tokenizer(texts, t.vocab_size, t.min_frequency, split=split)
            train_s = time.time() - t0
            d = work / name.replace(" ", "_")
            save_tokenizer(tok, d)
            ad = load_any_tokenizer(d)
            files_res, lang_res = fertility(ad, val, group=by_file), fertility(ad, val)
            edge_tokens = sum(len(tok.encode(e, add_special_tokens=False).ids) for e in edges)
            edge_chars = sum(len(unicodedata.normalize("NFC", e)) for e in edges)
            agree = {"val": llama_cpp_agreement(d, [x.text for x in val], split is LEGACY),
                     "edges": llama_cpp_agreement(d, edges, split is LEGACY),
                     "val_not_nfc_raw": llama_cpp_agreement(d, raw_val, split is LEGACY, nfc=False)}
            rows.append({"name": name, "digits": split.digits, "clean_spaces": split.clean_spaces,
                         "ignore_merges": split.ignore_merges, "note": split.note, "train_seconds": train_s,
                         "by_file": files_res, "by_lang": lang_res,
                         "edges": {"chars": edge_chars, "tokens": edge_tokens, "chars_per_token": edge_chars / edge_tokens},
                         "llama_cpp": agree})
            done = time.time() - t_start
            eta = done / (i + 1) * (len(splits) - i - 1)
            print(f"[{i + 1}/{len(splits)}] {name}: trained in {train_s:.0f} s; chars/token "
                  + ", ".join(f"{g} {r['chars_per_token']:.3f}" for g, r in sorted(files_res.items()))
                  + f", edges {edge_chars / edge_tokens:.3f}; llama.cpp {agree['val']}; ETA {eta / 60:.1f} min",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {"val_docs": len(val), "val_docs_not_nfc_raw": len(raw_val), "not_nfc": nfc, "sample": stats,
              "vocab_size": t.vocab_size, "max_loss": MAX_LOSS, "rows": rows}
    add_speeds(result, [x.text for x in val])
    report(result, Path(args.out))
    return 0


def add_speeds(result: dict, texts: list[str]) -> None:
    """Put each row's ``split_mb_per_s`` (:func:`split_throughput`) into ``result``."""
    splits = [LEGACY if r["name"] == TODAY else PRETOKENIZERS[r["name"]] for r in result["rows"]]
    for r, v in zip(result["rows"], split_throughput(splits, texts)):
        r["split_mb_per_s"] = v


def report(result: dict, out: Path) -> None:
    """Apply the decision rule to ``result`` (``rows``: today's first) and write pretokenizers.{json,md,png}."""
    rows = result["rows"]
    base = rows[0]["by_file"]
    for r in rows:
        r["change"] = {g: r["by_file"][g]["chars_per_token"] / base[g]["chars_per_token"] - 1 for g in base}
        r["bn_change"] = {g: v for g, v in r["change"].items() if g in BN_FILES}
        a = r["llama_cpp"]
        r["exact"] = None if a["val"] is None else (a["val"]["equal"] == a["val"]["total"]
                                                    and a["edges"]["equal"] == a["edges"]["total"])
    eligible = [r for r in rows[1:] if not r["clean_spaces"] and r["exact"] is not False
                and min(r["change"].values(), default=0) >= -result["max_loss"]]
    result["choice"] = (max(eligible, key=lambda r: min(r["bn_change"].values(), default=0))["name"]
                        if eligible else None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretokenizers.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    md = _markdown(result)
    (out / "pretokenizers.md").write_text(md)
    print(md)
    _plot(rows, out / "pretokenizers.png")


def _markdown(res: dict) -> str:
    rows = res["rows"]
    groups = sorted({g for r in rows for g in r["by_file"]})
    lines = ["# Shalik's tokenizer trained with each llama.cpp pre-tokenizer (issue 28)", "",
             f"NFC characters per token on the {res['val_docs']} val documents and on the "
             f"{len(SCRIPT_EDGES)} script-edge strings; vocabulary {res['vocab_size']:,}, the default config's "
             "sample. `python benchmarks/pretokenizers.py`. llama.cpp: its ids on a vocabulary-only GGUF equal "
             "tokenizers' (val documents, edge strings; NFC input).", "",
             "| split (tokenizer.ggml.pre) | digits | " + " | ".join(groups) + " | bn | en | Bangla Δ (lit / modern) "
             "| edges | llama.cpp = ours | non-NFC input | clean_spaces | split MB/s | verdict |",
             "|---|---|" + "---:|" * len(groups) + "---:|---:|---:|---:|---|---|---|---:|---|"]
    for r in rows:
        cells = [f"{r['by_file'][g]['chars_per_token']:.3f}" if g in r["by_file"] else "—" for g in groups]
        lang = [f"{r['by_lang'][g]['chars_per_token']:.3f}" if g in r["by_lang"] else "—" for g in ("bn", "en")]
        delta = " / ".join(f"{v:+.1%}" for v in r["bn_change"].values()) or "—"
        a = r["llama_cpp"]
        agree = "—" if a["val"] is None else (f"{a['val']['equal']}/{a['val']['total']}, "
                                              f"{a['edges']['equal']}/{a['edges']['total']}")
        raw = a["val_not_nfc_raw"]
        raw = "—" if raw is None else (f"{raw['equal']}/{raw['total']} equal, {raw['tokens_llama_cpp']:,} vs "
                                       f"{raw['tokens']:,} tokens")
        lines.append(f"| {r['name']} | {r['digits']} | " + " | ".join(cells + lang)
                     + f" | {delta} | {r['edges']['chars_per_token']:.3f} | {agree} | {raw}"
                     f" | {'yes' if r['clean_spaces'] else 'no'} | "
                     + (f"{r['split_mb_per_s']:.2f}" if r.get("split_mb_per_s") else "—")
                     + f" | {_verdict(r, res)} |")
    nfc = res["not_nfc"]
    lines += ["", f"Decision rule: among the splits llama.cpp reproduces exactly and detokenizes without cleaning "
              f"spaces, and that lose at most {res['max_loss']:.0%} of characters per token on every file (Bangla "
              "and English), the one whose worse Bangla file loses least: "
              f"**{res['choice'] or 'none — keep format 2'}**. Split MB/s: the pre-tokenizer alone (the part of "
              "encoding that differs between rows) on the val text, one thread, median of 5 interleaved rounds; "
              "the training times in the JSON were not taken on a quiet machine.", "",
              "Corpus not NFC (raw input, before Shalik normalises it): " + "; ".join(
                  f"{g}: {v['not_nfc_docs']:,} of {v['docs']:,} documents, {v['not_nfc_words']:,} of "
                  f"{v['words']:,} words ({v['not_nfc_words'] / max(v['words'], 1):.2%}), "
                  f"{v['chars_in_not_nfc_words']:,} of {v['chars']:,} characters in them"
                  for g, v in sorted(nfc.items())) + f". {res['val_docs_not_nfc_raw']} val documents are not NFC: "
              "the 'non-NFC input' column feeds their raw text to llama.cpp (which applies no NFC).", ""]
    return "\n".join(lines)


def _verdict(r: dict, res: dict) -> str:
    if r["name"] == TODAY:
        return "baseline"
    if r["name"] == res["choice"]:
        return "**adopted**"
    why = [f"{g} {v:+.1%}" for g, v in r["change"].items() if v < -res["max_loss"]]
    if r["clean_spaces"]:
        why.append("llama.cpp cleans spaces when detokenizing")
    if r["exact"] is False:
        why.append("llama.cpp splits differently")
    return "; ".join(why) or f"worse Bangla file {min(r['bn_change'].values()):+.1%}"


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({g for r in rows for g in r["by_file"]})
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    base = rows[0]["by_file"]
    grouped_bars(ax, rows, groups, lambda r, g: 100 * (r["by_file"][g]["chars_per_token"] / base[g]["chars_per_token"]
                                                       - 1) if g in r["by_file"] else 0)
    ax.axhline(-100 * MAX_LOSS, color="red", lw=1, ls="--", label=f"-{MAX_LOSS:.0%} limit")
    ax.set_ylabel("characters per token vs format 2 (%)")
    ax.set_title("Shalik's tokenizer with each llama.cpp pre-tokenizer (val split; higher is better)")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
