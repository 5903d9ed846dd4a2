"""The sampling cases S1–S5 against both samplers: serve.sampling (numpy, float64; the onnx path) and
rust_runtime.Sampler (float32; the very code each sequence of rust_runtime.Engine and Model.generate runs).

Every behavioural test takes the ``impl`` fixture, one adapter over either implementation, so the two agree on
every edge (greedy and its ties, top_k/top_p limits, penalties, bad logits, bad parameters). Random streams may
differ between the two; seeded reproducibility (S5) is checked within each. The tests of serve.sampling's own
internals (derived per-choice streams, the nucleus helper) stay Python-only at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from serve.errors import ModelOutputError, RequestError
from serve.sampling import (
    GREEDY_TEMPERATURE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    Sampler,
    SamplingParams,
    log_softmax,
    make_rng,
    top_logprobs,
)


class PythonImpl:
    """serve.sampling behind the adapter: ``sampler(prompt_ids, seed, **params)``, ``log_softmax``,
    ``top_logprobs(logits, n)`` (of raw logits), ``model_error`` (what bad logits raise)."""

    name = "python"
    model_error = ModelOutputError
    atol = 1e-12  # float64 arithmetic

    @staticmethod
    def sampler(prompt_ids=(), seed=None, **params):
        p = SamplingParams(seed=seed, **params)
        return Sampler(p, prompt_ids, make_rng(seed))

    @staticmethod
    def log_softmax(logits):
        return log_softmax(np.asarray(logits))

    @staticmethod
    def top_logprobs(logits, n):
        return top_logprobs(log_softmax(np.asarray(logits)), n)


class RustImpl:
    """rust_runtime.Sampler / log_softmax / top_logprobs behind the same adapter."""

    name = "rust"
    model_error = RuntimeError
    atol = 1e-5  # float32 arithmetic

    def __init__(self, rr):
        self.rr = rr

    def sampler(self, prompt_ids=(), seed=None, **params):
        return self.rr.Sampler(seed=seed, prompt_ids=list(prompt_ids), **params)

    def log_softmax(self, logits):
        return self.rr.log_softmax(np.asarray(logits, dtype=np.float32))

    def top_logprobs(self, logits, n):
        return self.rr.top_logprobs(np.asarray(logits, dtype=np.float32), n)


@pytest.fixture(params=["python", "rust"])
def impl(request):
    if request.param == "python":
        return PythonImpl()
    rr = pytest.importorskip("rust_runtime", reason="the Rust extension is not built")
    if not hasattr(rr, "Sampler"):
        pytest.skip("this rust_runtime build predates rust_runtime.Sampler; rebuild it")
    return RustImpl(rr)


def force(sampler, ids, vocab):
    """Make ``sampler`` generate ``ids`` (every other logit -inf), so the penalties see them as generated."""
    for i in ids:
        x = np.full(vocab, -np.inf, dtype=np.float32)
        x[i] = 0.0
        assert sampler(x) == i
    return sampler


# ---- S1: repetition penalty


def test_s1_repetition_penalty_pushes_negative_logits_down(impl):
    s = impl.sampler(prompt_ids=[0, 1], repetition_penalty=1.5, temperature=0.0)
    out = s.penalize(np.array([2.0, -2.0, 0.5], dtype=np.float32))
    np.testing.assert_allclose(out, [2.0 / 1.5, -3.0, 0.5], rtol=1e-6)
    assert out[1] < -2.0  # dividing would give -1.3333, raising the repeated token's probability
    # and the pick follows: -3.0 loses to -2.9, beats -3.1
    assert s(np.array([-2.0, -3.5, -2.9], dtype=np.float32)) == 2
    s = impl.sampler(prompt_ids=[0], repetition_penalty=1.5, temperature=0.0)
    assert s(np.array([-2.0, -3.1], dtype=np.float32)) == 0


def test_s1_penalty_one_is_a_no_op_and_duplicates_count_once(impl):
    x = np.array([2.0, -2.0, 0.5], dtype=np.float32)
    np.testing.assert_array_equal(impl.sampler(prompt_ids=[0, 1], repetition_penalty=1.0).penalize(x), x)
    np.testing.assert_allclose(impl.sampler(prompt_ids=[1, 1, 1], repetition_penalty=2.0).penalize(x),
                               [2.0, -4.0, 0.5])
    # a generated id already in the prompt is penalised once, not twice
    s = force(impl.sampler(prompt_ids=[0], repetition_penalty=2.0), [0, 0], 3)
    np.testing.assert_allclose(s.penalize(np.array([4.0, 1.0, 1.0], dtype=np.float32)), [2.0, 1.0, 1.0])


def test_repetition_penalty_uses_prompt_ids_but_presence_does_not(impl):
    s = force(impl.sampler(prompt_ids=[0], repetition_penalty=2.0), [2], 3)
    np.testing.assert_allclose(s.penalize(np.ones(3, dtype=np.float32)), [0.5, 1.0, 0.5])
    s = force(impl.sampler(prompt_ids=[0], presence_penalty=1.0), [2], 3)
    np.testing.assert_allclose(s.penalize(np.ones(3, dtype=np.float32)), [1.0, 1.0, 0.0])


# ---- S4: presence / frequency


def test_s4_presence_frequency_count_generated_tokens_only(impl):
    s = force(impl.sampler(prompt_ids=[7, 7, 7], frequency_penalty=0.5, presence_penalty=1.0), [5, 5, 9], 12)
    out = s.penalize(np.zeros(12, dtype=np.float32))
    expected = np.zeros(12)
    expected[5], expected[9] = -2.0, -1.5
    np.testing.assert_allclose(out, expected)
    assert out[7] == 0.0
    assert list(s.generated) == [5, 5, 9]


def test_s4_zero_penalties_change_nothing(impl):
    x = np.random.default_rng(0).normal(size=20).astype(np.float32)
    s = force(impl.sampler(prompt_ids=[3, 4]), [1, 2, 2], 20)
    np.testing.assert_array_equal(s.penalize(x), x)


def test_a_logit_penalised_past_float32_stays_finite(impl):
    # a logit near the float32 limit, penalised past it (the largest penalties in range), is still finite and,
    # the only finite one, still the token picked
    for logit, params in [(-1e38, dict(repetition_penalty=10.0)), (1e38, dict(repetition_penalty=0.1)),
                          (-1e38, dict(repetition_penalty=10.0, temperature=0.0))]:
        x = np.array([logit, -np.inf, -np.inf], dtype=np.float32)
        s = impl.sampler(prompt_ids=[0], **params)
        out = s.penalize(x)
        assert np.isfinite(out[0]) and np.isneginf(out[1:]).all()
        assert [s(x) for _ in range(5)] == [0] * 5


# ---- S3: temperature 0 is greedy


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_s3_temperature_zero_is_argmax_with_ties_to_lowest(impl, seed):
    assert impl.sampler(temperature=0.0, seed=seed)(np.array([1.0, 3.0, 3.0, -1.0])) == 1
    x = np.random.default_rng(seed).normal(size=512).astype(np.float32)
    assert impl.sampler(temperature=0.0)(x) == int(np.argmax(x))


def test_s3_tiny_temperature_is_finite_and_argmax(impl):
    x = np.random.default_rng(0).normal(size=512).astype(np.float32)
    for seed in range(5):
        assert impl.sampler(temperature=1e-7, seed=seed)(x) == int(np.argmax(x))


@pytest.mark.parametrize("temperature", [0.0, 1e-300, 1e-7, GREEDY_TEMPERATURE / 2])
def test_below_greedy_temperature_ties_go_to_the_lowest_id(impl, temperature):
    """Below 1e-5 (vLLM's rule) every temperature is its limit 0: the argmax, ties to the lowest id, in float32
    and float64 alike; at 1e-5 it samples, so two tied maxima both come up."""
    x = np.array([1.0, 3.0, 3.0, -1.0], dtype=np.float32)
    assert {impl.sampler(temperature=temperature, seed=s)(x) for s in range(20)} == {1}
    assert {impl.sampler(temperature=GREEDY_TEMPERATURE, seed=s)(x) for s in range(40)} == {1, 2}


def test_s3_penalties_apply_before_greedy_argmax(impl):
    # token 0 wins alone, but it was generated twice: frequency penalty 1.0 drops it below token 2
    s = force(impl.sampler(temperature=0.0, frequency_penalty=1.0), [0, 0], 3)
    assert s(np.array([3.0, 0.0, 2.0])) == 2
    s = impl.sampler(temperature=0.0, presence_penalty=2.0)
    assert [s(np.array([1.0, 0.5, 0.0])) for _ in range(3)] == [0, 1, 2]  # each pick penalised after it is made
    assert list(s.generated) == [0, 1, 2]


# ---- S2: tiny top_p keeps the top token


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("top_p", [1e-8, 1e-4, 1e-3, 0.0])
def test_s2_tiny_top_p_always_returns_argmax(impl, dtype, top_p):
    x = np.random.default_rng(0).normal(size=4096).astype(dtype)
    want = int(np.argmax(x))
    for seed in range(20):
        assert impl.sampler(temperature=0.8, top_p=top_p, seed=seed)(x) == want


def test_top_p_zero_is_the_top_token_with_ties_to_the_lowest_id(impl):
    x = np.array([0.5, 2.0, 2.0, 1.9], dtype=np.float32)
    assert {impl.sampler(top_p=0.0, seed=s)(x) for s in range(30)} == {1}


def test_s2_top_p_one_disables_the_filter(impl):
    x = np.zeros(50, dtype=np.float32)  # uniform: with the filter off, 200 draws see many distinct ids
    s = impl.sampler(top_p=1.0, seed=0)
    assert len({s(x) for _ in range(200)}) > 30


def test_top_p_keeps_smallest_set_reaching_mass(impl):
    # probs 0.5, 0.3, 0.2: top_p 0.6 keeps {0, 1}; top_p 0.45 keeps {0}; 0.81 keeps all
    x = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    s = impl.sampler(top_p=0.6, seed=3)
    assert {s(x) for _ in range(300)} == {0, 1}
    s = impl.sampler(top_p=0.45, seed=3)
    assert {s(x) for _ in range(50)} == {0}
    s = impl.sampler(top_p=0.81, seed=3)
    assert {s(x) for _ in range(300)} == {0, 1, 2}


def test_top_k_keeps_k_largest(impl):
    x = np.array([0.0, 5.0, 4.0, 3.0, -1.0], dtype=np.float32)
    s = impl.sampler(top_k=2, temperature=5.0, seed=1)
    assert {s(x) for _ in range(300)} == {1, 2}
    s = impl.sampler(top_k=1, temperature=5.0, seed=1)
    assert {s(x) for _ in range(20)} == {1}


def test_top_k_keeps_every_id_tied_with_the_kth(impl):
    """As Hugging Face's TopKLogitsWarper and vLLM: everything >= the k-th largest value stays."""
    x = np.array([1.0, 3.0, 3.0, 0.0, 2.0], dtype=np.float32)
    s = impl.sampler(top_k=1, temperature=2.0, seed=2)
    assert {s(x) for _ in range(100)} == {1, 2}
    s = impl.sampler(top_k=3, temperature=50.0, seed=2)  # k-th value 2.0 (id 4): no tie beyond it
    assert {s(x) for _ in range(300)} == {1, 2, 4}


@pytest.mark.parametrize("top_k", [0, 5, 6, 10**6, 2**70])
def test_top_k_zero_or_at_least_the_vocab_is_off(impl, top_k):
    x = np.zeros(5, dtype=np.float32)
    s = impl.sampler(top_k=top_k, seed=4)
    assert {s(x) for _ in range(200)} == {0, 1, 2, 3, 4}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30, 30), min_size=2, max_size=64), st.floats(0.05, 3.0), st.integers(0, 10),
       st.floats(0.0, 1.0), st.integers(0, 2**32))
