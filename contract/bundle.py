"""The bundle contract: what a Shalik bundle folder holds and how a reader checks it (docs/design.md "The bundle").

``export/`` writes a bundle, ``serve/``, ``rust_runtime`` and ``benchmarks/`` read it; every fact they share is
spelled here once and imported from here (``rust_runtime/src/bundle.rs`` mirrors the ones Rust reads, and
tests/test_bundle_contract.py checks that the two agree and that nobody else spells them):

* **file names**: :data:`CONFIG`, :data:`WEIGHTS`, :data:`TOKENIZER`, ..., the ONNX graph of each quantization
  (:data:`ONNX_GRAPHS`: ``model.<scheme>.onnx`` for every scheme of :mod:`contract.quant` with an ONNX form), its
  external data (:func:`external_data`), the GGUF files (:func:`gguf_file`), and the files each serving backend
  reads (:func:`backend_files`), and the graph a given bundle holds for a quantization (:func:`onnx_graph`: a
  bundle of format minor 0 holds its q8_0 graph under its old name, :data:`LEGACY_GRAPHS`);
* **the manifest** (:data:`MANIFEST`, written last by the exporter): :data:`MANIFEST_FIELDS` is its schema,
  :func:`check_manifest` the one check, :func:`read_manifest` the one reader, :func:`write_manifest` the one
  writer (:func:`update_manifest` / :func:`rehash` for what is added to a finished bundle: a GGUF and its quality
  gate, the card's benchmark section), :func:`verify_files` the sha256 check at load. A reader refuses a manifest whose ``format_version`` is
  newer than :data:`FORMAT_VERSION` (the major version), naming both, and reads an older minor version's names as
  today's (:func:`upgrade`: the gate's ``int8`` forms of format minor 0 are ``q8_0``'s);
* **the ONNX graph's I/O names** (Optimum's decoder naming): :func:`onnx_input_names`, :func:`onnx_output_names`;
* **the special tokens** :data:`EOT` and :data:`PAD` and :func:`eot_id`;
* **hashing**: :func:`sha256_file`;
* the bundle's default sampling (:func:`sampling_defaults`, from ``generation_config.json``). The quantization
  names, their one parser (``parse``) and the quality gate's thresholds are :mod:`contract.quant`'s.

Layering (docs/design.md): every stage may import ``contract/``, which imports nothing else of the project. The
special tokens (``contract/byte_level.py``) and the sha256 of a file (``contract/atomic.py``), which checkpoints and
data caches record too, are re-exported here as part of the bundle contract; everything else is defined here. This module imports no torch, no onnxruntime and nothing of ``export/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from contract import quant
from contract.atomic import atomic_write_json, sha256_file
from contract.byte_level import EOT, PAD, SPECIAL_TOKENS

__all__ = ["BACKEND_FILES", "CARD", "CONFIG", "EOT", "FORMAT", "FORMAT_VERSION", "GENERATION_CONFIG", "MANIFEST",
           "MANIFEST_FIELDS", "MODELFILE", "ONNX", "ONNX_GRAPHS", "ONNX_Q8_0", "PAD", "QUANTIZE_CHOICES", "SPECIAL_TOKENS",
           "SKIP_VERIFY", "FORMAT_MINOR", "LEGACY_GRAPHS", "TOKENIZER", "TOKENIZER_CONFIG", "WEIGHTS", "BundleError",
           "backend_files", "check_manifest", "eot_id", "external_data", "file_entry", "file_table", "gguf_file",
           "is_bundle", "onnx_graph", "onnx_input_names", "onnx_output_names", "read_manifest", "rehash",
           "sampling_defaults", "sha256_file", "update_manifest", "upgrade", "verify_files", "write_manifest"]

# ---------------------------------------------------------------------------------------------- file names

CONFIG = "config.json"  # Hugging Face LlamaConfig
WEIGHTS = "model.safetensors"  # Hugging Face Llama names; a tied lm_head is not stored
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CARD = "README.md"  # the model card
MANIFEST = "manifest.json"  # written last: its files table vouches for every other file
#: How a reader skips the sha256 check, as every message says it: the Python argument, the CLIs' flag, the HTTP
#: server's variable (the format-version check runs either way; rust_runtime/src/integrity.rs says the same).
SKIP_VERIFY = "verify=False (--no-verify, SHALIK_VERIFY=0)"
#: The ONNX graph of each quantization (``None``: the float graph; a scheme of contract.quant with ``onnx=True``:
#: ``model.<scheme>.onnx``, so a new quantized graph is one entry of contract.quant.SCHEMES).
ONNX_GRAPHS: dict[str | None, str] = {None: "model.onnx", **{q: f"model.{q}.onnx" for q, s in quant.SCHEMES.items()
                                                             if s.onnx}}
ONNX = ONNX_GRAPHS[None]
ONNX_Q8_0 = ONNX_GRAPHS["q8_0"]
#: The graph a bundle of format minor 0 holds for a scheme under the scheme's old name (contract.quant.ALIASES):
#: ``model.int8.onnx``, onnxruntime's per-channel 8-bit graph, which such a bundle serves as its q8_0 graph.
LEGACY_GRAPHS: dict[str, str] = {new: f"model.{old}.onnx" for old, new in quant.ALIASES.items() if new in ONNX_GRAPHS}
EXTERNAL_DATA_SUFFIX = ".data"  # a graph's weights, beside it (ONNX external data)
GGUF_PATTERN = "model-{type}.gguf"  # export.gguf's default output, one per GGUF type
MODELFILE = "Modelfile"  # Ollama's, written by export.gguf beside the GGUF (not in the manifest)
#: The files each serving backend reads besides the ONNX graph: what :func:`backend_files` lists and
#: ``rust_runtime`` checks (its ``CHECKED_FILES``). The rust backend quantizes at load from the float weights.
BACKEND_FILES: dict[str, tuple[str, ...]] = {"onnx": (CONFIG, TOKENIZER), "rust": (CONFIG, TOKENIZER, WEIGHTS)}

QUANTIZE_CHOICES = quant.NAMES  # the quantization names are contract.quant's; this name is kept for its importers
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty")  # generation_config.json's sampling


def external_data(graph: str) -> str:
    """The file holding ``graph``'s weights (``model.onnx`` → ``model.onnx.data``)."""
    return graph + EXTERNAL_DATA_SUFFIX


