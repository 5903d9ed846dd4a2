"""The Hugging Face sidecar files: ``config.json``, ``generation_config.json`` and ``tokenizer_config.json``.

One builder for every folder that carries them — a checkpoint (``train.components.checkpoint.save_checkpoint``) and a
bundle (``export.bundle``) — so ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` read the same keys from
both (docs/design.md, "The bundle"). It lives in ``train/`` because checkpoints carry the files and ``train/``
may not import ``export/``.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.atomic import atomic_write_json
from contract.bundle import has_chat_template
from contract.chat_format import TURN_ENDS, missing_chat_tokens
from train.model import ModelConfig
from train.tokenizer import tokenizer_config

NAMES = ("config.json", "generation_config.json", "tokenizer_config.json")
MAX_NEW_TOKENS = 64  # generation_config's default length
# The sampling a user gets by default — the one owner of these numbers: generation_config.json carries them (so
# transformers' generate() samples the same way), the model card states them, ``python -m serve.generate`` and the
# Ollama Modelfile read them from the bundle, and the trainer's end-of-run samples use them. Nucleus sampling
# (Holtzman et al. 2020) at a moderate temperature, with CTRL's repetition penalty (Keskar et al. 2019) so that a
# small model does not loop on one word.
SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.1}


def generation_config(eot_id: int, pad_id: int, turn_end_ids: tuple[int, ...] = ()) -> dict:
    """``generation_config.json``: sampling with :data:`SAMPLING`, ``<|endoftext|>`` (``eot_id``) as bos,
    every end-of-generation id as eos (``eot_id``, and for a chat model ``turn_end_ids``, the ids of
    ``contract.chat_format.TURN_ENDS``: then a list, as Hugging Face's ``GenerationConfig`` takes it, so that
    transformers' ``generate`` stops where Shalik's runtimes do), ``pad_id`` as pad, :data:`MAX_NEW_TOKENS` new
    tokens."""
    eos = [eot_id, *turn_end_ids] if turn_end_ids else eot_id
    return {"bos_token_id": eot_id, "eos_token_id": eos, "pad_token_id": pad_id, "do_sample": True, **SAMPLING,
            "max_new_tokens": MAX_NEW_TOKENS}


def turn_end_ids(folder: Path) -> tuple[int, ...]:
    """The ids of ``contract.chat_format.TURN_ENDS`` (``<|im_end|>``, ``<|im_start|>``) in ``folder/tokenizer.json``
    when it has both chat tokens, else ``()`` (also when there is no tokenizer.json). Raises OSError / ValueError
    for an unreadable file."""
    f = Path(folder) / "tokenizer.json"
    if not f.is_file():
        return ()
    t = json.loads(f.read_text(encoding="utf-8"))
    vocab = {**t.get("model", {}).get("vocab", {}), **{a["content"]: a["id"] for a in t.get("added_tokens", [])}}
    return () if missing_chat_tokens(vocab) else tuple(int(vocab[tok]) for tok in TURN_ENDS)


def is_chat_bundle(folder: Path) -> bool:
    """Whether the exported ``folder`` is a chat model, as the GGUF and the Modelfile say it: a chat template
    (``contract.bundle.has_chat_template``, what serving reads) and the chat tokens in its tokenizer.json
    (:func:`turn_end_ids`). Raises BundleError (a ValueError) / OSError / ValueError for unreadable files."""
    return has_chat_template(folder) and bool(turn_end_ids(folder))


CHAT_DATA_KIND = "sft"  # data_summary.json's kind for a run trained on conversations (train.sft)


def trained_on_conversations(folder: Path) -> bool:
    """Whether the checkpoint ``folder`` was trained on conversations: its ``data_summary.json`` has ``kind``
    :data:`CHAT_DATA_KIND` (train.sft writes it; a pretraining run's has no kind). False when the file is missing
    or unreadable."""
    try:
        summary = json.loads((Path(folder) / "data_summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("kind") == CHAT_DATA_KIND


def turn_end_ids_of_checkpoint(folder: Path) -> tuple[int, ...]:
    """:func:`turn_end_ids` when the checkpoint ``folder`` is a chat model — trained on conversations
    (:func:`trained_on_conversations`) with a tokenizer that has both chat tokens — else ``()``. A base model's
    tokenizer reserves the chat tokens (train.tokenizer: fine-tuning needs no new rows) but it never saw them: it
    gets no chat template, so every runtime treats it as the base model it is."""
    return turn_end_ids(folder) if trained_on_conversations(folder) else ()


def hf_files(cfg: ModelConfig, eot_id: int, pad_id: int, torch_dtype: str = "float32",
             turn_end_ids: tuple[int, ...] = ()) -> dict[str, dict]:
    """``{file name: JSON object}`` for the three sidecar files of a model with config ``cfg``; ``torch_dtype``
    is the dtype of the stored weights (config.json's ``torch_dtype``); ``turn_end_ids``: a chat model's
    (:func:`turn_end_ids_of_checkpoint`): then tokenizer_config.json carries the chat template and
    generation_config.json every end-of-generation id."""
    return {
        "config.json": cfg.hf_config(torch_dtype, eot_id, pad_id),
        "generation_config.json": generation_config(eot_id, pad_id, turn_end_ids),
        "tokenizer_config.json": tokenizer_config(cfg.max_position_embeddings, chat=bool(turn_end_ids)),
    }


def write_hf_files(folder: Path, cfg: ModelConfig, eot_id: int, pad_id: int, names: tuple[str, ...] = NAMES) -> None:
    """Write the sidecar files named in ``names`` (default all three) into the checkpoint ``folder``, each
    atomically (UTF-8 JSON, indent 2); the chat parts only for a chat model (:func:`turn_end_ids_of_checkpoint`:
    ``folder``'s data_summary.json and tokenizer.json, written before). Raises OSError as the file system does."""
    files = hf_files(cfg, eot_id, pad_id, turn_end_ids=turn_end_ids_of_checkpoint(folder))
    for name in names:
        atomic_write_json(Path(folder) / name, files[name])


def sync_chat_files(folder: Path, chat: bool) -> bool:
    """Make ``folder``'s tokenizer_config.json and generation_config.json say what the model can do: for a chat
    model (``chat``: its checkpoint was trained on conversations, :func:`trained_on_conversations`) whose
    tokenizer.json has both chat tokens, the chat template and the turn-end ids among the end-of-generation
    ids; otherwise neither (a
    base model, whose tokenizer reserves the tokens untrained; a checkpoint written before its tokenizer gained
    them, or the other way round). Rewrites (atomically) only what differs; other keys are kept. Returns whether
    the folder is a chat model. Raises OSError / ValueError for unreadable files."""
    folder = Path(folder)
    ends = turn_end_ids(folder) if chat else ()
    tc_path, gc_path = folder / "tokenizer_config.json", folder / "generation_config.json"
    if tc_path.is_file():
        tc = json.loads(tc_path.read_text(encoding="utf-8"))
        want = {k: v for k, v in tc.items() if k != "chat_template"}
        want.update({k: v for k, v in tokenizer_config(None, chat=bool(ends)).items() if k == "chat_template"})
        if want != tc:
            atomic_write_json(tc_path, want)
    if gc_path.is_file():
        gc = json.loads(gc_path.read_text(encoding="utf-8"))
        eos = gc.get("eos_token_id")
        eot = eos[0] if isinstance(eos, list) and eos else eos
        want_eos = [eot, *ends] if ends else eot
        if eos != want_eos:
            atomic_write_json(gc_path, {**gc, "eos_token_id": want_eos})
    return bool(ends)