# logits 0 and 2.2e-16: equal float32 probabilities (found by hypothesis)
@example(logits=[0.0, 2.220446049250313e-16], temperature=1.0, top_k=0, top_p=0.0, seed=0)
@pytest.mark.parametrize("which", ["python", "rust"])
def test_sampled_token_is_inside_top_k_and_nucleus(which, logits, temperature, top_k, top_p, seed):
    impl = PythonImpl() if which == "python" else _rust_or_skip()
    x = np.array(logits, dtype=np.float32).astype(np.float64)  # values both implementations see exactly
    tok = impl.sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)(x)
    assert 0 <= tok < len(x)
    if top_k:
        assert x[tok] >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    if not top_k:  # the mass of the tokens ranked above the chosen one has not yet reached top_p
        w = np.exp(x / temperature - np.max(x / temperature))
        order = np.lexsort((np.arange(len(x)), -w))  # most probable first, ties (equal probability) by id
        p = w[order] / w.sum()
        rank = int(np.flatnonzero(order == tok)[0])
        # tokens as probable as the chosen one to float32's precision tie (broken by id): the Rust sampler's
        # probabilities are float32 (logits 0 and 2.2e-16 give two equal ones), the reference's float64
        above = p[:rank][p[:rank] > p[rank] * (1 + 1e-6)]
        assert rank == 0 or above.sum() < top_p + impl.atol