def gguf_file(type_: str) -> str:
    """The default GGUF file name for a GGUF type (``"q8_0"`` → ``model-q8_0.gguf``)."""
    return GGUF_PATTERN.format(type=type_)


def onnx_graph(bundle: str | Path | None, quantize: str | None) -> str:
    """The file name of the ONNX graph of ``quantize`` (None or a key of :data:`ONNX_GRAPHS`) that ``bundle`` holds:
    :data:`ONNX_GRAPHS`'s, unless the folder lacks it and has the old name of :data:`LEGACY_GRAPHS` (a bundle of
    format minor 0: ``model.int8.onnx`` for q8_0). ``bundle`` None: the current name. KeyError for an unknown
    ``quantize``."""
    name = ONNX_GRAPHS[quantize]
    old = LEGACY_GRAPHS.get(quantize) if quantize else None
    if bundle is not None and old and not (Path(bundle) / name).is_file() and (Path(bundle) / old).is_file():
        return old
    return name


def backend_files(backend: str, quantize: str | None, bundle: str | Path | None = None) -> list[str]:
    """The bundle files ``backend`` (``"onnx"`` or ``"rust"``) reads with ``quantize`` (None or a key of
    :data:`ONNX_GRAPHS`): what :func:`serve.load` verifies against the manifest; the ONNX graph is the one
    ``bundle`` holds (:func:`onnx_graph`; None: the current name). KeyError for an unknown one."""
    files = list(BACKEND_FILES[backend])
    if backend == "onnx":
        graph = onnx_graph(bundle, quantize)
        files += [graph, external_data(graph)]
    return files


# ---------------------------------------------------------------------------------------------- ONNX I/O


