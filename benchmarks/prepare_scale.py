"""Data preparation at scale: MB/s of text per process count, against the raw tokenizer's limit, interleaved.

A corpus of at least ``--mb`` MB of UTF-8 text is generated from ``data/sample`` (its documents repeated and
shuffled, with a copy number prefixed so no two documents are equal; every copy after the first has the words of
each line shuffled, seeded: the same words, characters and tokens, so tokenizing costs the same, but no word
n-grams in common, so the cleaning stage sees distinct documents, not near-duplicates) into a temporary folder,
as 8 ``.jsonl`` files, each copy titled as a work of its own. A tokenizer is trained once (``small``'s settings, a 5 M-character sample). Then, in each round, for each
process count N (1 and 2 by default), the runs below one after the other, the order rotated from one N and
round to the next (limit, prepare, …, then prepare, limit, …) so that the machine's load hits them alike:

* **limit** — the same work of normalising and tokenizing as the pipeline, and nothing else: the documents'
  texts as the files hold them, already in memory, ``unicodedata`` NFC then Hugging Face tokenizers'
  ``encode_batch_fast`` with the tokenizer's own NFC normalizer off (``train.tokenizer.for_nfc_text``: the text
  is NFC already, so the ids are the same) — exactly what ``prepare``'s workers do — on N forked processes
  (their thread pools off) that take ~1 MB batches as they come free (the pipeline's chunk size): the physical
  limit of tokenizing on N cores, with no reading, parsing, language, hashing, IPC or writing;
* **prepare** — ``train.data.build_shards(..., workers=N)``: read, parse, NFC, language, split and shuffle
  hashes, tokenize, the cleaning stage (``train.clean``: features, hashes and n-grams in the workers; split,
  deduplication and decontamination after), merge, resample and write the shards, pool start included (the input
  scan, done once and cached, is reported apart);
* **no clean** — the same with ``data.clean = false`` (the split of whole works only): prepare / no clean is
  the cleaning stage's cost (wall time and CPU seconds, median of the rounds' ratios of runs side by side); the
  shards of N = 1 and N = 2 are compared byte for byte;
* **shipped** (N = 1, first round only) — ``encode_batch_fast`` of the tokenizer as saved (its NFC normalizer on) on the same
  raw texts: what a plain tokenizer call costs, NFC included, for reference.

Reports MB of text per second (median over rounds), prepare / limit (median of the rounds' ratios of runs side
by side), and the speed-up from 1 to N processes (median of the rounds' ratios, the limit's beside it), then extrapolates 2B tokens on 16 cores from the per-process
rate at the largest N. Writes benchmarks/results/prepare_scale.md, .json and .png.

``--clean-cost-only`` runs prepare and no clean only (the cleaning stage's cost, wall and CPU, and the speed-up of
each from the fewest to the most processes) and writes benchmarks/results/prepare_scale_clean.{md,json}
instead.

    python benchmarks/prepare_scale.py [--mb 100] [--workers 1 2] [--rounds 2] [--clean-cost-only]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import timing  # noqa: E402
from contract.text import nfc  # noqa: E402
from train.config import load_config  # noqa: E402
from train.corpus import iter_documents, list_input_files  # noqa: E402
from train.data import build_shards  # noqa: E402
from train.inputs import scan_inputs  # noqa: E402
from train.parallel import serial_tokenizers  # noqa: E402
from train.tokenizer import for_nfc_text, load_tokenizer, save_tokenizer, train_tokenizer  # noqa: E402
from train.tokenizer.sample import choose_sample  # noqa: E402

_TEXTS: list[str] = []  # the limit's texts (as the files hold them), inherited by the forked processes
_TOKS: dict = {}  # "limit": NFC normalizer off (as prepare's workers), "shipped": as saved


def make_corpus(out: Path, mb: float, seed: int = 0) -> int:
    """Write ≥ ``mb`` MB of text from data/sample into ``out`` as 8 .jsonl files; returns the text bytes."""
    rows = []
    for f in sorted((ROOT / "data" / "sample").glob("*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    handles = [open(out / f"part-{i}.jsonl", "w", encoding="utf-8") for i in range(8)]
    total, copy = 0, 0
    round_ = 0
    while total < mb * 1e6:
        rng.shuffle(rows)
        for r in rows:
            body = r["text"]
            if round_:
                lines = []
                for line in body.split("\n"):
                    w = line.split(" ")
                    rng.shuffle(w)
                    lines.append(" ".join(w))
                body = "\n".join(lines)
            text = f"{copy} {body}"
            r = {**r, "title": f"{r.get('title')} / copy {round_}"}
            total += len(text.encode("utf-8"))
            handles[copy % 8].write(json.dumps({**r, "text": text}, ensure_ascii=False) + "\n")
            copy += 1
        round_ += 1
    for h in handles:
        h.close()
    return total


def _encode_range(args: tuple[str, int, int]) -> int:
    kind, lo, hi = args
    tok = _TOKS[kind]
    texts = [nfc(t) for t in _TEXTS[lo:hi]] if kind == "limit" else _TEXTS[lo:hi]
    return sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))


def _batches(batch_bytes: int = 1 << 20) -> list[tuple[int, int]]:
    """``_TEXTS`` cut into consecutive ranges of about ``batch_bytes`` of UTF-8 each."""
    cuts, acc = [0], 0
    for i, t in enumerate(_TEXTS):
        acc += len(t.encode("utf-8"))
        if acc >= batch_bytes:
            cuts.append(i + 1)
            acc = 0
    if cuts[-1] != len(_TEXTS):
        cuts.append(len(_TEXTS))
    return list(zip(cuts[:-1], cuts[1:]))


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def limit_run(n: int, kind: str = "limit") -> tuple[float, float]:
    """(wall seconds, CPU seconds) of NFC + encode_batch_fast over all _TEXTS on ``n`` forked processes taking
    ~1 MB batches as they come free (wall: pool start excluded); ``kind="shipped"``: the tokenizer's own NFC
    instead of Python's."""
    cpu = _cpu_seconds()
    with serial_tokenizers(), multiprocessing.get_context("fork").Pool(n) as pool:
        pool.map(abs, range(n))  # the workers are up
        t0 = time.perf_counter()
        sum(pool.imap_unordered(_encode_range, [(kind, lo, hi) for lo, hi in _batches()], chunksize=1))
        wall = time.perf_counter() - t0
    return wall, _cpu_seconds() - cpu


