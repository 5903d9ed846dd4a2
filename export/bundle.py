"""The bundle's files besides the ONNX graphs: Hugging Face side (weights, config, tokenizer) and manifest.

* ``model.safetensors`` is the checkpoint's file, copied byte for byte (Hugging Face Llama names; a tied lm_head
  is not stored, ``transformers`` re-ties it because config.json says ``tie_word_embeddings: true``).
* ``config.json`` from ``train.hf_files`` (the one builder of the sidecar files): every LlamaConfig key
  explicit, rope_theta at the top level and in ``rope_parameters``, special token ids from the tokenizer,
  ``torch_dtype`` float32 (the weights').
* ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``: the checkpoint's (the sidecars
  built by ``train.hf_files`` when an older checkpoint lacks them).
* ``manifest.json`` (written last): docs/design.md's keys, with the sha256 and size of every other file.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path

from export.errors import ExportError
from export.source import Source
from export.target import FORMAT, MANIFEST
from train.atomic import DIR_MODE, FILE_MODE, atomic_write_json, sha256_file
from train.hf_files import write_hf_files as write_sidecars

FORMAT_VERSION = 1
COPIED = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_hf_files(src: Source, out: Path) -> None:
    """Write the Hugging Face files of the bundle into ``out`` (an existing temporary folder)."""
    for name in COPIED:
        f = src.ckpt / name
        if f.is_file():
            shutil.copyfile(f, out / name)
        elif name in ("model.safetensors", "tokenizer.json"):
            raise ExportError(f"{f}: missing")
    missing = tuple(n for n in ("generation_config.json", "tokenizer_config.json") if not (out / n).is_file())
    write_sidecars(out, src.cfg, src.eot_id, src.pad_id, ("config.json", *missing))


def file_table(folder: Path) -> dict[str, dict]:
    """``{name: {sha256, bytes}}`` for every file in ``folder`` except the manifest (sorted by name)."""
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def versions() -> dict[str, str | None]:
    """Versions of the libraries that made and checked the bundle (None when one is absent)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "onnx", "onnxruntime", "onnxscript", "transformers", "safetensors", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _display_path(p: Path) -> str:
    """The checkpoint path relative to the working directory when under it, else its last three parts (no
    machine-specific absolute path goes into a bundle that may be shared)."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path(*p.resolve().parts[-3:]))


def write_manifest(out: Path, src: Source, *, exporter: str, opset: int, dtype: str, parity: dict, int8: dict | None,
                   eval_: dict | None, data: dict | None, export_seconds: float) -> dict:
    """Write ``out/manifest.json`` (after every other file) and return it."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "params": src.model.num_params(),
        "source": {"checkpoint": _display_path(src.ckpt), "step": src.step, "sha256": src.sha256},
        "files": file_table(out),
        "exporter": exporter,
        "opset": opset,
        "dtype": dtype,
        "versions": versions(),
        "parity": parity,
        "int8": int8,
        "eval": eval_,
        "data": data,
        "export_seconds": round(export_seconds, 2),
    }
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def make_readable(folder: Path) -> None:
    """Give the bundle ordinary permissions (the temporary folder and atomic writes start private, 0700/0600):
    folder 0777 and files 0666, less the process umask, so a server running as another user can read it."""
    folder.chmod(DIR_MODE)
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(FILE_MODE)


def read_manifest(bundle: Path) -> dict:
    """A bundle's manifest. Raises ExportError when it is missing or not a Shalik bundle manifest."""
    try:
        m = json.loads((Path(bundle) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"{bundle}: no readable {MANIFEST} ({e})") from None
    if m.get("format") != FORMAT:
        raise ExportError(f"{bundle}/{MANIFEST}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m