def onnx_input_names(num_layers: int) -> list[str]:
    """The graph's inputs in order: ``input_ids``, ``attention_mask``, ``position_ids`` (int64), then
    ``past_key_values.{i}.key`` / ``.value`` for every layer ``i < num_layers`` (docs/design.md's table)."""
    return ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def onnx_output_names(num_layers: int) -> list[str]:
    """The graph's outputs in order: ``logits``, then ``present.{i}.key`` / ``.value`` for every layer."""
    return ["logits"] + [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


# ---------------------------------------------------------------------------------------------- the manifest

FORMAT = "shalik-bundle"
#: The manifest's major version. Adding a key or a file keeps it; a change that an older reader would misread
#: (a renamed file, another weight layout) raises it, and readers refuse a version newer than theirs.
FORMAT_VERSION = 1
#: The manifest's minor version (its ``format_minor``; absent: 0). A reader of a newer minor version reads an older
#: one's names as today's (:func:`upgrade`). 1: the 8-bit blocks are named ``q8_0`` (0: ``int8``; the gate's forms
#: ``"onnx int8"`` / ``"rust int8"``, the ONNX graph ``model.int8.onnx``).
FORMAT_MINOR = 1
_NONE = type(None)
#: The manifest's keys and their JSON types (docs/design.md "The bundle"). The first three are what every
#: reader needs; the exporter writes them all. A new key is one entry here.
MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,),  # FORMAT
    "format_version": (int,),  # FORMAT_VERSION when written
    "format_minor": (int,),  # FORMAT_MINOR when written (absent: 0)
    "files": (dict,),  # {name: {"sha256": hex, "bytes": int}} of every other file
    "created": (str,),  # UTC, ISO 8601
    "params": (int,),
    "source": (dict,),  # {checkpoint, step, sha256}
    "exporter": (str,),
    "opset": (int,),
    "dtype": (str,),
    "versions": (dict,),  # library versions that made and checked the bundle
    "parity": (dict,),  # {ok, tol, near_tie, cases}
    "quantization": (dict, _NONE),  # the quality gate of every quantized form (export.gate), when there is one
    "eval": (dict, _NONE),
    "data": (dict, _NONE),  # the training data's sources and licences
    "export_seconds": (float, int),
}
REQUIRED_FIELDS = ("format", "format_version", "files")


class BundleError(ValueError):
    """A bundle that cannot be served as it is: a file differs from its manifest, a fact is missing, ..."""


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is _NONE else t.__name__ for t in types)


def check_manifest(manifest: Any, where: str | Path = MANIFEST, complete: bool = False) -> dict:
    """Check a manifest's shape against :data:`MANIFEST_FIELDS` and return it.

    ``where`` names it in messages (its path). Every reader needs ``format`` = :data:`FORMAT`, an integer
    ``format_version`` from 1 to :data:`FORMAT_VERSION` and a ``files`` table of ``{name: {"sha256": 64 hex
    digits, "bytes": int}}``; a known key present must have its type, an unknown one is ignored (a writer of the
    same major version may have added it); ``complete`` (the exporter's manifest) also requires every key of
    :data:`MANIFEST_FIELDS`. Raises :class:`BundleError` naming the key, what it holds and what was expected — for a
    newer ``format_version``, both versions."""
    if not isinstance(manifest, dict):
        raise BundleError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    wanted = MANIFEST_FIELDS if complete else REQUIRED_FIELDS
    missing = [k for k in wanted if k not in manifest]
    if missing:
        raise BundleError(f"{where}: no {', '.join(repr(k) for k in missing)} (not a manifest that export writes)")
    if manifest["format"] != FORMAT:
        raise BundleError(f"{where}: format is {manifest['format']!r}, expected {FORMAT!r}")
    version = manifest["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BundleError(f"{where}: format_version is {version!r}, expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise BundleError(f"{where}: format_version {version} is newer than this reader's {FORMAT_VERSION}; "
                          "upgrade Shalik to read this bundle")
    for key, types in MANIFEST_FIELDS.items():
        value = manifest.get(key)
        if key in manifest and (isinstance(value, bool) or not isinstance(value, types)):
            raise BundleError(f"{where}: {key} is {type(value).__name__}, expected {_type_names(types)}")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
                and isinstance(entry.get("bytes"), int) and not isinstance(entry["bytes"], bool)):
            raise BundleError(f"{where}: files[{name!r}] is {entry!r}, expected {{\"sha256\": 64 hex digits, "
                              "\"bytes\": int}")
    return manifest


def _manifest_json(bundle: str | Path) -> tuple[Path, Any]:
    """(path, parsed JSON) of ``bundle``'s manifest. BundleError when it is missing or not JSON."""
    path = Path(bundle) / MANIFEST
    try:
        return path, json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{path} is missing: not an exported bundle, or its export did not finish (the manifest "
                          f"is written last); export it with python -m export.onnx, or load with {SKIP_VERIFY} to "
                          "skip the check") from None
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: not a readable manifest ({e})") from None