def prepare_run(cfg, files, inputs, tok_dir: Path, n: int) -> tuple[float, float, dict, str]:
    """(wall seconds, CPU seconds of this process and its workers, index, sha256 of the shard files) of
    ``build_shards`` on ``n``."""
    out = Path(tempfile.mkdtemp(prefix="prep-", dir=tok_dir.parent))
    try:
        cpu, t0 = _cpu_seconds(), time.perf_counter()
        index = build_shards(cfg, files, inputs, tok_dir, out, log=lambda m: None, workers=n)
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu
        h = hashlib.sha256()
        for f in sorted(out.glob("*.bin")):
            h.update(f.name.encode() + f.read_bytes())
        return wall, cpu, index, h.hexdigest()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="MB of text to generate")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--clean-cost-only", action="store_true",
                   help="only prepare and no clean (the cleaning stage's cost and scaling), written as "
                        "prepare_scale_clean.{md,json}")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="prepare-scale-"))
    load_before = timing.loadavg()
    try:
        text_bytes = make_corpus(work / "corpus", args.mb)
        files = list_input_files([str(work / "corpus")])
        cfg = load_config("small", ["data.paths=" + json.dumps([str(work / "corpus")])])
        cfg_off = load_config("small", ["data.paths=" + json.dumps([str(work / "corpus")]), "data.clean=false"])
        t0 = time.perf_counter()
        inputs = scan_inputs(files, work / "cache", workers=max(args.workers))
        scan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        texts, _ = choose_sample(list_input_files(["data/sample"]), ["bn", "en"], cfg.tokenizer.sample_weights,
                                 5_000_000, cfg.data.val_fraction, workers=max(args.workers))
        sample_s = time.perf_counter() - t0
        tok_dir = work / "tok"
        save_tokenizer(train_tokenizer(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency), tok_dir, None)
        _TOKS["shipped"] = load_tokenizer(tok_dir)
        _TOKS["limit"] = load_tokenizer(tok_dir)
        assert for_nfc_text(_TOKS["limit"])
        for f in files:  # every generated document is bn or en and not blank: prepare keeps them all
            with open(f, encoding="utf-8") as fh:
                _TEXTS.extend(json.loads(line)["text"] for line in fh if line.strip())
        nfc_texts = [d.text for d in iter_documents(files) if d.lang in ("bn", "en")]
        assert len(nfc_texts) == len(_TEXTS)
        nfc_bytes = sum(len(t.encode("utf-8")) for t in nfc_texts)
        del nfc_texts
        print(f"corpus: {text_bytes / 1e6:.1f} MB of text, {len(_TEXTS):,} documents; scan {scan_s:.1f} s", flush=True)
        times: dict[str, dict[int, list[float]]] = {"limit": {}, "prepare": {}, "no clean": {}, "shipped": {}}
        cpus: dict[str, dict[int, list[float]]] = {"limit": {}, "prepare": {}, "no clean": {}, "shipped": {}}
        digests: dict[str, dict[int, set]] = {"prepare": {}, "no clean": {}}
        cleaning = None
        tokens = None
        loads: list[dict] = []  # the 1-minute load average as each run starts
        for r in range(args.rounds):
            for k, n in enumerate(args.workers):
                runs = [("limit", lambda n=n: limit_run(n)),
                        ("prepare", lambda n=n: prepare_run(cfg, files, inputs, tok_dir, n)),
                        ("no clean", lambda n=n: prepare_run(cfg_off, files, inputs, tok_dir, n))]
                if args.clean_cost_only:
                    runs = runs[1:]
                elif n == min(args.workers) and r == 0:  # a reference figure: once is enough
                    runs.append(("shipped", lambda n=n: limit_run(n, "shipped")))
                for name, fn in timing.rotated(runs, r + k):
                    loads.append({"round": r, "run": name, "processes": n, "load": timing.loadavg()[0]})
                    res = fn()
                    sec, cpu = res[0], res[1]
                    if name == "prepare":
                        tokens = res[2]["languages"]["bn"]["tokens"] + res[2]["languages"]["en"]["tokens"]
                        cleaning = res[2]["cleaning"]
                    if name in digests:
                        digests[name].setdefault(n, set()).add(res[3])
                    times[name].setdefault(n, []).append(sec)
                    cpus[name].setdefault(n, []).append(cpu)
                    print(f"round {r} {name:<8} N={n}: {sec:6.1f} s = {nfc_bytes / 1e6 / sec:.2f} MB/s "
                          f"(CPU {cpu:.1f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = timing.loadavg()
    mbs = {name: {n: nfc_bytes / 1e6 / timing.median(v) for n, v in d.items()} for name, d in times.items()}
    ns = args.workers
    if args.clean_cost_only:
        return clean_cost_report(args, nfc_bytes, tokens, times, cpus, mbs, digests, cleaning, loads,
                                 (load_before, load_after), Path(args.out))
    n_max = max(ns)
    ratios = {n: timing.ratios(times["limit"][n], times["prepare"][n]) for n in ns}  # side by side
    ratio = {n: timing.median(v) for n, v in ratios.items()}
    cpu_ratio = {n: timing.median_ratio(cpus["limit"][n], cpus["prepare"][n]) for n in ns}
    clean_ratios = {n: timing.ratios(times["prepare"][n], times["no clean"][n]) for n in ns}  # prepare / no clean
    clean_cpu = {n: timing.median_ratio(cpus["no clean"][n], cpus["prepare"][n]) for n in ns}
    same_shards = {name: len(set().union(*d.values())) == 1 for name, d in digests.items()}
    # speed-up paired by round (the runs of one round are minutes apart; this VM's speed drifts by up to ±15 %
    # over tens of minutes, which a ratio of medians over all rounds would mix in)
    speedups = {name: timing.ratios(times[name][min(ns)], times[name][n_max]) for name in ("limit", "prepare")}
    speedup = timing.median(speedups["prepare"])
    limit_speedup = timing.median(speedups["limit"])
    tokens_per_mb = tokens / (nfc_bytes / 1e6)
    per_proc = mbs["prepare"][n_max] / n_max
    hours_2b = 2e9 / tokens_per_mb / (per_proc * 16) / 3600
    result = {"text_mb": nfc_bytes / 1e6, "documents": len(_TEXTS), "tokens": tokens, "scan_s": scan_s,
              "sample_s": sample_s, "cpu_count": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": load_after, "seconds": times, "mb_per_s": mbs, "prepare_over_limit": ratio,
              "prepare_over_limit_by_round": ratios, "load_average_at_each_run": loads,
              "cpu_seconds": cpus, "limit_cpu_over_prepare_cpu": cpu_ratio,
              "speedup": {f"{min(ns)}->{n_max}": speedup}, "speedup_by_round": speedups,
              "limit_speedup": {f"{min(ns)}->{n_max}": limit_speedup}, "tokens_per_mb": tokens_per_mb,
              "extrapolated_hours_2b_tokens_16_cores": hours_2b,
              "clean_over_no_clean_by_round": clean_ratios, "clean_cpu_over_no_clean_cpu": clean_cpu,
              "same_shards_for_every_process_count": same_shards,
              "cleaning": {k: cleaning[k] for k in ("in", "kept", "removed", "clusters", "seconds")}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prepare_scale.json").write_text(json.dumps(result, indent=2) + "\n")
    disturbed = max(load_before[0], load_after[0]) > 0.5 * (os.cpu_count() or 1)
    lines = ["# Data preparation at scale", "",
             f"`python benchmarks/prepare_scale.py --mb {args.mb:g} --workers {' '.join(map(str, ns))} "
             f"--rounds {args.rounds}`: {nfc_bytes / 1e6:.1f} MB of NFC text ({len(_TEXTS):,} documents, "
             f"{tokens:,} tokens, vocabulary {cfg.tokenizer.vocab_size:,}) generated from data/sample; "
             f"{os.cpu_count()} cores; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
             + (" — **the machine was shared and loaded: the scaling figures are disturbed**." if disturbed else ".")
             + f" Load average as each run started: {min(x['load'] for x in loads):.2f} to "
             f"{max(x['load'] for x in loads):.2f}.",
             "", "| processes | limit: NFC + encode_batch_fast MB/s | prepare MB/s | prepare / limit "
             "(median of rounds) | by round | CPU s: limit / prepare (median) |", "|---:|---:|---:|---:|---|---:|"]
    for n in ns:
        lines.append(f"| {n} | {mbs['limit'][n]:.2f} | {mbs['prepare'][n]:.2f} | {ratio[n]:.0%} | "
                     + ", ".join(f"{x:.0%}" for x in ratios[n]) + f" | {cpu_ratio[n]:.0%} |")
    n_min = min(ns)
    lines += ["", "**The cleaning stage's cost**: prepare (cleaning on, the default) over prepare with `data.clean = "
              "false`, runs side by side:", ""]
    lines += clean_cost_table(ns, mbs, clean_ratios, {n: 1 / clean_cpu[n] for n in ns})
    rm = ", ".join(f"{k} {v['docs']:,}" for k, v in cleaning["removed"].items()) or "nothing"
    lines += ["", f"Same shard files (sha256 of every .bin) for {', '.join(map(str, ns))} processes: cleaning on "
              f"{'yes' if same_shards['prepare'] else 'NO'}, off {'yes' if same_shards['no clean'] else 'NO'}. "
              f"The cleaning removed (of {cleaning['in']['docs']:,} documents): {rm}."]
    lines += ["", "The limit does the pipeline's normalising and tokenizing and nothing else: Python's NFC, then "
              "encode_batch_fast with the tokenizer's own NFC normalizer off, as prepare's workers run it (the text "
              "is NFC already; the ids are the same). The tokenizer as saved (its normalizer on) on the raw texts, "
              f"N={n_min}: {mbs['shipped'][n_min]:.2f} MB/s — prepare is "
              f"{mbs['prepare'][n_min] / mbs['shipped'][n_min]:.0%} of that.",
              "", "CPU seconds (user + system, the workers included) are shown beside wall time: the share of "
              "prepare's work that is the limit's. Under load they vary too (a core shared with other work runs "
              "slower), so on a loaded machine neither is a clean figure.",
              "", f"Speed-up of prepare from {min(ns)} to {n_max} processes (median of the rounds' ratios, each "
              f"round's runs side by side): **{speedup:.2f}×** (by round: "
              + ", ".join(f"{x:.2f}×" for x in speedups["prepare"]) + f"); the limit's: {limit_speedup:.2f}× (by round: "
              + ", ".join(f"{x:.2f}×" for x in speedups["limit"]) + ").",
              f"Input scan (sha256 + UTF-8 check, cached by path, size and mtime): {scan_s:.1f} s, once; tokenizer "
              f"sample (one pass over data/sample): {sample_s:.1f} s.", "",
              f"Extrapolation: {tokens_per_mb:,.0f} tokens per MB of text, {per_proc:.2f} MB/s per process at "
              f"N={n_max}; 2B tokens ≈ {2e9 / tokens_per_mb / 1e3:.1f} GB of text on 16 cores at that rate per "
              f"process ≈ **{hours_2b:.2f} h** (assumes linear scaling to 16 processes, as measured up to {n_max}).", ""]
    (out / "prepare_scale.md").write_text("\n".join(lines))
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ns, [mbs["limit"][n] for n in ns], "o--", label="NFC + encode_batch_fast (limit)")
    ax.plot(ns, [mbs["prepare"][n] for n in ns], "o-", label="train.data prepare")
    ax.set_xlabel("processes")
    ax.set_ylabel("MB of text / s")
    ax.set_xticks(ns)
    ax.set_title(f"preparation, {nfc_bytes / 1e6:.0f} MB (load {load_before[0]:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prepare_scale.png", dpi=120)
    return 0


def clean_cost_table(ns: list[int], mbs: dict, wall: dict[int, list[float]], cpu: dict[int, float],
                     cpu_by_round: dict[int, list[float]] | None = None) -> list[str]:
    """The Markdown lines of the table of prepare with and without the cleaning stage: per process count of ``ns``,
    the MB/s of each (``mbs["no clean"][n]``, ``mbs["prepare"][n]``), prepare / no clean in wall time (the median
    of the rounds' ratios ``wall[n]``, then each round's) and in CPU seconds (``cpu[n]``, a ratio). With
    ``cpu_by_round`` (the clean-cost report) each round's CPU ratio follows ``cpu[n]``, the wall median is in bold
    and both medians are headed "(median)"; without it (the scaling report) the wall one is headed "(median of
    rounds)"."""
    full = cpu_by_round is not None
    lines = [f"| processes | no clean MB/s | prepare MB/s | prepare / no clean, wall "
             f"{'(median)' if full else '(median of rounds)'} | by round | CPU s: prepare / no clean"
             + (" (median) | by round |" if full else " |"), "|---:|---:|---:|---:|---|---:|" + ("---|" if full else "")]
    for n in ns:
        med = f"{timing.median(wall[n]):.2f}×"
        row = (f"| {n} | {mbs['no clean'][n]:.2f} | {mbs['prepare'][n]:.2f} | {f'**{med}**' if full else med} | "
               + ", ".join(f"{x:.2f}×" for x in wall[n]) + f" | {cpu[n]:.2f}× |")
        lines.append(row + (" " + ", ".join(f"{x:.2f}×" for x in cpu_by_round[n]) + " |" if full else ""))
    return lines


def clean_cost_report(args, nfc_bytes: float, tokens: int, times: dict, cpus: dict, mbs: dict, digests: dict,
                      cleaning: dict, loads: list[dict], load: tuple, out: Path) -> int:
    """``prepare_scale_clean.{md,json}``: prepare over no clean per process count (wall and CPU seconds, runs
    side by side), the speed-up of each from the fewest to the most processes, the cleaning's phases."""
    ns, n_max, n_min = args.workers, max(args.workers), min(args.workers)
    wall = {n: timing.ratios(times["prepare"][n], times["no clean"][n]) for n in ns}  # prepare / no clean
    cpu = {n: timing.ratios(cpus["prepare"][n], cpus["no clean"][n]) for n in ns}
    speedups = {name: timing.ratios(times[name][n_min], times[name][n_max]) for name in ("prepare", "no clean")}
    same = {name: len(set().union(*d.values())) == 1 for name, d in digests.items()}
    result = {"text_mb": nfc_bytes / 1e6, "documents": len(_TEXTS), "tokens": tokens, "cpu": timing.cpu_name(),
              "cores": os.cpu_count(), "load_average_before": load[0], "load_average_after": load[1],
              "load_average_at_each_run": loads, "seconds": times, "cpu_seconds": cpus, "mb_per_s": mbs,
              "prepare_over_no_clean_wall_by_round": wall, "prepare_over_no_clean_cpu_by_round": cpu,
              "speedup_by_round": speedups, "same_shards_for_every_process_count": same,
              "cleaning": {k: cleaning[k] for k in ("in", "kept", "removed", "clusters", "seconds")}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "prepare_scale_clean.json").write_text(json.dumps(result, indent=2) + "\n")
    flags = f"--mb {args.mb:g} --workers {' '.join(map(str, ns))} --rounds {args.rounds} --clean-cost-only"
    lines = ["# Data preparation with and without the cleaning stage", "",
             f"`python benchmarks/prepare_scale.py {flags}`: {nfc_bytes / 1e6:.1f} MB of NFC text ({len(_TEXTS):,} "
             f"documents, {tokens:,} tokens, vocabulary 32,000) generated from data/sample; CPU {timing.cpu_name()}, "
             f"{os.cpu_count()} cores; load average {load[0][0]:.2f} before, {load[1][0]:.2f} after, "
             f"{min(x['load'] for x in loads):.2f} to {max(x['load'] for x in loads):.2f} as each run started.", "",
             "Prepare (cleaning on, the default) against prepare with `data.clean = false` (the split of whole works "
             "only), each round's runs one after the other, their order rotated from one round and process count "
             "to the next:", ""]
    lines += clean_cost_table(ns, mbs, wall, {n: timing.median(cpu[n]) for n in ns}, cpu_by_round=cpu)
    lines += ["", f"Speed-up from {n_min} to {n_max} processes (median of the rounds' ratios): prepare "
              f"**{timing.median(speedups['prepare']):.2f}×** (by round: "
              + ", ".join(f"{x:.2f}×" for x in speedups["prepare"]) + "), no clean (the tokenizing pass without the "
              f"stage) {timing.median(speedups['no clean']):.2f}× (by round: "
              + ", ".join(f"{x:.2f}×" for x in speedups["no clean"]) + ").", "",
              f"Same shard files (sha256 of every .bin) for {', '.join(map(str, ns))} processes: cleaning on "
              f"{'yes' if same['prepare'] else 'NO'}, off {'yes' if same['no clean'] else 'NO'}. The cleaning "
              f"removed (of {cleaning['in']['docs']:,} documents): "
              + (", ".join(f"{k} {v['docs']:,}" for k, v in cleaning["removed"].items()) or "nothing") + ".", "",
              "The cleaning's phases in the last prepare run (seconds; the scan is summed over the workers): "
              + ", ".join(f"{k} {v:.2f}" for k, v in cleaning["seconds"].items()) + ".", ""]
    (out / "prepare_scale_clean.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
