"""serve.sampling: docs/design.md's sampling order and the S1–S5 cases (pure numpy, milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.errors import ModelOutputError, RequestError
from serve.sampling import (
    Sampler,
    SamplingParams,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    log_softmax,
    make_rng,
    process_logits,
    sample_token,
    top_logprobs,
)

# ---- S1: repetition penalty


def test_s1_repetition_penalty_pushes_negative_logits_down():
    out = apply_repetition_penalty(np.array([2.0, -2.0, 0.5]), [0, 1], 1.5)
    np.testing.assert_allclose(out, [2.0 / 1.5, -3.0, 0.5])
    assert out[1] < -2.0  # dividing would give -1.3333, raising the repeated token's probability


def test_s1_penalty_one_is_a_no_op_and_duplicates_count_once():
    x = np.array([2.0, -2.0, 0.5])
    np.testing.assert_array_equal(apply_repetition_penalty(x, [0, 1], 1.0), x)
    np.testing.assert_allclose(apply_repetition_penalty(x, [1, 1, 1], 2.0), [2.0, -4.0, 0.5])


def test_repetition_penalty_uses_prompt_ids_but_presence_does_not():
    p = SamplingParams(repetition_penalty=2.0)
    out = process_logits(np.array([1.0, 1.0, 1.0]), p, prompt_ids=[0], generated_ids=[2])
    np.testing.assert_allclose(out, [0.5, 1.0, 0.5])


# ---- S4: presence / frequency


def test_s4_presence_frequency_count_generated_tokens_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = process_logits(np.zeros(12), params, prompt_ids=[7, 7, 7], generated_ids=[5, 5, 9])
    expected = np.zeros(12)
    expected[5], expected[9] = -2.0, -1.5
    np.testing.assert_allclose(out, expected)
    assert out[7] == 0.0


def test_s4_zero_penalties_change_nothing():
    x = np.random.default_rng(0).normal(size=20)
    np.testing.assert_array_equal(apply_presence_frequency_penalties(x, [1, 2, 2], 0.0, 0.0), x)


# ---- S3: temperature 0 is greedy


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_s3_temperature_zero_is_argmax_with_ties_to_lowest(seed):
    p = SamplingParams(temperature=0.0, seed=seed)
    assert sample_token(np.array([1.0, 3.0, 3.0, -1.0]), p, make_rng(seed)) == 1
    x = np.random.default_rng(seed).normal(size=512).astype(np.float32)
    assert sample_token(x, p, None) == int(np.argmax(x))


def test_s3_tiny_temperature_is_finite_and_argmax():
    x = np.random.default_rng(0).normal(size=512).astype(np.float32)
    for seed in range(5):
        assert sample_token(x, SamplingParams(temperature=1e-7), make_rng(seed)) == int(np.argmax(x))


def test_s3_penalties_apply_before_greedy_argmax():
    # token 0 wins alone, but it was generated twice: frequency penalty 1.0 drops it below token 2
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sample_token(np.array([3.0, 0.0, 2.0]), p, None, generated_ids=[0, 0]) == 2


# ---- S2: tiny top_p keeps the top token


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("top_p", [1e-8, 1e-4, 1e-3, 0.0])
def test_s2_tiny_top_p_always_returns_argmax(dtype, top_p):
    x = np.random.default_rng(0).normal(size=4096).astype(dtype)
    want = int(np.argmax(x))
    for seed in range(20):
        got = sample_token(x, SamplingParams(temperature=0.8, top_p=top_p, seed=seed), make_rng(seed))
        assert got == want


def test_s2_top_p_one_disables_the_filter():
    x = np.zeros(50)  # uniform: with the filter off, 200 draws see many distinct ids
    rng = make_rng(0)
    seen = {sample_token(x, SamplingParams(top_p=1.0), rng) for _ in range(200)}
    assert len(seen) > 30


def test_top_p_keeps_smallest_set_reaching_mass():
    # probs 0.5, 0.3, 0.2: top_p 0.6 keeps {0, 1}; top_p 0.5 keeps {0}
    x = np.log(np.array([0.5, 0.3, 0.2]))
    rng = make_rng(3)
    assert {sample_token(x, SamplingParams(top_p=0.6), rng) for _ in range(300)} == {0, 1}
    assert {sample_token(x, SamplingParams(top_p=0.5), rng) for _ in range(50)} == {0}


def test_top_k_keeps_k_largest():
    x = np.array([0.0, 5.0, 4.0, 3.0, -1.0])
    rng = make_rng(1)
    assert {sample_token(x, SamplingParams(top_k=2, temperature=5.0), rng) for _ in range(300)} == {1, 2}
    assert {sample_token(x, SamplingParams(top_k=1, temperature=5.0), rng) for _ in range(20)} == {1}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=2, max_size=64), st.floats(0.05, 3.0), st.integers(0, 10),
       st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_sampled_token_is_inside_top_k_and_nucleus(logits, temperature, top_k, top_p, seed):
    x = np.array(logits)
    tok = sample_token(x, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), make_rng(seed))
    assert 0 <= tok < len(x)
    if top_k:
        assert x[tok] >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    if not top_k:  # the mass of the tokens ranked above the chosen one has not yet reached top_p
        w = np.exp(x / temperature - np.max(x / temperature))
        order = np.lexsort((np.arange(len(x)), -w))  # most probable first, ties (equal probability) by id
        p = w[order] / w.sum()
        rank = int(np.flatnonzero(order == tok)[0])
        assert rank == 0 or p[:rank].sum() < top_p + 1e-9


# ---- S5: per-request generators


def test_s5_same_seed_same_draws_and_no_global_rng():
    x = np.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=42)
    np.random.seed(0)
    rng = make_rng(42)
    first = [sample_token(x, p, rng) for _ in range(16)]
    np.random.random(1000)  # disturbing numpy's global RNG changes nothing
    rng = make_rng(42)
    second = [sample_token(x, p, rng) for _ in range(16)]
    assert first == second
    assert len(set(first)) > 8  # really random draws, not a constant


def test_s5_derived_streams_differ_per_choice_and_are_reproducible():
    x = np.zeros(1000)
    p = SamplingParams(seed=7)

    def draws(index):
        rng = make_rng(7, index)
        return [sample_token(x, p, rng) for _ in range(8)]

    choices = [draws(i) for i in range(4)]
    assert len({tuple(c) for c in choices}) == 4
    assert choices == [draws(i) for i in range(4)]
    assert make_rng(-1).random() == make_rng(2**64 - 1).random()  # negative seeds wrap


# ---- errors, log-probs


@pytest.mark.parametrize("bad", [np.full(5, -np.inf), np.array([0.0, np.nan, 1.0]), np.array([np.inf, 0.0])])
def test_unsampleable_logits_raise(bad):
    with pytest.raises(ModelOutputError):
        sample_token(bad, SamplingParams(), make_rng(0))
    with pytest.raises(ModelOutputError):
        sample_token(bad, SamplingParams(temperature=0.0), None)


def test_some_neg_inf_logits_are_never_drawn():
    x = np.array([-np.inf, 0.0, -np.inf, 0.0])
    rng = make_rng(0)
    assert {sample_token(x, SamplingParams(), rng) for _ in range(100)} == {1, 3}


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 1.5),
                                         ("top_p", -0.1), ("top_k", -1), ("repetition_penalty", 0.0),
                                         ("presence_penalty", float("inf")), ("seed", 1.5), ("top_k", True)])
def test_params_reject_out_of_range(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_log_softmax_and_top_logprobs():
    x = np.array([1.0, 3.0, 3.0, -np.inf])
    lp = log_softmax(x)
    np.testing.assert_allclose(np.exp(lp).sum(), 1.0)
    assert lp[3] == -np.inf
    top = top_logprobs(lp, 3)
    assert [i for i, _ in top] == [1, 2, 0]  # ties ordered by id
    assert top[0][1] == pytest.approx(np.log(np.exp(3) / (np.exp(1) + 2 * np.exp(3))))
    assert top_logprobs(lp, 0) == []


def test_sampler_records_generated_for_penalties():
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt_ids=[], rng=None)
    x = np.array([1.0, 0.5, 0.0])
    assert [s(x) for _ in range(3)] == [0, 1, 2]  # each pick is penalised after it is made
    assert s.generated == [0, 1, 2]


def test_extreme_penalty_and_temperature_stay_finite():
    # a repetition penalty of 5e-324 turns positive seen logits into +inf; sampling must still pick among them
    x = np.array([1.0, 2.0, -1.0, 0.5])
    rng = make_rng(0)
    picks = {sample_token(x, SamplingParams(repetition_penalty=5e-324), rng, prompt_ids=[0, 1]) for _ in range(50)}
    assert picks <= {0, 1} and picks
    assert sample_token(x, SamplingParams(temperature=1e-308), rng) == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]) | st.floats(-20, 20), min_size=1, max_size=300),
       st.floats(0.0, 1.0))
def test_nucleus_is_the_smallest_set_with_ties_to_lower_ids(logits, top_p):
    from serve.sampling import _nucleus

    z = np.array(logits)
    w = np.exp(z - z.max())
    w /= w.sum()
    order = np.lexsort((np.arange(len(z)), -w))  # most probable first, ties by id
    keep = max(1, min(int(np.searchsorted(np.cumsum(w[order]), top_p, side="left")) + 1, len(z)))
    assert _nucleus(z, top_p).tolist() == sorted(order[:keep].tolist())


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300])
def test_a_temperature_so_small_that_logits_overflow_is_greedy(temperature):
    """logits / temperature overflows to inf for several tokens: the limit of temperature → 0 is the argmax,
    not a uniform draw among the tokens that overflowed."""
    logits = np.array([1.0, 3.0, 2.0, -1.0, 2.5])
    p = SamplingParams(temperature=temperature)
    picks = {sample_token(logits, p, make_rng(s)) for s in range(50)}
    assert picks == {1}
    with_filters = SamplingParams(temperature=temperature, top_k=3, top_p=0.9)
    assert {sample_token(logits, with_filters, make_rng(s)) for s in range(50)} == {1}
    negative = np.array([-3.0, -1.0, -2.0])  # every logit overflows to -inf
    assert {sample_token(negative, p, make_rng(s)) for s in range(20)} == {1}
