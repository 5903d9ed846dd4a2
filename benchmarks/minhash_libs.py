"""MinHash signatures: datasketch, rensa, datatrove and our numpy code, for speed and for determinism.

The same documents of data/sample (every k-th, ``--docs`` of them), the same word n-grams (``--ngram``) and
``--num-perm`` hash functions. Each implementation computes every document's signature; the time is the median
of ``--rounds`` rounds (the implementations interleaved in each round, so the machine's load hits them alike),
from the NFC text to the signature (each library's own tokenising and hashing). Determinism: the signatures are
computed again in two fresh processes with different ``PYTHONHASHSEED`` and compared (sha256 of all of them).

* numpy (ours, ``train.clean``): code points → word hashes → n-gram hashes → multiply-shift minimum, one
  document at a time (``minhash.signature``);
* numpy batched (ours, the cleaning stage's path): the same for the documents of a chunk at once, as the stage's
  workers scan them (chunks of up to 256 documents or 1 MB, as ``train.corpus.iter_chunks`` cuts them; words
  by ``word_spans_many``, n-grams by ``ChunkNgrams``, signatures by ``minhash.signatures``) — the same signatures;
* datasketch ``MinHash(num_perm, seed=1).update_batch`` over the n-grams as UTF-8 bytes (SHA-1 based);
* rensa ``RMinHash(num_perm, seed=1).update`` over the n-grams as strings (Rust);
* datatrove ``MinhashDedupSignature.get_shingles`` + ``get_signature`` (numpy over xxhash'd shingles, its own
  text normalisation; FineWeb's code), its word tokenizer replaced by the regular expression the others use
  (its own needs spaCy per language, and has none for Bangla), and its shingle hash given UTF-8 bytes
  (datatrove 0.10.1 passes a str to xxhash, which xxhash 4 refuses).

The libraries get the words from one regular expression (word characters and the Bengali block, on casefolded text).

Writes benchmarks/results/minhash_libs.{md,json}.

    python benchmarks/minhash_libs.py [--docs 600] [--ngram 3] [--num-perm 112] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from contract.text import nfc  # noqa: E402
from train.clean import minhash  # noqa: E402
from train.clean.text import ChunkNgrams, NgramHashes, prepare_tables, word_spans, word_spans_many  # noqa: E402


def load(docs: int) -> list[str]:
    rows = []
    for f in sorted((ROOT / "data" / "sample").glob("*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            rows += [nfc(json.loads(line)["text"]) for line in fh if line.strip()]
    step = max(len(rows) // docs, 1)
    return rows[::step][:docs]


_WORD = re.compile(r"[\w\u0980-\u09ff]+")


class _Words:
    """A word tokenizer for datatrove (its own needs spaCy per language, and has none for Bangla)."""

    @staticmethod
    def word_tokenize(text: str, lang: str | None = None) -> list[str]:
        return _WORD.findall(text)


def _grams(t: str, n: int) -> list[str]:
    w = _WORD.findall(t.casefold())
    return [" ".join(w[i:i + n]) for i in range(max(len(w) - n + 1, 1))]


def sig_numpy(texts, n, p):
    a = minhash.permutations(p)
    return [minhash.signature(NgramHashes(word_spans(t)[0], n).get(n), a) for t in texts]


def _chunks(texts, chunk_bytes=1 << 20, rows=256):
    """``texts`` cut into consecutive runs of up to ``rows`` texts or about ``chunk_bytes`` of UTF-8."""
    run, size = [], 0
    for t in texts:
        run.append(t)
        size += len(t.encode("utf-8"))
        if size >= chunk_bytes or len(run) >= rows:
            yield run
            run, size = [], 0
    if run:
        yield run


def sig_numpy_batched(texts, n, p):
    a = minhash.permutations(p)
    out = []
    for run in _chunks(texts):
        wh, _, off = word_spans_many(run)
        chunk = ChunkNgrams(wh, off, n, premix=(n,))
        out.extend(minhash.signatures([chunk.doc(i).get(n) for i in range(len(run))], a))
    return out


def sig_datasketch(texts, n, p):
    from datasketch import MinHash

    out = []
    for t in texts:
        m = MinHash(num_perm=p, seed=1)
        m.update_batch([g.encode("utf-8") for g in _grams(t, n)])
        out.append(m.hashvalues.astype(np.uint64))
    return out


def sig_rensa(texts, n, p):
    from rensa import RMinHash

    out = []
    for t in texts:
        m = RMinHash(num_perm=p, seed=1)
        m.update(_grams(t, n))
        out.append(np.asarray(m.digest(), dtype=np.uint64))
    return out


def sig_datatrove(texts, n, p):
    from datatrove.pipeline.dedup import minhash as dt

    dt.load_word_tokenizer = lambda language: _Words()
    step = dt.MinhashDedupSignature(tempfile.mkdtemp(), dt.MinhashConfig(n_grams=n, num_buckets=1, hashes_per_bucket=p))
    import xxhash  # noqa: PLC0415  (datatrove 0.10 hands xxhash 4 a str, which it refuses: encode it first)

    step._hash_func = lambda text: xxhash.xxh64_intdigest(text.encode("utf-8"))
    return [np.asarray(step.get_signature(step.get_shingles(t)), dtype=np.uint64).ravel() for t in texts]


OURS = "numpy batched (ours, the stage's)"  # the time column's reference: what the cleaning stage runs
IMPLS = {"numpy (ours, one document at a time)": sig_numpy, OURS: sig_numpy_batched, "datasketch": sig_datasketch, "rensa": sig_rensa, "datatrove": sig_datatrove}


def digest(name: str, docs: int, n: int, p: int) -> str:
    sigs = IMPLS[name](load(docs), n, p)
    return hashlib.sha256(b"".join(np.asarray(s).astype("<u8").tobytes() for s in sigs)).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--num-perm", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--digest", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.digest:
        print(digest(a.digest, a.docs, a.ngram, a.num_perm))
        return
    texts = load(a.docs)
    prepare_tables()  # once per process, before timing (a data worker inherits them from its parent)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    times: dict[str, list[float]] = {k: [] for k in IMPLS}
    errors: dict[str, str] = {}
    for r in range(a.rounds):
        for name in timing.rotated(list(IMPLS), r):
            if name in errors:
                continue
            t0 = time.perf_counter()
            try:
                IMPLS[name](texts, a.ngram, a.num_perm)
            except Exception as e:  # noqa: BLE001 - a library that cannot run here is reported, not fatal
                errors[name] = f"{type(e).__name__}: {e}"[:200]
                continue
            times[name].append(time.perf_counter() - t0)
    det = {}
    for name in IMPLS:
        if name in errors:
            continue
        outs = []
        for seed in ("1", "2"):
            env = {**os.environ, "PYTHONHASHSEED": seed}
            p = subprocess.run([sys.executable, __file__, "--digest", name, "--docs", str(a.docs), "--ngram",
                                str(a.ngram), "--num-perm", str(a.num_perm)], capture_output=True, text=True, env=env)
            outs.append(p.stdout.strip())
        det[name] = outs[0] == outs[1] and bool(outs[0])
    rows = {name: {"seconds": statistics.median(v), "mb_per_s": mb / statistics.median(v), "deterministic": det[name]}
            for name, v in times.items() if v}
    res = {"docs": len(texts), "mb": mb, "ngram": a.ngram, "num_perm": a.num_perm, "rounds": a.rounds,
           "results": rows, "errors": errors}
    out = ROOT / "benchmarks" / "results"
    (out / "minhash_libs.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    base = rows.get(OURS, {}).get("seconds")
    lines = ["# MinHash implementations", "",
             f"`python benchmarks/minhash_libs.py --docs {a.docs} --ngram {a.ngram} --num-perm {a.num_perm} --rounds "
             f"{a.rounds}`: {len(texts)} documents of data/sample ({mb:.1f} MB), word {a.ngram}-grams, {a.num_perm} "
             "hashes, from NFC text to signature; median of the rounds, implementations interleaved. CPU: AMD EPYC "
             "(Zen 4), one process; other jobs ran beside (the machine was shared), so compare the ratios.", "",
             "| implementation | s | MB/s | time / the stage's | same signatures in two processes (PYTHONHASHSEED 1, 2) |",
             "|---|---:|---:|---:|---|"]
    for name, r in rows.items():
        ratio = f"{r['seconds'] / base:.2f}×" if base else "–"
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['mb_per_s']:.2f} | {ratio} | {'yes' if r['deterministic'] else 'NO'} |")
    for name, e in errors.items():
        lines.append(f"| {name} | – | – | – | could not run: {e} |")
    (out / "minhash_libs.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
