"""The trainer's end-of-run samples: Hugging Face's logits processors, seeded sampling, distinct-word shares."""

from __future__ import annotations

import pytest
import torch

from train.components.evaluation import _process_logits, sampled_continuation, user_samples
from train.hf_files import SAMPLING
from train.model import LlamaForCausalLM, ModelConfig


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1),
                                dict(temperature=1.3, top_k=0, top_p=0.5, repetition_penalty=1.0),
                                dict(temperature=0.5, top_k=3, top_p=1.0, repetition_penalty=2.0)])
def test_logits_processing_equals_transformers(kw):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(1, 200) * 3
    seen = [5, 7, 7, 199, 0]
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]),
                                 TemperatureLogitsWarper(kw["temperature"])])
    if kw["top_k"]:
        procs.append(TopKLogitsWarper(kw["top_k"]))
    if kw["top_p"] < 1:
        procs.append(TopPLogitsWarper(kw["top_p"]))
    want = procs(torch.tensor([seen]), logits.clone())[0]
    got = _process_logits(logits[0], seen, **kw)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-6)


def test_samples_are_seeded_and_report_distinct_words():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return type("E", (), {"ids": [ord(c) % 50 + 1 for c in text]})()

        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    torch.manual_seed(0)
    m = LlamaForCausalLM(ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128))
    ids = [0, 3, 4]
    a = sampled_continuation(m, ids, 20, eot_id=0, seed=7, **SAMPLING)
    assert a == sampled_continuation(m, ids, 20, eot_id=0, seed=7, **SAMPLING)
    assert a != sampled_continuation(m, ids, 20, eot_id=0, seed=8, **SAMPLING)
    assert sampled_continuation(m, ids, 12, 0, 7, temperature=0.0) == m.generate_greedy(ids, 12, eot_id=0)
    rows = user_samples(m, Tok(), 0, SAMPLING, max_new_tokens=20, prompts=[("en", "ab")])
    r = rows[0]
    words = r["sampled"].split()
    assert r["distinct_sampled"] == pytest.approx(len(set(words)) / len(words))
    assert set(r) == {"prompt", "lang", "sampled", "greedy", "distinct_sampled", "distinct_greedy"}