def _rust_or_skip():
    rr = pytest.importorskip("rust_runtime", reason="the Rust extension is not built")
    if not hasattr(rr, "Sampler"):
        pytest.skip("this rust_runtime build predates rust_runtime.Sampler; rebuild it")
    return RustImpl(rr)


# ---- S5: per-request generators (each implementation reproduces itself; the two streams may differ)


def test_s5_same_seed_same_draws_and_no_global_rng(impl):
    x = np.zeros(1000, dtype=np.float32)
    np.random.seed(0)
    s = impl.sampler(temperature=1.0, seed=42)
    first = [s(x) for _ in range(16)]
    np.random.random(1000)  # disturbing numpy's global RNG changes nothing
    s = impl.sampler(temperature=1.0, seed=42)
    second = [s(x) for _ in range(16)]
    assert first == second
    assert len(set(first)) > 8  # really random draws, not a constant
    s = impl.sampler(temperature=1.0, seed=43)
    assert [s(x) for _ in range(16)] != first
    for a, b in [(-1, 2**64 - 1), (2**64 + 5, 5)]:  # seeds are taken modulo 2**64
        sa, sb = impl.sampler(seed=a), impl.sampler(seed=b)
        assert [sa(x) for _ in range(8)] == [sb(x) for _ in range(8)]


