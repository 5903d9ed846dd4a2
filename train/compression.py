"""The compressor floor: how many bits per character a classic compressor needs for the validation text.

A language model that scores worse than a compressor on the same text has learned less about it than a program from
the 1990s. For every source file of the inputs, this module measures the bits that **PPMd** (order 16, 1 GiB of
model memory; Shkarin's PPMd var. I via ``pyppmd``) and **xz** (``lzma``, preset 9 extreme) *add* for the file's
validation documents once they have already seen every training document of the same language — the compressor's
equivalent of a model trained on the training split — divided by the validation text's NFC characters:

    bits(train + "\\n\\n" + held) − bits(train)      per character of ``held``

(``held``: the source's validation documents joined by blank lines, in reading order.) The split is the shards'
(the cleaning stage's validation split of whole works, ``train.clean.split``; documents it removes are on
neither side), so the characters are those the trainer's per-source evaluation scores
(:func:`train.components.evaluation.evaluate_sources`). A language's floor is the sum of its sources' bits over the sum of
their characters (the way the model's bits per character are aggregated).

Both compressors are primed once per language and then forked once per source file (PPMd's and xz's streaming state
cannot be copied; a forked child inherits it), and the languages run in parallel processes. Results are cached in
``<data.cache_dir>/compression/<fingerprint>.json`` keyed by the inputs' content hashes, the languages, the split
and the compressor settings, together with the validation documents per source (``<fingerprint>.val.json``), which
the trainer's per-source evaluation reads.

    python -m train.compression [--config C] [--data P...] [--set k=v...] [--json]

Reference for the measurement: ``../shared/tools/compression_anchors.py`` of the project's workplace (PPMd-16 and
xz -9e primed with the training split); Mahoney, "Data Compression Explained", on PPM and context mixing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

from contract.atomic import atomic_write_json
from contract.cli import HelpFormatter
from contract.text import split_value
from train.clean import stage as clean_stage
from train.clean.decide import TRAIN, VAL
from train.clean.split import iter_split
from train.config import DEFAULT_PRESET, Config, ConfigError, load_config, resolve_path
from train.corpus import DataError, is_hf_spec, list_input_files
from train.inputs import scan_inputs

FORMAT_VERSION = 2  # 2: the shards' split (whole works, cleaned)
PPMD_ORDER = 16
PPMD_MEMORY = 1 << 30
XZ_PRESET = 9 | lzma.PRESET_EXTREME
SEPARATOR = b"\n\n"
COMPRESSORS = ("ppmd16", "xz")


@dataclass
class Source:
    """One source file's validation documents: its ``name`` (the file name without ``.jsonl``/``.txt``/``.gz``),
    its language and its NFC documents in reading order."""

    name: str
    lang: str
    docs: list[str] = field(default_factory=list)

    @property
    def chars(self) -> int:
        """NFC characters (code points) of the documents, separators excluded."""
        return sum(len(d) for d in self.docs)


def source_name(origin: str) -> str:
    """``data/sample/bn-literature.jsonl.gz`` → ``bn-literature``; an ``hf:`` spec stays as it is."""
    if is_hf_spec(origin):
        return origin
    name = Path(origin).name
    for suffix in (".gz", ".jsonl", ".txt"):
        name = name.removesuffix(suffix)
    return name


def split_by_source(cfg: Config, files: list[str]) -> tuple[dict[str, list[str]], dict[str, Source]]:
    """Read the inputs once: ``(train texts per language, validation Source per source file)``, sources in input
    order (a file holding two languages gives ``NAME-LANG`` for each), on the shards' split
    (:func:`train.clean.split.iter_split`). Documents of other languages, and those the cleaning removed, are left
    out. Raises DataError for unreadable inputs in strict mode."""
    languages = list(cfg.data.languages)
    train: dict[str, list[str]] = {lang: [] for lang in languages}
    train_origin: dict[str, list[str]] = {lang: [] for lang in languages}
    held: dict[tuple[str, str], list[str]] = {}
    for d, code in iter_split(cfg, files):
        if code == VAL:
            held.setdefault((source_name(d.origin), d.lang), []).append(d.text)
        elif code == TRAIN:
            train[d.lang].append(d.text)
            train_origin[d.lang].append(d.origin)
    for lang in languages:  # the data preparation's rule (train.data, ensure_val): a language without val text
        tr = train[lang]   # lends it the train document with the lowest split hash
        if not any(k[1] == lang for k in held) and len(tr) > 1:
            j = min(range(len(tr)), key=lambda i: split_value(tr[i]))
            held[source_name(train_origin[lang].pop(j)), lang] = [tr.pop(j)]
    names = [name for name, _ in held]
    val = {}
    for (name, lang), docs in held.items():
        key = name if names.count(name) == 1 else f"{name}-{lang}"
        val[key] = Source(key, lang, docs)
    return train, val


def _ppmd_encoder():
    import pyppmd  # noqa: PLC0415  (an optional dependency of the train extra; imported where it is used)

    return pyppmd.Ppmd8Encoder(PPMD_ORDER, PPMD_MEMORY)


def _added_bytes(compressor: str, prime: bytes, helds: list[bytes]) -> list[int]:
    """Bytes that ``compressor`` adds for each of ``helds`` after ``prime`` (each measured from the same primed
    state: primed once, then forked per held text where the platform forks, else primed again)."""
    def primed():
        if compressor == "ppmd16":
            enc = _ppmd_encoder()
            enc.encode(prime)
            return enc, lambda held: len(enc.encode(SEPARATOR + held)) + len(enc.flush())
        c = lzma.LZMACompressor(preset=XZ_PRESET)
        c.compress(prime)
        return c, lambda held: len(c.compress(SEPARATOR + held)) + len(c.flush()) if held else len(c.flush())

    texts = helds if compressor == "ppmd16" else [b"", *helds]  # xz: the prime alone is the baseline
    if not hasattr(os, "fork"):
        sizes = [primed()[1](h) for h in texts]
    else:
        _, finish = primed()
        sizes = []
        for h in texts:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: finish from the inherited primed state, report, exit without cleanup
                try:
                    os.write(w, str(finish(h)).encode())
                finally:
                    os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                out = f.read()
            os.waitpid(pid, 0)
            if not out:
                raise RuntimeError(f"compression: the {compressor} child process for a held text failed")
            sizes.append(int(out))
    if compressor == "xz":
        base = sizes[0]
        return [s - base for s in sizes[1:]]
    return sizes


_JOBS: list[tuple[str, bytes, list[bytes]]] = []  # set before the pool forks; workers read it by index


def _measure_job(i: int) -> list[int]:
    compressor, prime, helds = _JOBS[i]
    return _added_bytes(compressor, prime, helds)


def fingerprint(cfg: Config, files: list[str]) -> str:
    """The cache key: the inputs' content hashes, the languages, the split and the compressor settings."""
    inputs = scan_inputs(files, resolve_path(cfg.data.cache_dir), 1)
    key = {"format": FORMAT_VERSION, "inputs": sorted(i.sha256 for i in inputs), "languages": sorted(cfg.data.languages),
           "val_fraction": cfg.data.val_fraction, "ppmd": [PPMD_ORDER, PPMD_MEMORY], "xz": XZ_PRESET,
           "clean": clean_stage.fingerprint(clean_stage.settings_from(cfg))}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cache_paths(cfg: Config, files: list[str]) -> tuple[Path, Path]:
    """``(floor JSON, validation documents JSON)`` for these inputs."""
    folder = resolve_path(cfg.data.cache_dir) / "compression"
    fp = fingerprint(cfg, files)
    return folder / f"{fp}.json", folder / f"{fp}.val.json"


