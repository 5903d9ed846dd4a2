"""The Ollama ``Modelfile`` written beside a GGUF, and the sampling defaults the model card states.

``ollama create NAME -f BUNDLE/Modelfile`` then runs the GGUF as ``python -m serve.generate BUNDLE`` runs the
bundle: for a base model the prompt is the text as given (a raw template: the model continues text) and
``<|endoftext|>`` ends a completion; for a chat model (its tokenizer has ``<|im_start|>`` / ``<|im_end|>``) the
``TEMPLATE`` is the chat format (``contract.chat_format.OLLAMA_TEMPLATE``, ChatML over ``.Messages``, as the server
renders it) and ``<|im_end|>`` stops a reply too; and temperature, top-k, top-p, repetition penalty and length are the bundle's
defaults (``generation_config.json``, read by ``contract.bundle.sampling_defaults``; their owner is
``train.hf_files.SAMPLING``) instead of Ollama's own (temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1,
unlimited length). Ollama runs a ``llama``-architecture GGUF with
its bundled llama.cpp, which reads ``tokenizer.ggml.pre`` and prepends the BOS id (``<|endoftext|>``) as
llama.cpp does (Modelfile reference: https://github.com/ollama/ollama/blob/main/docs/modelfile.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from contract.atomic import atomic_write_text
from contract.bundle import GENERATION_CONFIG, MODELFILE, SAMPLING_KEYS, BundleError
from contract.bundle import sampling_defaults as bundle_sampling
from contract.chat_format import OLLAMA_TEMPLATE, TURN_ENDS
from export.errors import ExportError
from serve.lm import DEFAULT_MAX_NEW_TOKENS
from serve.sampling import SamplingParams
from train.hf_files import is_chat_bundle
from train.tokenizer import EOT

__all__ = ["MODELFILE", "HEADER", "sampling_defaults", "modelfile_text", "write_modelfile"]

HEADER = "# Shalik: Ollama Modelfile written by python -m export.gguf"


def sampling_defaults(folder: str | Path) -> dict:
    """The sampling a user gets by default from a bundle or checkpoint ``folder``: ``temperature, top_k (0 = off),
    top_p, repetition_penalty (1 = off)`` from its generation_config.json (greedy, temperature 0, for one that does
    not sample), the others at the samplers' neutral values (``serve.sampling.SamplingParams``), and
    ``max_new_tokens``. Raises ExportError when generation_config.json cannot be read."""
    neutral = {k: v for k, v in asdict(SamplingParams()).items() if k in SAMPLING_KEYS}
    try:
        s = {**neutral, **bundle_sampling(folder)}
        cfg = json.loads((Path(folder) / GENERATION_CONFIG).read_text(encoding="utf-8"))
    except (BundleError, OSError, ValueError) as e:
        raise ExportError(f"{Path(folder) / GENERATION_CONFIG}: cannot read the default sampling ({e})") from None
    return {**s, "max_new_tokens": int(cfg.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)}


def modelfile_text(gguf_name: str, context_length: int, sampling: dict, chat: bool = False) -> str:
    """The Modelfile for ``gguf_name`` (a file in the Modelfile's folder), a model of ``context_length`` tokens and
    the default ``sampling`` (:func:`sampling_defaults`); ``chat``: the model's tokenizer has the chat tokens
    (the chat template, and ``<|im_end|>`` and ``<|im_start|>`` as stops beside ``<|endoftext|>``, as the server
    ends a reply: ``serve.chat.chat_end_ids``)."""
    s = sampling
    template = [f'TEMPLATE """{OLLAMA_TEMPLATE}"""', *(f'PARAMETER stop "{t}"' for t in TURN_ENDS)] if chat else \
        ['TEMPLATE """{{ .Prompt }}"""']
    lines = [HEADER,
             f"# ollama create NAME -f {MODELFILE}   then   ollama run NAME \"আমি বাংলায়\"",
             "# Prompts should be Unicode NFC: Shalik's own runtimes normalise, llama.cpp and Ollama do not.",
             f"FROM ./{gguf_name}",
             *template,
             f'PARAMETER stop "{EOT}"',
             f"PARAMETER num_ctx {context_length}",
             f"PARAMETER num_predict {s['max_new_tokens']}",
             f"PARAMETER temperature {s['temperature']:g}",
             f"PARAMETER top_k {s['top_k']}",
             f"PARAMETER top_p {s['top_p']:g}",
             "PARAMETER min_p 0",
             f"PARAMETER repeat_penalty {s['repetition_penalty']:g}"]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path: Path, bundle: Path, context_length: int,
                    log: Callable[[str], None] = print) -> Path | None:
    """Write ``Modelfile`` beside ``gguf_path`` (atomically) with ``bundle``'s default sampling and return its path;
    an existing Modelfile that Shalik did not write (its first line is not :data:`HEADER`) is left alone (None, and
    the log says so). Raises ExportError when the bundle's generation_config.json cannot be read."""
    sampling = sampling_defaults(bundle)
    path = gguf_path.parent / MODELFILE
    if path.exists():
        try:
            first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        except (OSError, UnicodeDecodeError):
            first = ""
        if first != HEADER:
            log(f"gguf: {path} exists and was not written by Shalik; left as it is (no Modelfile written)")
            return None
    try:
        chat = is_chat_bundle(bundle)
    except (OSError, ValueError) as e:
        raise ExportError(f"{bundle}: cannot read tokenizer.json or tokenizer_config.json ({e})") from None
    atomic_write_text(path, modelfile_text(gguf_path.name, context_length, sampling, chat))
    return path
