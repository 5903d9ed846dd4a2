"""The bundle's files besides the ONNX graphs: Hugging Face side (weights, config, tokenizer) and manifest.

* ``model.safetensors`` is the checkpoint's file, copied byte for byte (Hugging Face Llama names; a tied lm_head
  is not stored, ``transformers`` re-ties it because config.json says ``tie_word_embeddings: true``).
* ``config.json`` from ``train.hf_files`` (the one builder of the sidecar files): every LlamaConfig key
  explicit, rope_theta at the top level and in ``rope_parameters``, special token ids from the tokenizer,
  ``torch_dtype`` float32 (the weights').
* ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``: the checkpoint's (the sidecars
  built by ``train.hf_files`` when an older checkpoint lacks them), their chat parts made to follow the model
  (``train.hf_files.sync_chat_files``): a checkpoint fine-tuned on conversations whose tokenizer has
  ``<|im_start|>`` / ``<|im_end|>`` gets the chat template (``contract.chat_format``) and both end-of-generation
  ids; any other (a base model, whose tokenizer reserves the chat tokens untrained) gets neither.
* ``manifest.json`` (written last): docs/design.md's keys, with the sha256 and size of every other file. Its
  schema, its writer and its readers are the bundle contract's (:mod:`contract.bundle`); this module fills it in.
"""

from __future__ import annotations

import platform
import shutil
import time
from importlib import metadata
from pathlib import Path

from contract import bundle as B
from contract.atomic import DIR_MODE, FILE_MODE
from export.errors import ExportError
from export.source import Source
from train.hf_files import sync_chat_files, trained_on_conversations
from train.hf_files import write_hf_files as write_sidecars

NEEDED = (B.WEIGHTS, B.TOKENIZER)  # copied from the checkpoint; it cannot be exported without them
SIDECARS = (B.TOKENIZER_CONFIG, B.GENERATION_CONFIG)  # copied, else built by train.hf_files
COPIED = (*NEEDED, *SIDECARS)


def write_hf_files(src: Source, out: Path) -> None:
    """Write the Hugging Face files of the bundle into ``out`` (an existing temporary folder)."""
    for name in COPIED:
        f = src.ckpt / name
        if f.is_file():
            shutil.copyfile(f, out / name)
        elif name in NEEDED:
            raise ExportError(f"{f}: missing")
    missing = tuple(n for n in SIDECARS if not (out / n).is_file())
    write_sidecars(out, src.cfg, src.eot_id, src.pad_id, (B.CONFIG, *missing))
    sync_chat_files(out, chat=trained_on_conversations(src.ckpt))


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


def write_manifest(out: Path, src: Source, *, exporter: str, opset: int, dtype: str, parity: dict,
                   quantization: dict | None, eval_: dict | None, data: dict | None, export_seconds: float) -> dict:
    """Write ``out/manifest.json`` (after every other file; :func:`contract.bundle.write_manifest`) and return it.
    ``quantization``: the quality gate's entry (:func:`export.gate.gate_entry`), None when nothing was quantized."""
    return B.write_manifest(
        out,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        params=src.model.num_params(),
        source={"checkpoint": _display_path(src.ckpt), "step": src.step, "sha256": src.sha256},
        exporter=exporter,
        opset=opset,
        dtype=dtype,
        versions=versions(),
        parity=parity,
        quantization=quantization,
        eval=eval_,
        data=data,
        export_seconds=round(export_seconds, 2),
    )


def make_readable(folder: Path) -> None:
    """Give the bundle ordinary permissions (the temporary folder and atomic writes start private, 0700/0600):
    folder 0777 and files 0666, less the process umask, so a server running as another user can read it."""
    folder.chmod(DIR_MODE)
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(FILE_MODE)



def read_manifest(bundle: Path) -> dict:
    """A bundle's manifest (:func:`contract.bundle.read_manifest`). Raises ExportError (exit code 2) when it is
    missing or not a manifest this version reads."""
    try:
        return B.read_manifest(bundle)
    except B.BundleError as e:
        raise ExportError(str(e)) from None