def measure(cfg: Config, log=print, workers: int | None = None) -> dict:
    """The floor for ``cfg.data``'s inputs, from the cache or measured (and cached):
    ``{"sources": {name: {lang, docs, chars, ppmd16, xz}}, "languages": {lang: {chars, ppmd16, xz}}, "seconds"}``,
    bits per NFC character. Raises DataError when an input cannot be read or no validation text exists."""
    files = list_input_files(cfg.data.paths)
    floor_path, val_path = cache_paths(cfg, files)
    if floor_path.is_file() and val_path.is_file():
        return json.loads(floor_path.read_text())
    t0 = time.time()
    log("compression floor: reading the inputs (PPMd-16 and xz primed with the training split; cached after)")
    train, sources = split_by_source(cfg, files)
    if not sources:
        raise DataError(f"compression floor: no validation documents in {cfg.data.paths} at data.val_fraction = "
                        f"{cfg.data.val_fraction}")
    langs = [lang for lang in cfg.data.languages if any(s.lang == lang for s in sources.values())]
    _JOBS.clear()
    for lang in langs:
        prime = SEPARATOR.join(t.encode() for t in train[lang])
        helds = [SEPARATOR.join(d.encode() for d in s.docs) for s in sources.values() if s.lang == lang]
        _JOBS.extend((c, prime, helds) for c in COMPRESSORS)
    del train
    n = workers or min(len(_JOBS), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=n, mp_context=get_context("fork" if hasattr(os, "fork") else "spawn")) as ex:
        results = list(ex.map(_measure_job, range(len(_JOBS))))
    _JOBS.clear()
    added = {(lang, c): results[i * len(COMPRESSORS) + j] for i, lang in enumerate(langs)
             for j, c in enumerate(COMPRESSORS)}
    out_sources, by_lang = {}, {}
    for lang in langs:
        mine = [s for s in sources.values() if s.lang == lang]
        for i, s in enumerate(mine):
            bits = {c: added[lang, c][i] * 8 for c in COMPRESSORS}
            out_sources[s.name] = {"lang": lang, "docs": len(s.docs), "chars": s.chars,
                                   **{c: bits[c] / max(s.chars, 1) for c in COMPRESSORS},
                                   **{f"{c}_bits": bits[c] for c in COMPRESSORS}}
        chars = sum(s.chars for s in mine)
        by_lang[lang] = {"chars": chars, **{c: sum(out_sources[s.name][f"{c}_bits"] for s in mine) / chars
                                            for c in COMPRESSORS}}
    res = {"format": FORMAT_VERSION, "inputs": cfg.data.paths, "val_fraction": cfg.data.val_fraction,
           "ppmd": {"order": PPMD_ORDER, "memory_bytes": PPMD_MEMORY}, "xz_preset": "9e",
           "sources": out_sources, "languages": by_lang, "seconds": time.time() - t0}
    atomic_write_json(val_path, {s.name: {"lang": s.lang, "docs": s.docs} for s in sources.values()})
    atomic_write_json(floor_path, res)
    log(f"compression floor: measured in {res['seconds']:.0f} s → {floor_path}")
    return res


