"""The Ollama ``Modelfile`` written beside a GGUF, and the sampling defaults the model card states.

``ollama create NAME -f BUNDLE/Modelfile`` then runs the GGUF as Shalik's server runs the bundle: the prompt is
the text as given (a raw template, no chat format: the model continues text), ``<|endoftext|>`` ends a
completion, and temperature, top-k, top-p, penalties and length are Shalik's server's defaults (one owner:
``serve.sampling.SamplingParams`` and ``serve.lm.DEFAULT_MAX_NEW_TOKENS``) instead of Ollama's own (temperature
0.8, top-k 40, top-p 0.9, repeat penalty 1.1, unlimited length). Ollama runs a ``llama``-architecture GGUF with
its bundled llama.cpp, which reads ``tokenizer.ggml.pre`` and prepends the BOS id (``<|endoftext|>``) as
llama.cpp does (Modelfile reference: https://github.com/ollama/ollama/blob/main/docs/modelfile.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from serve.bundle import MODELFILE
from serve.lm import DEFAULT_MAX_NEW_TOKENS
from serve.sampling import SamplingParams
from train.atomic import atomic_write_text
from train.tokenizer import EOT

__all__ = ["MODELFILE", "HEADER", "sampling_defaults", "modelfile_text", "write_modelfile"]

HEADER = "# Shalik: Ollama Modelfile written by python -m export.gguf"


def sampling_defaults() -> dict:
    """Shalik's server's defaults for a request that sets nothing: ``temperature, top_k (0 = off), top_p,
    presence_penalty, frequency_penalty, repetition_penalty (1 = off), max_new_tokens``."""
    d = asdict(SamplingParams())
    d.pop("seed")
    return {**d, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS}


def modelfile_text(gguf_name: str, context_length: int) -> str:
    """The Modelfile for ``gguf_name`` (a file in the Modelfile's folder) and a model of ``context_length``
    tokens."""
    s = sampling_defaults()
    lines = [HEADER,
             f"# ollama create NAME -f {MODELFILE}   then   ollama run NAME \"আমি বাংলায়\"",
             "# Prompts should be Unicode NFC: Shalik's own runtimes normalise, llama.cpp and Ollama do not.",
             f"FROM ./{gguf_name}",
             'TEMPLATE """{{ .Prompt }}"""',
             f'PARAMETER stop "{EOT}"',
             f"PARAMETER num_ctx {context_length}",
             f"PARAMETER num_predict {s['max_new_tokens']}",
             f"PARAMETER temperature {s['temperature']:g}",
             f"PARAMETER top_k {s['top_k']}",
             f"PARAMETER top_p {s['top_p']:g}",
             "PARAMETER min_p 0",
             f"PARAMETER repeat_penalty {s['repetition_penalty']:g}",
             f"PARAMETER presence_penalty {s['presence_penalty']:g}",
             f"PARAMETER frequency_penalty {s['frequency_penalty']:g}"]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path: Path, context_length: int, log: Callable[[str], None] = print) -> Path | None:
    """Write ``Modelfile`` beside ``gguf_path`` (atomically) and return its path; an existing Modelfile that
    Shalik did not write (its first line is not :data:`HEADER`) is left alone (None, and the log says so)."""
    path = gguf_path.parent / MODELFILE
    if path.exists():
        try:
            first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        except (OSError, UnicodeDecodeError):
            first = ""
        if first != HEADER:
            log(f"gguf: {path} exists and was not written by Shalik; left as it is (no Modelfile written)")
            return None
    atomic_write_text(path, modelfile_text(gguf_path.name, context_length))
    return path