def read_manifest(bundle: str | Path) -> dict:
    """``bundle/manifest.json``, checked (:func:`check_manifest`) and read with today's names (:func:`upgrade`).
    BundleError when it is missing, not JSON or not a manifest this reader understands (a newer ``format_version``
    included)."""
    path, m = _manifest_json(bundle)
    return upgrade(check_manifest(m, path))


def upgrade(manifest: dict) -> dict:
    """A checked manifest of an older minor version (``format_minor`` below :data:`FORMAT_MINOR`) with today's names,
    in place, and returned: the one place old names are read (``rust_runtime/src/integrity.rs`` mirrors it). Minor 0
    → 1: the quality gate's forms keyed with an old scheme name of :data:`contract.quant.ALIASES` (``"onnx int8"``,
    ``"rust int8"``) are keyed and labelled with the scheme's (``"onnx q8_0"``, ``"rust q8_0"``); the files table
    keeps the names on disk (:func:`onnx_graph` finds ``model.int8.onnx``). Then ``format_minor`` is
    :data:`FORMAT_MINOR`, so a manifest written back (:func:`update_manifest`) is today's."""
    if manifest.get("format_minor", 0) >= FORMAT_MINOR:
        return manifest
    forms = (manifest.get("quantization") or {}).get("forms")
    if isinstance(forms, dict):
        renamed = {}
        for key, entry in forms.items():
            runtime, _, scheme = key.partition(" ")
            new = quant.ALIASES.get(scheme)
            if new and isinstance(entry, dict):
                entry = {**entry, "scheme": new}
            renamed[f"{runtime} {new}" if new else key] = entry
        manifest["quantization"]["forms"] = renamed
    manifest["format_minor"] = FORMAT_MINOR
    return manifest


def is_bundle(folder: str | Path) -> bool:
    """True when ``folder`` holds a manifest whose ``format`` is :data:`FORMAT`, whatever its version: a folder
    that a Shalik exporter wrote (so ``export.onnx --force`` may replace it), even one this version cannot read."""
    try:
        _, m = _manifest_json(folder)
    except BundleError:
        return False
    return isinstance(m, dict) and m.get("format") == FORMAT


def file_entry(path: str | Path) -> dict[str, Any]:
    """A manifest ``files`` entry: ``{"sha256": hex digest, "bytes": size}`` of the file at ``path``."""
    return {"sha256": sha256_file(path), "bytes": Path(path).stat().st_size}


def file_table(folder: str | Path) -> dict[str, dict]:
    """``{name: file_entry}`` for every file in ``folder`` except the manifest, sorted by name."""
    return {p.name: file_entry(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST}


def write_manifest(folder: str | Path, complete: bool = True, **fields: Any) -> dict:
    """Write ``folder/manifest.json`` atomically — after every other file, whose sha256 and size it lists — and
    return it: ``format``, ``format_version``, ``files`` and ``fields`` (keys of :data:`MANIFEST_FIELDS`).
    ``complete=False`` writes only what is given (a hand-made bundle of a test or benchmark). Raises BundleError
    (:func:`check_manifest`) before writing anything for a missing, unknown or mistyped field."""
    path = Path(folder) / MANIFEST
    if unknown := sorted(set(fields) - set(MANIFEST_FIELDS)):
        raise BundleError(f"{path}: unknown keys {unknown}; add them to contract.bundle.MANIFEST_FIELDS first")
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "format_minor": FORMAT_MINOR,
                "files": file_table(folder), **fields}
    check_manifest(manifest, path, complete=complete)
    atomic_write_json(path, manifest)
    return manifest


def rehash(bundle: str | Path, names: Iterable[str]) -> dict:
    """Update the manifest's entries of ``names`` after those files were rewritten in place (the model card's
    benchmark section) and write it back atomically; returns it. Names the manifest does not list stay unlisted.
    BundleError as :func:`read_manifest`."""
    manifest = read_manifest(bundle)
    for name in names:
        if name in manifest["files"]:
            manifest["files"][name] = file_entry(Path(bundle) / name)
    atomic_write_json(Path(bundle) / MANIFEST, manifest)
    return manifest