def validation_sources(cfg: Config, log=print) -> dict[str, Source]:
    """The validation documents per source file (measuring the floor first when it is not cached)."""
    files = list_input_files(cfg.data.paths)
    _, val_path = cache_paths(cfg, files)
    if not val_path.is_file():
        measure(cfg, log)
    return {name: Source(name, v["lang"], v["docs"]) for name, v in json.loads(val_path.read_text()).items()}


def format_table(floor: dict, model: dict[str, float] | None = None) -> str:
    """A text table: per source and language, characters, PPMd-16 and xz bits/char (and ``model``'s, by the same
    keys, when given)."""
    head = f"{'validation text':18s} {'chars':>8s} {'PPMd-16':>8s} {'xz -9e':>8s}" + (f" {'model':>8s}" if model else "")
    rows = [head]
    for key, d in [*floor["sources"].items(), *((f"{k} (all)", v) for k, v in floor["languages"].items())]:
        m = ""
        if model:
            v = model.get(key.removesuffix(" (all)"))
            m = f" {v:8.3f}" if v is not None else f" {'-':>8s}"
        rows.append(f"{key:18s} {d['chars']:8,d} {d['ppmd16']:8.3f} {d['xz']:8.3f}{m}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.compression", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default=DEFAULT_PRESET, help="preset name or TOML path (its [data] section is used)")
    p.add_argument("--data", nargs="+", help="inputs instead of the config's data.paths")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    try:
        sets = list(args.set) + ([f"data.paths={json.dumps(args.data)}"] if args.data else [])
        cfg = load_config(args.config, sets)
        res = measure(cfg, log=lambda m: print(m, file=sys.stderr))
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
