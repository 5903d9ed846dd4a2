"""The Hugging Face sidecar files: ``config.json``, ``generation_config.json`` and ``tokenizer_config.json``.

One builder for every folder that carries them — a checkpoint (``train.checkpoint.save_checkpoint``) and a
bundle (``export.bundle``) — so ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` read the same keys from
both (docs/design.md, "The bundle"). It lives in ``train/`` because checkpoints carry the files and ``train/``
may not import ``export/``.
"""

from __future__ import annotations

from pathlib import Path

from train.atomic import atomic_write_json
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


def generation_config(eot_id: int, pad_id: int) -> dict:
    """``generation_config.json``: sampling with :data:`SAMPLING`, ``<|endoftext|>`` (``eot_id``) as bos and eos,
    ``pad_id`` as pad, :data:`MAX_NEW_TOKENS` new tokens (Hugging Face's ``GenerationConfig`` keys)."""
    return {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": pad_id, "do_sample": True, **SAMPLING,
            "max_new_tokens": MAX_NEW_TOKENS}


def hf_files(cfg: ModelConfig, eot_id: int, pad_id: int, torch_dtype: str = "float32") -> dict[str, dict]:
    """``{file name: JSON object}`` for the three sidecar files of a model with config ``cfg``; ``torch_dtype``
    is the dtype of the stored weights (config.json's ``torch_dtype``)."""
    return {
        "config.json": cfg.hf_config(torch_dtype, eot_id, pad_id),
        "generation_config.json": generation_config(eot_id, pad_id),
        "tokenizer_config.json": tokenizer_config(cfg.max_position_embeddings),
    }


def write_hf_files(folder: Path, cfg: ModelConfig, eot_id: int, pad_id: int, names: tuple[str, ...] = NAMES) -> None:
    """Write the sidecar files named in ``names`` (default all three) into ``folder``, each atomically (UTF-8
    JSON, indent 2). Raises OSError as the file system does."""
    files = hf_files(cfg, eot_id, pad_id)
    for name in names:
        atomic_write_json(Path(folder) / name, files[name])