# ---- errors


@pytest.mark.parametrize("bad", [np.full(5, -np.inf), np.array([0.0, np.nan, 1.0]), np.array([np.inf, 0.0]),
                                 np.zeros(0)])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_unsampleable_logits_raise(impl, bad, temperature):
    with pytest.raises(impl.model_error):
        impl.sampler(temperature=temperature)(bad)


def test_some_neg_inf_logits_are_never_drawn(impl):
    x = np.array([-np.inf, 0.0, -np.inf, 0.0])
    s = impl.sampler(seed=0)
    assert {s(x) for _ in range(100)} == {1, 3}


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")), ("temperature", "1"),
                                         ("temperature", True), ("top_p", 1.5), ("top_p", -0.1),
                                         ("top_p", float("nan")), ("top_k", -1), ("top_k", True), ("top_k", 2.0),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                         ("repetition_penalty", float("inf")), ("repetition_penalty", 1e-45),
                                         ("repetition_penalty", 1e-39), ("repetition_penalty", 5e-324),
                                         ("repetition_penalty", 0.0999), ("repetition_penalty", 10.01),
                                         ("presence_penalty", float("inf")), ("presence_penalty", -2.01),
                                         ("presence_penalty", -1e300), ("frequency_penalty", 1e39),
                                         ("frequency_penalty", float("nan")), ("seed", 1.5), ("seed", True)])
