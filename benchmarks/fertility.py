"""Tokenizer fertility on the val split: Shalik's default tokenizer, issue 2's baseline and the anchors;
plus shard preparation speed.

* ours — the default config's tokenizer (32,000, script-aware split, bn 0.6 / en 0.4 of characters), trained
  on the train split of --data exactly as ``python -m train.run`` would;
* baseline — byte-level BPE, NFC, split `` ?[\\p{L}\\p{M}]+| ?\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+|\\s+(?!\\S)|\\s+``,
  trained on equal Bangla and English characters (7 M each) of the train split (notes/figures.md);
* anchors — gpt2, llama2, mistral-v0.3, gpt-neox-20b, bnlp-bangla-spm (and bangla-bert-base) from
  ``../shared/anchor_tokenizers``.

Fertility is NFC code points per token, per input file and per language, on the val split (sha256 rule of
docs/design.md, val_fraction 0.01). Writes benchmarks/results/fertility.{md,json,png}.

    python benchmarks/fertility.py [--data ../shared/corpus] [--anchors ../shared/anchor_tokenizers]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train.config import load_config  # noqa: E402
from train.corpus import list_input_files  # noqa: E402
from train.data import build_shards, ensure_tokenizer  # noqa: E402
from train.inputs import scan_inputs  # noqa: E402
from train.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402
from train.tokenizer.fertility import fertility, load_any_tokenizer, split_docs  # noqa: E402
from train.tokenizer.pretokenizers import BASELINE  # noqa: E402
from train.tokenizer.sample import sample_texts  # noqa: E402

ANCHORS = ["gpt2", "llama2", "mistral-v0.3", "gpt-neox-20b", "bnlp-bangla-spm", "bangla-bert-base"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=[str(ROOT.parent / "shared" / "corpus")])
    p.add_argument("--anchors", default=str(ROOT.parent / "shared" / "anchor_tokenizers"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    files = list_input_files(args.data)
    cfg = load_config("small", ["data.paths=" + json.dumps(args.data)])
    val = list(split_docs(files, "val", cfg.data.val_fraction))
    group = lambda d: Path(d.origin).name.split(".")[0]  # noqa: E731 - per input file, as in figures.md

    t0 = time.time()
    ours_dir = ensure_tokenizer(cfg, files, scan_inputs(files), log=lambda m: print(m, flush=True))
    ours_s = time.time() - t0
    work = Path(tempfile.mkdtemp(prefix="fertility-"))
    try:
        t0 = time.time()
        make_iter, stats = sample_texts(files, ["bn", "en"], {"bn": 0.5, "en": 0.5}, 14_000_000, cfg.data.val_fraction)
        base = train_tokenizer(make_iter(), 32000, 2, split=BASELINE)
        save_tokenizer(base, work / "baseline")
        base_s = time.time() - t0
        print(f"baseline trained in {base_s:.1f} s on {stats}", flush=True)

        rows = []
        for name, path in [("shalik (ours)", ours_dir), ("baseline", work / "baseline")] + \
                [(a, Path(args.anchors) / a) for a in ANCHORS]:
            if not path.exists():
                print(f"skip {name}: {path} not found")
                continue
            ad = load_any_tokenizer(path)
            by_file = fertility(ad, val, group=group)
            by_lang = fertility(ad, val)
            rows.append({"name": name, "kind": ad.kind, "vocab": ad.vocab_size, "by_file": by_file, "by_lang": by_lang})
            print(name, {k: round(v["chars_per_token"], 3) for k, v in {**by_file, **by_lang}.items()}, flush=True)

        # shard preparation speed with our tokenizer, into a scratch folder
        shard_dir = work / "shards"
        shard_dir.mkdir()
        t0 = time.time()
        index = build_shards(cfg, files, scan_inputs(files), ours_dir, shard_dir, log=lambda m: None)
        prep_s = time.time() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    in_mb = sum(f.stat().st_size for f in map(Path, files)) / 1e6
    text_mb = sum(v["bytes"] for r in rows[:1] for v in r["by_lang"].values())
    result = {"val_docs": len(val), "val_fraction": cfg.data.val_fraction, "tokenizers": rows,
              "train_seconds": {"ours": ours_s, "baseline": base_s},
              "shards": {"seconds": prep_s, "input_mb": in_mb, "mb_per_s": in_mb / prep_s,
                         "train_tokens": index["splits"]["train"]["tokens"], "val_text_mb": text_mb / 1e6}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fertility.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    files_order = sorted({g for r in rows for g in r["by_file"]})
    lines = ["# Tokenizer fertility (NFC characters per token, val split)", "",
             f"{len(val)} val documents (val_fraction {cfg.data.val_fraction}); `python benchmarks/fertility.py`.", "",
             "| tokenizer | vocab | " + " | ".join(files_order) + " | bn | en | bn / en |",
             "|---|---:|" + "---:|" * (len(files_order) + 3)]
    for r in rows:
        bl, fl = r["by_lang"], r["by_file"]
        cells = [f"{fl[g]['chars_per_token']:.2f}" if g in fl else "—" for g in files_order]
        bn, en = bl.get("bn", {}).get("chars_per_token"), bl.get("en", {}).get("chars_per_token")
        ratio = f"{bn / en:.2f}" if bn and en else "—"
        lines.append(f"| {r['name']} | {r['vocab']:,} | " + " | ".join(cells) +
                     f" | {bn or 0:.2f} | {en or 0:.2f} | {ratio} |")
    ours, base_r = rows[0]["by_lang"], rows[1]["by_lang"]
    lines += ["", "Round-trip failures (decode(encode(x)) ≠ x, documents): " + ", ".join(
        f"{r['name']} {sum(v['roundtrip_failures'] for v in r['by_lang'].values())}" for r in rows),
        "", f"Ours vs baseline: Bangla {ours['bn']['chars_per_token'] / base_r['bn']['chars_per_token']:.3f}×, "
        f"English {ours['en']['chars_per_token'] / base_r['en']['chars_per_token']:.3f}×. "
        f"Tokenizer training: ours {ours_s:.0f} s (cached when reused), baseline {base_s:.0f} s.",
        "", f"Shard preparation: {in_mb:.1f} MB of input in {prep_s:.1f} s = **{in_mb / prep_s:.2f} MB/s** "
        f"({index['splits']['train']['tokens']:,} train tokens after resampling to the target mix).", ""]
    (out / "fertility.md").write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(rows, files_order, out / "fertility.png")
    return 0


def grouped_bars(ax, rows: list[dict], groups: list[str], value) -> None:
    """One bar per row (labelled ``row["name"]``) in each group, ``value(row, group)`` high, ticks at the groups."""
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([x + i * width for x in range(len(groups))], [value(r, g) for g in groups], width, label=r["name"])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], groups)


def _plot(rows, groups, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    grouped_bars(ax, rows, groups, lambda r, g: r["by_file"].get(g, {}).get("chars_per_token", 0))
    ax.set_ylabel("NFC characters per token (val)")
    ax.set_title("Tokenizer fertility: higher is better")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
