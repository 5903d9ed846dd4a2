"""The fine-tuning run's starting weights: a pretrained checkpoint's, with the embedding (and an untied head)
grown by the chat tokens the tokenizer gained. A new row starts at the mean of the pretrained rows (Hewitt,
"Initializing New Word Embeddings for Pretrained Language Models", 2021: the mean keeps the new tokens' logits
near the average instead of a random direction), said in the log."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from train.components.checkpoint import CheckpointError, load_weights
from train.errors import TrainError
from train.model import LlamaForCausalLM, ModelConfig

GROWN = ("model.embed_tokens.weight", "lm_head.weight")


def load_base(model: LlamaForCausalLM, ckpt: Path, log: Callable[[str], None]) -> int:
    """Load ``ckpt``'s weights into ``model``, whose vocabulary may be larger by the tokens appended to the
    checkpoint's tokenizer; returns how many rows were added. TrainError when the architecture differs in any
    other key or the vocabulary shrank."""
    try:
        saved = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:
        raise TrainError(f"{ckpt}/config.json: cannot read the pretrained model's config ({e})") from None
    new = model.config
    diffs = [f"{k}: {getattr(saved, k)!r} → {getattr(new, k)!r}" for k in new.to_dict()
             if k != "vocab_size" and getattr(saved, k) != getattr(new, k)]
    if diffs:
        raise TrainError(f"the fine-tuning config's [model] differs from {ckpt}: {'; '.join(diffs)} (fine-tuning keeps "
                         f"the pretrained architecture)")
    added = new.vocab_size - saved.vocab_size
    if added < 0:
        raise TrainError(f"the tokenizer has {new.vocab_size} ids, fewer than the {saved.vocab_size} of {ckpt}")
    base = LlamaForCausalLM(saved)
    try:
        load_weights(base, ckpt / "model.safetensors")
    except CheckpointError as e:
        raise TrainError(str(e)) from None
    state = base.state_dict()
    with torch.no_grad():
        for name in GROWN:
            w = state.get(name)
            if w is not None and added:
                state[name] = torch.cat([w, w.mean(0, keepdim=True).expand(added, -1)])
        model.load_state_dict(state)
    model.tie_weights()
    if added:
        log(f"chat tokens: the embedding{'' if new.tie_word_embeddings else ' and the head'} grew from "
            f"{saved.vocab_size:,} to {new.vocab_size:,} rows; the {added} new rows start at the mean of the "
            f"pretrained rows")
    return added
