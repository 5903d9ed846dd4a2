"""Every generation goes through an engine (serve.engine, issue 17): the Python scheduler over any backend and
rust_runtime.Engine behind the same LM API — batched answers equal answers alone, n > 1 prefills once, a
choice ends alone at its stop string, cancel and errors leave the batch, and the counters reach /metrics."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve.backends.base import BackendError
from serve.engine import StepEngine, TokenEvent, engine_stats_keys
from serve.lm import LM
from serve.sampling import SamplingParams
from tests.scripted import ScriptedBackend, scripted_lm, scripted_tokenizer


class CountingBackend(ScriptedBackend):
    """The scripted backend, counting prefill calls and (batched) decode calls."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prefills = 0
        self.batch_sizes: list[int] = []

    def new_sequence(self):
        seq = super().new_sequence()
        prefill = seq.prefill

        def counted(ids, all_logits=False):
            self.prefills += 1
            return prefill(ids, all_logits)

        seq.prefill = counted
        return seq

    def decode_batch(self, seqs, token_ids):
        self.batch_sizes.append(len(seqs))
        return super().decode_batch(seqs, token_ids)


def counting_lm(max_batch: int = 16, token_budget: int = 256, **kw) -> tuple[LM, CountingBackend]:
    tok = scripted_tokenizer()
    backend = CountingBackend(tok.get_vocab_size(with_added_tokens=True), kw.pop("context", 256), None, **kw)
    return LM(backend, tok, name="counting", max_batch=max_batch, token_budget=token_budget), backend


def test_batch_of_prompts_equals_each_alone_and_is_stepped_together():
    lm, backend = counting_lm()
    prompts = ["a", "bb", "ccc", "dddd"]
    opts = dict(temperature=0.9, seed=11)
    alone = [lm.generate(p, 12, **opts) for p in prompts]
    backend.batch_sizes.clear()
    together = lm.generate(prompts, 12, **opts)
    assert together == alone and len(set(alone)) > 1
    assert max(backend.batch_sizes) == 4  # the four were decoded in one call per step


def test_greedy_batched_equals_alone():
    lm, _ = counting_lm()
    prompts = [[5, 6, 7], [8], [9, 10]]
    alone = [lm.complete(p, 10, temperature=0) for p in prompts]
    together = lm.complete_batch(prompts, 10, temperature=0)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.logprobs for c in together] == [c.logprobs for c in alone]


def test_n_choices_prefill_once_and_choice_zero_equals_n1():
    lm, backend = counting_lm()
    one = lm.complete("prompt", 10, temperature=1.0, seed=3)
    backend.prefills = 0
    four = lm.complete_batch(["prompt"], 10, n=4, temperature=1.0, seed=3)
    assert backend.prefills == 1
    assert four[0].text == one.text and len({c.text for c in four}) > 1


def test_n_beyond_the_batch_is_split_into_groups_that_all_run():
    lm, backend = counting_lm(max_batch=2)
    out = lm.complete_batch(["p"], 6, n=5, temperature=1.0, seed=1)
    assert len(out) == 5 and all(c.completion_tokens == 6 for c in out)
    assert backend.prefills == 3  # ceil(5 / 2) groups, one prefill each
    again = lm.complete_batch(["p"], 6, n=5, temperature=1.0, seed=1)
    assert [c.text for c in again] == [c.text for c in out]


def test_max_batch_bounds_the_sequences_per_step():
    lm, backend = counting_lm(max_batch=2, delay_s=0.002)
    out = lm.complete_batch(["a", "b", "c", "d", "e"], 8, temperature=0)
    assert all(c.completion_tokens == 8 for c in out)
    assert max(backend.batch_sizes) == 2
    s = lm.engine.stats()
    assert set(s) == set(engine_stats_keys())
    assert s["admitted"] == 5 and s["decode_tokens"] == 5 * 7 and s["running"] == 0 and s["waiting"] == 0


def test_stop_string_ends_one_choice_and_not_the_others():
    lm = scripted_lm(["ab", "cd", "ef"], context=256)
    gens = lm.start_choices("x", 2, 9, stop=["cd"])
    first = LM.collect(gens[0])
    second = LM.collect(gens[1])
    assert (first.text, first.finish_reason) == ("ab", "stop")
    assert (second.text, second.finish_reason) == ("ab", "stop")
    other = lm.start_choices("x", 2, 9)
    other[0].cancel()
    rest = LM.collect(other[1])
    assert rest.text == "abcdefabcdefabcdefabcdef"[:18] and rest.finish_reason == "length"
    assert LM.collect(other[0]).finish_reason == "cancelled"


