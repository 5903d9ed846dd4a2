"""Validation NLL and bits per character per language, and greedy samples of fixed prompts.

``nll`` is the mean negative log-likelihood in nats per target token; ``bpc`` is bits per NFC character:
``sum NLL / ln 2 / characters`` where the characters of a token span are the UTF-8 lead bytes of its tokens
(``train.tokenizer.token_char_counts``; the ``<|endoftext|>`` separator counts 0 characters but its NLL counts).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from train.model import LlamaForCausalLM, causal_lm_loss

SAMPLE_PROMPTS = [
    ("bn", "আমি বাংলায় গান গাই"),
    ("bn", "একদিন সকালে"),
    ("bn", "বাংলা ভাষা"),
    ("en", "It was a dark and stormy night"),
    ("en", "The old man said"),
]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, val: dict[str, list[np.ndarray]], char_counts: np.ndarray,
             device: torch.device, autocast=None, batch_size: int = 8) -> dict[str, dict]:
    """``{lang: {nll, bpc, tokens, chars}, "all": {…}}`` over the given val windows (int64 arrays of ≤ seq+1).

    Windows of equal length are batched; the model is put in eval mode and restored.
    """
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    out: dict[str, dict] = {}
    tot = {"nll_sum": 0.0, "tokens": 0, "chars": 0}
    for lang, windows in val.items():
        nll_sum, tokens, chars = 0.0, 0, 0
        by_len: dict[int, list[np.ndarray]] = {}
        for w in windows:
            by_len.setdefault(len(w), []).append(w)
        for _n, group in sorted(by_len.items()):
            for i in range(0, len(group), batch_size):
                batch = torch.from_numpy(np.stack(group[i:i + batch_size])).to(device)
                x, y = batch[:, :-1], batch[:, 1:]
                with ctx:
                    logits, _ = model(x)
                nll_sum += float(causal_lm_loss(logits, y, reduction="sum"))
                tokens += int(y.numel())
                chars += int(char_counts[y.cpu().numpy()].sum())
        if tokens == 0:
            continue
        out[lang] = {"nll": nll_sum / tokens, "bpc": nll_sum / math.log(2) / max(chars, 1), "tokens": tokens,
                     "chars": chars}
        tot["nll_sum"] += nll_sum
        tot["tokens"] += tokens
        tot["chars"] += chars
    if tot["tokens"]:
        out = {"all": {"nll": tot["nll_sum"] / tot["tokens"], "bpc": tot["nll_sum"] / math.log(2) / max(tot["chars"], 1),
                       "tokens": tot["tokens"], "chars": tot["chars"]}, **out}
    model.train(was_training)
    return out


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, tokenizer, eot_id: int, max_new_tokens: int = 32,
                   prompts=SAMPLE_PROMPTS) -> list[dict]:
    """Greedy continuations ``[{prompt, lang, text}]``; every prompt is encoded as ``<|endoftext|>`` + prompt."""
    was_training = model.training
    model.eval()
    out = []
    for lang, prompt in prompts:
        ids = [eot_id] + tokenizer.encode(prompt, add_special_tokens=False).ids
        new = model.generate_greedy(ids, max_new_tokens, eot_id=eot_id)
        out.append({"prompt": prompt, "lang": lang, "text": tokenizer.decode(new)})
    model.train(was_training)
    return out