def test_params_reject_out_of_range(impl, field, value):
    """A ValueError naming the parameter, in both (serve's RequestError is a ValueError with ``param``)."""
    kwargs = {field: value}
    with pytest.raises(ValueError, match=field) as e:
        impl.sampler(**kwargs)
    if isinstance(e.value, RequestError):
        assert e.value.param == field


@pytest.mark.parametrize("kwargs", [dict(temperature=0), dict(top_p=0.0), dict(top_p=1), dict(top_k=0),
                                    dict(top_k=np.int64(3)), dict(temperature=np.float32(0.5)),
                                    dict(repetition_penalty=0.1), dict(repetition_penalty=10),
                                    dict(presence_penalty=-2.0), dict(frequency_penalty=2),
                                    dict(seed=-(2**70)), dict(seed=np.uint64(2**64 - 1))])
def test_params_accept_the_edges(impl, kwargs):
    x = np.array([0.0, 1.0, 0.5], dtype=np.float32)
    assert impl.sampler(**{"seed": 0, **kwargs})(x) in {0, 1, 2}


def test_prompt_ids_outside_the_vocab_and_a_changing_vocab_are_refused(impl):
    x = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="prompt_ids"):
        impl.sampler(prompt_ids=[4])(x)
    with pytest.raises(ValueError, match="prompt_ids"):
        impl.sampler(prompt_ids=[-1])
    s = impl.sampler(prompt_ids=[3])
    s(x)
    with pytest.raises(ValueError, match="logits"):
        s(np.zeros(5, dtype=np.float32))


# ---- log-probs


def test_log_softmax_and_top_logprobs(impl):
    x = np.array([1.0, 3.0, 3.0, -np.inf])
    lp = impl.log_softmax(x)
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(), 1.0, rtol=1e-6)
    assert lp[3] == -np.inf
    want = np.log(np.exp([1.0, 3.0, 3.0]) / (np.exp(1) + 2 * np.exp(3)))
    np.testing.assert_allclose(lp[:3], want, rtol=1e-6)
    top = impl.top_logprobs(x, 3)
    assert [i for i, _ in top] == [1, 2, 0]  # ties ordered by id
    assert top[0][1] == pytest.approx(want[1], rel=1e-6)
    assert impl.top_logprobs(x, 0) == []
    assert [i for i, _ in impl.top_logprobs(x, 10)] == [1, 2, 0, 3]


def test_log_softmax_agrees_between_the_implementations():
    rust = _rust_or_skip()
    x = (np.random.default_rng(5).normal(size=1000) * 4).astype(np.float32)
    np.testing.assert_allclose(rust.log_softmax(x), PythonImpl.log_softmax(x), rtol=1e-5, atol=1e-5)
    assert [i for i, _ in rust.top_logprobs(x, 20)] == [i for i, _ in PythonImpl.top_logprobs(x, 20)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-40, 40), min_size=2, max_size=40), st.sampled_from([1.0, 2.0, 0.5, 4.0]),
       st.sampled_from([0.0, 0.5, 1.0, -0.25]), st.sampled_from([0.0, 0.25, 2.0, -1.0]),
       st.lists(st.integers(0, 1000), max_size=6), st.lists(st.integers(0, 1000), max_size=6))