def test_closing_a_stream_early_frees_its_place():
    lm, backend = counting_lm(max_batch=1)
    pieces = lm.stream("x", 200, temperature=0)
    next(pieces)
    pieces.close()  # the consumer stops: the engine must drop the sequence, or the next request never runs
    done = []
    t = threading.Thread(target=lambda: done.append(lm.complete("y", 3, temperature=0)))
    t.start()
    t.join(timeout=20)
    assert done and done[0].completion_tokens == 3


def test_end_of_text_is_reported_with_its_logprob():
    lm = scripted_lm(["ab"], context=64, eos_after=2)
    c = lm.start("x", 10, top_logprobs=1)
    out = LM.collect(c)
    assert out.finish_reason == "stop" and out.text == "abab"
    lp, top = c.end_of_text
    assert lp > -1e-3 and list(top) == ["<|endoftext|>"]
    past = lm.complete("x", 4, ignore_eos=True)
    assert past.completion_tokens == 4 and "<|endoftext|>" in past.text


class FailingBackend(ScriptedBackend):
    def decode_batch(self, seqs, token_ids):
        raise RuntimeError("decode exploded")


def test_a_failing_step_fails_its_requests_not_the_engine():
    tok = scripted_tokenizer()
    backend = FailingBackend(tok.get_vocab_size(with_added_tokens=True), 64, None)
    lm = LM(backend, tok)
    gens = lm.start_choices("x", 2, 5, temperature=0)
    with pytest.raises(RuntimeError, match="decode exploded"):
        LM.collect(gens[0])
    assert lm.complete("y", 1, temperature=0).completion_tokens == 1  # the engine still serves


def test_step_engine_events_and_cancel_before_admission():
    tok = scripted_tokenizer()
    backend = ScriptedBackend(tok.get_vocab_size(with_added_tokens=True), 64, None, delay_s=0.01)
    eng = StepEngine(backend, eot_id=0, max_batch=1)
    try:
        busy = eng.submit([0, 5], 50, SamplingParams(temperature=0))
        queued = eng.submit([0, 6], 5, SamplingParams(temperature=0))
        queued.cancel()
        assert list(queued.events(0)) == [TokenEvent(None, finish="cancelled")]
        busy.cancel()
        evs = list(busy.events(0))
        assert evs[-1].finish == "cancelled" and all(e.token is not None for e in evs[:-1])
    finally:
        eng.close()
    with pytest.raises(BackendError, match="closed"):
        eng.submit([0, 5], 1, SamplingParams())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_engine_limits_are_checked(bad):
    tok = scripted_tokenizer()
    backend = ScriptedBackend(tok.get_vocab_size(with_added_tokens=True), 64, None)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        LM(backend, tok, max_batch=bad)
    with pytest.raises(ValueError, match="token_budget must be an int >= 1"):
        StepEngine(backend, 0, token_budget=bad)


def test_configure_engine_after_start_is_refused():
    lm, _ = counting_lm()
    lm.configure_engine(4)
    assert lm.generate("x", 2, temperature=0)
    assert lm.engine.max_batch == 4
    with pytest.raises(RuntimeError, match="started already"):
        lm.configure_engine(8)


# ---------------------------------------------------------------- the Rust engine behind the same API

rust_runtime = pytest.importorskip("rust_runtime", reason="rust_runtime is not built: pip install -e .")


def load_rust_lm(tmp_path_factory, max_batch: int) -> LM:
    """A random-init Rust bundle (hidden 64, 4 heads / 2 KV heads, context 256, vocabulary 512) loaded for serving
    with ``max_batch`` sequences a step and 16 tokens a step."""
    from serve import load
    from tests.test_rust_runtime import build_bundle, corpus_lines, train_tokenizer

    tok = train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", r" ?\p{L}+| ?\p{N}+|\s+|.",
                          corpus_lines(200))
    d = tmp_path_factory.mktemp("serve_engine_bundle")
    build_bundle(d, tok, hidden=64, inter=128, heads=4, kv=2, max_pos=256, seed=5)
    return load(d, backend="rust", threads=1, verify=False, max_batch=max_batch, token_budget=16)


@pytest.fixture(scope="module")
def rust_lm(tmp_path_factory):
    lm = load_rust_lm(tmp_path_factory, max_batch=8)
    yield lm
    lm.close()