def update_manifest(bundle: str | Path, files: Iterable[str] = (), **fields: Any) -> dict:
    """Add to a finished bundle's manifest and write it back atomically; returns it. ``files``: names of files in
    the bundle whose entries are added or refreshed (a GGUF written after the export); ``fields``: keys of
    :data:`MANIFEST_FIELDS` set to new values (the quality gate's ``quantization``). BundleError as
    :func:`read_manifest`, and for an unknown or mistyped field (checked before anything is written)."""
    path = Path(bundle) / MANIFEST
    if unknown := sorted(set(fields) - set(MANIFEST_FIELDS)):
        raise BundleError(f"{path}: unknown keys {unknown}; add them to contract.bundle.MANIFEST_FIELDS first")
    manifest = read_manifest(bundle)
    manifest["files"] = dict(sorted({**manifest["files"], **{n: file_entry(Path(bundle) / n) for n in files}}.items()))
    manifest.update(fields)
    check_manifest(manifest, path)
    atomic_write_json(path, manifest)
    return manifest


def verify_files(bundle: str | Path, names: Iterable[str]) -> None:
    """Check each of ``names`` (files in ``bundle`` that exist) against the manifest's sha256 and size.

    Raises BundleError: the manifest is missing or unreadable (:func:`read_manifest`), a file's size or sha256
    differs (naming the file), or a file is not listed (it cannot be vouched for). Files are hashed in 1 MiB
    blocks. Missing files are left to the loader (it names them)."""
    bundle = Path(bundle)
    table = read_manifest(bundle)["files"]
    for name in names:
        path = bundle / name
        if not path.is_file():
            continue
        entry = table.get(name)
        if entry is None:
            raise BundleError(f"{path}: not listed in {MANIFEST}, so it cannot be verified "
                              f"(re-export the bundle, or load with {SKIP_VERIFY})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise BundleError(f"{path} is corrupt: {size} bytes, the manifest says {entry['bytes']} "
                              "(re-export or re-download the bundle)")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise BundleError(f"{path} is corrupt: sha256 {digest[:16]}…, the manifest says {entry['sha256'][:16]}… "
                              "(re-export or re-download the bundle)")


# ---------------------------------------------------------------------------------------------- serving facts


def eot_id(tokenizer: Any) -> int:
    """The id of ``<|endoftext|>`` in ``tokenizer`` (a ``tokenizers.Tokenizer``). BundleError when absent (every
    prompt starts with it, so there is no safe default)."""
    i = tokenizer.token_to_id(EOT)
    if i is None:
        raise BundleError(f"the tokenizer has no {EOT} token: not a Shalik tokenizer (every prompt starts with it)")
    return int(i)


def _json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path`` (a bundle's sidecar file). BundleError ``{path}: cannot read {what} (why)`` for a
    file that cannot be read or parsed, ``{path}: expected a JSON object, got T`` for other JSON."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: cannot read {what} ({e})") from None
    if not isinstance(cfg, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def has_chat_template(bundle: str | Path) -> bool:
    """Whether ``bundle`` is a chat model: its ``tokenizer_config.json`` carries a ``chat_template`` (the Hugging Face
    convention that transformers and vLLM read; the GGUF and the Ollama Modelfile follow it). Export writes one
    only for a model fine-tuned on conversations whose tokenizer has ``<|im_start|>`` / ``<|im_end|>`` — a base
    model's tokenizer reserves those ids too, untrained (``train.hf_files.turn_end_ids_of_checkpoint``). A folder
    without the file: False. BundleError for a file that is not a JSON object."""
    path = Path(bundle) / TOKENIZER_CONFIG
    return path.is_file() and bool(_json_object(path, "it").get("chat_template"))


def sampling_defaults(bundle: str | Path) -> dict[str, float]:
    """The bundle's default sampling (``generation_config.json``, written by training from ``train.hf_files.SAMPLING``):
    ``{temperature, top_k, top_p, repetition_penalty}``. A bundle that does not sample by default (``do_sample``
    false or absent, as before these defaults existed) gives greedy: ``{"temperature": 0.0}``. BundleError for a
    missing or unreadable file, or one that is not a JSON object."""
    cfg = _json_object(Path(bundle) / GENERATION_CONFIG, "the generation defaults")
    if not cfg.get("do_sample"):
        return {"temperature": 0.0}
    return {k: cfg[k] for k in SAMPLING_KEYS if k in cfg}
