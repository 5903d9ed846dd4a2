"""Loading a bundle for serving: :func:`load` checks its arguments, verifies the files the chosen backend reads
against the manifest (:mod:`contract.bundle`), opens the backend and returns an :class:`serve.lm.LM`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from contract.bundle import (
    MANIFEST,
    TOKENIZER,
    BundleError,
    backend_files,
    has_chat_template,
    onnx_graph,
    read_manifest,
    verify_files,
)
from contract.quant import Scheme, check_backend, parse
from serve.lm import LM
from serve.policy import DEFAULT_MAX_BATCH, DEFAULT_TOKEN_BUDGET, check_engine_limits
from serve.verdict import check_form

__all__ = ["BACKENDS", "load"]

BACKENDS = ("onnx", "rust")
#: The most compute threads a model may be given (rust_runtime's bound too, src/python.rs): a pool far past the
#: cores only adds contention, and an absurd one (a typo of 100000) would try to start that many threads.
MAX_THREADS = 1024


def load(path: str | Path, backend: str = "onnx", quantize: str | Scheme | None = None, threads: int | None = None,
         name: str | None = None, verify: bool = True, max_batch: int = DEFAULT_MAX_BATCH,
         token_budget: int = DEFAULT_TOKEN_BUDGET, allow_ungated: bool = False) -> LM:
    """Load a bundle directory (tokenizer.json, config.json, model.onnx / model.safetensors, manifest.json) for
    serving.

    backend: ``"onnx"`` (onnxruntime) or ``"rust"`` (the ``rust_runtime`` extension); quantize: None /
    ``"none"`` or a name of :data:`contract.quant.NAMES` that the backend offers (``contract.quant.BACKEND_NAMES``),
    parsed here once (:func:`contract.quant.parse`; a :class:`contract.quant.Scheme` parsed already, as the
    server's settings hold it, is taken as it is) — the backend gets the Scheme;
    threads: compute threads, an int from 1 to :data:`MAX_THREADS` (None = all cores); name: the model's label
    (default: the bundle folder's parent name, e.g. ``cpu`` for ``runs/cpu/bundle``); verify: check the sha256 of
    every file the backend reads against the manifest first (:func:`contract.bundle.verify_files`; False skips the
    hashing and accepts a folder without a manifest, for those who verify the bundle elsewhere or serve a hand-made
    folder — a manifest that is there is still read: its format_version and the gate's verdicts hold whatever
    ``verify`` says); max_batch / token_budget: the engine's sequences per step and tokens per step
    (:mod:`serve.engine`); allow_ungated: serve a quantized form that failed the export's quality gate or has no
    verdict (:mod:`serve.verdict`), logging what it overrides. The LM chats only when the bundle is a chat model
    (:func:`contract.bundle.has_chat_template`; a base model's chat requests are refused, saying how to get one).
    Raises BundleError (a ValueError) naming a corrupt or unlisted file, a missing manifest or one of a newer
    format_version (with any ``verify``), UngatedError (a BundleError) for a quantized form the gate did not pass
    (naming the form, the figure and the threshold); TypeError for an argument of the wrong type (path not a str or Path, threads not an int),
    FileNotFoundError for a missing folder or tokenizer, BundleError for a tokenizer.json that cannot be parsed,
    ValueError for an unknown backend or quantization or
    threads outside 1..MAX_THREADS, ImportError when the backend's runtime is not installed. Every argument is checked before
    anything is read.
    """
    from tokenizers import Tokenizer  # its Rust extension loads in ~50 ms; only load() needs it

    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a bundle folder (str or pathlib.Path), got {type(path).__name__}")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int | np.integer):
            raise TypeError(f"threads must be an int from 1 to {MAX_THREADS} or None (all cores), got {threads!r}")
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be an int from 1 to {MAX_THREADS} or None (all cores), got {threads}")
    if backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}; expected one of {', '.join(BACKENDS)}")
    scheme = parse(quantize)
    check_backend(scheme, backend)
    quantize = scheme.name if scheme else None
    check_engine_limits(max_batch, token_budget)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no model bundle at {path} (expected a folder with {TOKENIZER} and the model)")
    tok_file = path / TOKENIZER
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file} is missing: {path} is not a Shalik bundle")
    manifest = read_manifest(path) if verify or (path / MANIFEST).exists() else None
    if verify:
        verify_files(path, backend_files(backend, quantize, path))
    if backend == "onnx":
        from serve.backends.onnx import OnnxBackend  # onnxruntime loads only when this backend is asked for

        if (path / onnx_graph(path, quantize)).is_file():  # else the backend names the missing graph and its export
            check_form(manifest, str(path), "onnx", quantize, allow_ungated)
        model = OnnxBackend(path, quantize=scheme, threads=threads)
    else:
        from serve.backends.rust import RustBackend  # the optional Rust extension, likewise

        # rust_runtime.Model.load reads the same verdict in Rust (and logs an override there)
        model = RustBackend(path, quantize=scheme, threads=threads, allow_ungated=allow_ungated)
    label = name or path.resolve().parent.name or path.name
    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a file it cannot parse
        raise BundleError(f"{tok_file}: cannot read it as a tokenizer ({str(e).splitlines()[0][:200]})") from None
    return LM(model, tokenizer, name=label, path=path, max_batch=max_batch, token_budget=token_budget,
              chat_model=has_chat_template(path))