def test_rust_lm_batched_equals_alone_bit_for_bit(rust_lm):
    prompts = ["আমি বাংলায় গান গাই", "the cat", "নদী", "a b c d e f g h i j k l m n o p q r s"]
    alone = [rust_lm.complete(p, 12, temperature=0, top_logprobs=2) for p in prompts]
    together = rust_lm.complete_batch(prompts, 12, temperature=0, top_logprobs=2)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.logprobs for c in together] == [c.logprobs for c in alone]
    assert [c.top_logprobs for c in together] == [c.top_logprobs for c in alone]
    s = rust_lm.engine.stats()
    assert s["admitted"] >= 8 and s["prefill_tokens"] > 0 and s["decode_tokens"] > 0


def test_rust_lm_seeded_choices_and_logprobs_match_the_model(rust_lm):
    one = rust_lm.complete("নদী", 8, temperature=1.0, seed=9)
    four = rust_lm.complete_batch(["নদী"], 8, n=4, temperature=1.0, seed=9)
    assert four[0].token_ids == one.token_ids and len({tuple(c.token_ids) for c in four}) > 1
    # the reported log-prob of the first token is the model's own (log-softmax of the raw logits)
    ids = [rust_lm.eot_id, *rust_lm.tokenize("নদী")]
    row = rust_lm.backend.logits(ids)[-1].astype(np.float64)
    lsm = row - row.max() - np.log(np.exp(row - row.max()).sum())
    assert abs(lsm[one.token_ids[0]] - one.logprobs[0]) < 1e-4


def test_rust_lm_stop_string_in_one_choice_leaves_the_other(rust_lm):
    full = rust_lm.complete("the cat", 16, temperature=0)
    assert len(full.text) >= 4
    stop = full.text[2:4]
    gens = rust_lm.start_choices("the cat", 2, 16, temperature=0, stop=[stop])
    cut = LM.collect(gens[0])
    gens2 = rust_lm.start_choices("the cat", 2, 16, temperature=0)
    gens2[0].cancel()
    rest = LM.collect(gens2[1])
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert LM.collect(gens[1]).text == cut.text
    assert rest.token_ids == full.token_ids
    assert LM.collect(gens2[0]).finish_reason == "cancelled"


def test_onnx_engine_batches_fp32_and_forks_choices(bundle):
    """The onnx backend behind the Python engine: a batch of greedy prompts gives each one's tokens alone (fp32
    rows are independent up to float noise), decoded in batched steps; n = 3 shares one prefill."""
    from serve import load

    lm = load(bundle, backend="onnx", threads=1, verify=False)
    calls = []
    real = lm.backend.decode_batch
    lm.backend.decode_batch = lambda seqs, toks: calls.append(len(seqs)) or real(seqs, toks)
    prompts = ["আমি বাংলায়", "The river", "নদী"]
    alone = [lm.complete(p, 10, temperature=0) for p in prompts]
    together = lm.complete_batch(prompts, 10, temperature=0)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert max(calls) == 3
    one = lm.complete("নদী", 8, temperature=1.0, seed=4)
    three = lm.complete_batch(["নদী"], 8, n=3, temperature=1.0, seed=4)
    assert three[0].token_ids == one.token_ids and len({tuple(c.token_ids) for c in three}) > 1
    lm.close()


def test_prompts_beside_decodes_are_prefilled_prefill_chunk_tokens_a_step():
    """A long prompt arriving while another sequence decodes goes in prefill_chunk tokens a step (the decoding
    stream is not stalled), and its answer is the one it gets alone."""
    tok = scripted_tokenizer()
    backend = CountingBackend(tok.get_vocab_size(with_added_tokens=True), 256, None, delay_s=0.02)
    chunks = []
    eng = StepEngine(backend, eot_id=0, max_batch=4, token_budget=64, prefill_chunk=4)
    real_new = backend.new_sequence

    def new_sequence():
        seq = real_new()
        inner = seq.prefill
        seq.prefill = lambda ids, all_logits=False: chunks.append(len(ids)) or inner(ids, all_logits)
        return seq

    backend.new_sequence = new_sequence
    try:
        first = eng.submit([0, 5], 200, SamplingParams(temperature=0))  # 4 s of decoding at 20 ms a step
        events = first.events(0)
        next(events)  # the first request decodes from now on
        second = eng.submit([0, *range(2, 16)], 3, SamplingParams(temperature=0))
        got = [e.token for e in second.events(0)]
        assert chunks[0] == 2 and chunks[1:] == [4, 4, 4, 3]  # 15 prompt positions beside decodes, 4 a step
        alone = StepEngine(ScriptedBackend(backend.vocab_size, 256, None), eot_id=0)
        assert got == [e.token for e in alone.submit([0, *range(2, 16)], 3, SamplingParams(temperature=0)).events(0)]
        alone.close()
        first.cancel()
        list(events)
    finally:
        eng.close()
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        StepEngine(backend, 0, prefill_chunk=0)