def test_greedy_picks_are_identical_in_both(logits, rep, presence, frequency, prompt, history):
    """Logits on a 1/8 grid and penalties exact in float32: the two greedy picks must be the same id."""
    rust = _rust_or_skip()
    v = len(logits)
    x = np.array(logits, dtype=np.float32) / 8
    params = dict(temperature=0.0, repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    prompt = [i % v for i in prompt]
    py = force(PythonImpl.sampler(prompt_ids=prompt, **params), [i % v for i in history], v)
    rs = force(rust.sampler(prompt_ids=prompt, **params), [i % v for i in history], v)
    np.testing.assert_array_equal(rs.penalize(x), py.penalize(x).astype(np.float32))
    assert [py(x) for _ in range(4)] == [rs(x) for _ in range(4)]


def test_extreme_penalty_and_temperature_stay_finite(impl):
    # the smallest repetition penalty multiplies positive seen logits by 10: at temperature 1, 20 beats 10 ~always
    x = np.array([1.0, 2.0, -1.0, 0.5], dtype=np.float32)
    picks = {impl.sampler(repetition_penalty=0.1, prompt_ids=[0, 1], seed=s)(x) for s in range(50)}
    assert picks == {1}
    assert impl.sampler(temperature=1e-308, seed=0)(x) == 1


def test_the_smallest_repetition_penalty_is_computed_alike_in_both():
    """A repetition penalty of 1e-45 made rust_runtime (float32) tie every penalised logit at the largest float and
    pick the lowest id, end-of-text, while serve.sampling (float64) picked the largest: Model.generate returned [].
    The range (REPETITION_PENALTY_RANGE) keeps both computing the same logits, down to its smallest penalty."""
    rust = _rust_or_skip()
    lo = REPETITION_PENALTY_RANGE[0]
    x = np.array([5.0, 30.0, 40.0, -3.0, 35.0], dtype=np.float32)
    prompt = [0, 1, 2, 3]
    py, rs = (impl.sampler(prompt_ids=prompt, temperature=0.0, repetition_penalty=lo) for impl in (PythonImpl, rust))
    np.testing.assert_allclose(rs.penalize(x), py.penalize(x), rtol=1e-6)
    assert py(x) == rs(x) == 2


def test_the_rust_ranges_are_serve_samplings():
    """One owner per limit: rust_runtime mirrors serve.sampling's constants (src/sampling.rs, src/python.rs), and
    refuses exactly past them, as serve.sampling does."""
    rust = _rust_or_skip()
    from serve.loader import MAX_THREADS

    assert rust.rr.REPETITION_PENALTY_RANGE == REPETITION_PENALTY_RANGE
    assert rust.rr.PENALTY_RANGE == PENALTY_RANGE
    assert rust.rr.GREEDY_TEMPERATURE == GREEDY_TEMPERATURE
    assert rust.rr.MAX_THREADS == MAX_THREADS
    for name, (lo, hi) in [("repetition_penalty", REPETITION_PENALTY_RANGE), ("presence_penalty", PENALTY_RANGE),
                           ("frequency_penalty", PENALTY_RANGE)]:
        for impl in (PythonImpl, rust):
            impl.sampler(**{name: lo})
            impl.sampler(**{name: hi})
            for bad in (np.nextafter(lo, -np.inf), np.nextafter(hi, np.inf)):
                with pytest.raises(ValueError, match=name):
                    impl.sampler(**{name: float(bad)})


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300])
def test_a_temperature_so_small_that_logits_overflow_is_greedy(impl, temperature):
    """logits / temperature would overflow to inf for several tokens: the limit of temperature → 0 is the argmax,
    not a uniform draw among the tokens that overflowed."""
    logits = np.array([1.0, 3.0, 2.0, -1.0, 2.5])
    assert {impl.sampler(temperature=temperature, seed=s)(logits) for s in range(50)} == {1}
    filters = dict(temperature=temperature, top_k=3, top_p=0.9)
    assert {impl.sampler(**filters, seed=s)(logits) for s in range(50)} == {1}
    negative = np.array([-3.0, -1.0, -2.0])  # every logit overflows to -inf
    assert {impl.sampler(temperature=temperature, seed=s)(negative) for s in range(20)} == {1}


# ---- serve.sampling's own internals (Python only)


def test_s5_derived_streams_differ_per_choice_and_are_reproducible():
    x = np.zeros(1000)
    p = SamplingParams(seed=7)

    def draws(index):
        s = Sampler(p, [], make_rng(7, index))
        return [s(x) for _ in range(8)]

    choices = [draws(i) for i in range(4)]
    assert len({tuple(c) for c in choices}) == 4
    assert choices == [draws(i) for i in range(4)]
    assert make_rng(-1).random() == make_rng(2**64 - 1).random()  # negative seeds wrap


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
