"""The continuous-batching engine of rust_runtime (`rust_runtime.Engine`, issue 17).

A sequence's tokens and log-probs must be the same bits alone or beside fifteen others, and with
its prompt prefilled whole or in chunks (the kernels are batch-invariant by construction, see
rust_runtime/README.md); cancel leaves the batch before the next step; n > 1 prefills once.
Fixtures are random-init transformers bundles built by tests/test_rust_runtime.py's helpers.

Build the extension first: pip install ./rust_runtime
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.polling import wait_until
from tests.test_rust_runtime import build_bundle, corpus_lines, expect_error, prompt_ids, train_tokenizer

rust_runtime = pytest.importorskip(
    "rust_runtime", reason="rust_runtime is not built; install it with: pip install ./rust_runtime"
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tok = train_tokenizer(
        tmp_path_factory.mktemp("tok") / "tokenizer.json", r" ?\p{L}+| ?\p{N}+|\s+|.", corpus_lines(200)
    )
    d = tmp_path_factory.mktemp("engine_bundle")
    build_bundle(d, tok, hidden=128, inter=256, heads=4, kv=2, max_pos=512, seed=3)
    return d


@pytest.fixture(scope="module")
def model(bundle):
    return rust_runtime.Model.load(str(bundle), threads=1)


def run(stream) -> dict[int, tuple[list[tuple[int, float]], str]]:
    """Drain a RequestStream: {choice index: ([(token id, logprob)], finish reason)}."""
    out: dict[int, tuple[list, str | None]] = {}
    for index, tok, lp, _top, finish in stream:
        toks, _ = out.setdefault(index, ([], None))
        if finish is None:
            toks.append((tok, lp))
        else:
            out[index] = (toks, finish)
    return out


def test_chunked_prefill_logits_are_bit_identical(model):
    ids = prompt_ids(37, seed=1)
    whole = model.logits(ids)
    seq = model.new_sequence()
    parts = [seq.prefill(ids[a:b], all_logits=True) for a, b in ((0, 5), (5, 6), (6, 30), (30, 37))]
    assert np.array_equal(np.concatenate(parts), whole)


def test_batched_equals_alone_bit_for_bit(model):
    """Sixteen requests at once (greedy and seeded sampling, prompts of 3..48 tokens, budget 16 so that
    prompts are prefilled in chunks beside decoding sequences) give the tokens and log-probs of one
    request alone through Model.generate — the same bits."""
    eng = rust_runtime.Engine(model, max_batch=16, token_budget=16)
    reqs = []
    for j in range(16):
        p = prompt_ids(3 + 3 * j, seed=10 + j)
        kw = {"temperature": 0.0} if j % 2 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": j}
        reqs.append((p, kw, eng.submit(p, 20, **kw)))
    for p, kw, stream in reqs:
        got = run(stream)
        assert list(got) == [0]
        toks, finish = got[0]
        assert finish in ("length", "stop")
        assert toks == [(t, lp) for t, lp in model.generate(p, 20, **kw)]
    alone = rust_runtime.Engine(model, max_batch=1, token_budget=512)
    p, kw, _ = reqs[5]
    assert run(alone.submit(p, 20, **kw))[0][0] == [(t, lp) for t, lp in model.generate(p, 20, **kw)]
    st = eng.stats()
    assert st["prefill_tokens"] == sum(len(r[0]) for r in reqs) and st["steps"] > 0
    eng.close()
    alone.close()


def test_n_choices_prefill_once_and_choice_zero_equals_n1(model):
    eng = rust_runtime.Engine(model, max_batch=8, token_budget=64)
    p = prompt_ids(20, seed=3)
    got = run(eng.submit(p, 12, temperature=1.0, seed=7, n=4))
    assert sorted(got) == [0, 1, 2, 3]
    assert eng.stats()["prefill_tokens"] == len(p)
    assert got[0][0] == [(t, lp) for t, lp in model.generate(p, 12, temperature=1.0, seed=7)]
    assert len({tuple(t for t, _ in got[i][0]) for i in range(4)}) > 1
    expect_error(lambda: eng.submit(p, 4, n=9), ValueError, r"\bn\b", r"max_batch")


def test_top_logprobs_are_the_models(model):
    eng = rust_runtime.Engine(model, max_batch=2)
    p = prompt_ids(9, seed=4)
    (index, tok, lp, top, finish) = next(iter(eng.submit(p, 1, temperature=0.0, top_logprobs=3)))
    z = model.logits(p)[-1].astype(np.float64)
    ref = z - z.max() - np.log(np.exp(z - z.max()).sum())
    order = np.argsort(-ref, kind="stable")[:3]
    assert [t for t, _ in top] == [int(i) for i in order] and tok == int(order[0])
    assert np.allclose([v for _, v in top], ref[order], atol=1e-5) and abs(lp - ref[order[0]]) < 1e-5


def test_cancel_and_timeout_end_the_request(model):
    eng = rust_runtime.Engine(model, max_batch=4)
    p = prompt_ids(4, seed=5)
    s = eng.submit(p, 400, temperature=1.0, seed=1)
    it = iter(s)
    for _ in range(3):
        assert next(it)[4] is None
    s.cancel()
    rest = list(it)
    assert rest[-1][4] == "cancelled" and len(rest) < 300
    got = run(eng.submit(p, 400, timeout=1e-6, n=2))
    assert got == {0: ([], "timeout"), 1: ([], "timeout")}
    # a dropped stream is cancelled too: the engine is free for the next request
    for _ in range(5):
        eng.submit(p, 400)
    assert run(eng.submit(p, 3, temperature=0.0))[0][1] == "length"


def test_bad_requests_name_the_argument(model):
    eng = rust_runtime.Engine(model, max_batch=2)
    cases = [
        (lambda: eng.submit([], 4), ValueError, r"empty"),
        (lambda: eng.submit([512], 4), ValueError, r"512"),
        (lambda: eng.submit([1, 2], 4, seed=1.5), ValueError, r"seed"),
        (lambda: eng.submit([1, 2], 4, top_p="0.5"), ValueError, r"top_p"),
        (lambda: eng.submit([1, 2], 4, stop=["x"]), TypeError, r"submit\(\).*'stop'"),
        (lambda: eng.submit([1, 2], 4, 1), TypeError, r"positional"),
        (lambda: eng.submit([2**64], 4), ValueError, r"ids"),
        (lambda: eng.submit([1], 4, stop_ids=[999]), ValueError, r"stop_ids"),
        (lambda: eng.submit([1], 600), ValueError, r"512"),
        (lambda: eng.submit([1], 4, temperature=-1.0), ValueError, r"temperature"),
        (lambda: eng.submit([1], 4, timeout=-1.0), ValueError, r"timeout"),
        (lambda: eng.submit([1], -1), ValueError, r"max_new_tokens"),
        (lambda: eng.submit([1], 2**70), ValueError, r"max_new_tokens is 1180591620717411303424"),
        (lambda: eng.submit([1], False), TypeError, r"max_new_tokens is False \(bool\)"),
        (lambda: rust_runtime.Engine(model, max_batch=0), ValueError, r"max_batch"),
        (lambda: rust_runtime.Engine(model, token_budget=0), ValueError, r"token_budget"),
        (lambda: rust_runtime.Engine(model, prefill_chunk=0), ValueError, r"prefill_chunk"),
        (lambda: rust_runtime.Engine(model, prefill_chunk=-3), ValueError, r"prefill_chunk"),
        # the other integer arguments took True as 1, and past 64 bits gave pyo3's bare OverflowError
        (lambda: eng.submit([1], 4, n=True), TypeError, r"n is True \(bool\); expected an integer >= 1"),
        (lambda: eng.submit([1], 4, n=2**70), ValueError, rf"n is {2**70}; expected an integer >= 1"),
        (lambda: eng.submit([1], 4, n=0), ValueError, r"n is 0; expected an integer >= 1"),
        (lambda: eng.submit([1], 4, top_logprobs=True), TypeError, r"top_logprobs is True \(bool\)"),
        (lambda: eng.submit([1], 4, top_logprobs=1001), ValueError, r"top_logprobs is 1001; expected an integer "
                                                                     r"from 0 to 1000"),
        (lambda: eng.submit([1], 4, top_logprobs=2.0), TypeError, r"top_logprobs is 2\.0 \(float\)"),
        (lambda: eng.submit([1], 4, first_index=2**64), ValueError, r"first_index is 18446744073709551616"),
        (lambda: eng.submit([1], 4, first_index=-1), ValueError, r"first_index is -1; expected an integer from 0"),
        (lambda: rust_runtime.Engine(model, max_batch=True), TypeError, r"max_batch is True \(bool\)"),
        (lambda: rust_runtime.Engine(model, token_budget=2**70), ValueError, rf"token_budget is {2**70}; expected an "
                                                                           r"integer >= 1 \(at most 1048576\)"),
        (lambda: rust_runtime.Engine(model, prefill_chunk="8"), TypeError, r"prefill_chunk is '8' \(str\)"),
    ]
    for fn, exc, pat in cases:
        expect_error(fn, exc, pat)
    assert run(eng.submit([1, 2], 2, temperature=0.0))[0][1] == "length"


def test_prompts_beside_decodes_go_prefill_chunk_tokens_a_step_and_stay_bit_identical(model):
    """A long prompt arriving while another request decodes is prefilled at most prefill_chunk tokens a step
    (so it takes several steps, each also decoding the first request), and both requests give the bits of
    Model.generate alone."""
    eng = rust_runtime.Engine(model, max_batch=4, token_budget=256, prefill_chunk=8)
    assert (eng.max_batch, eng.token_budget, eng.prefill_chunk) == (4, 256, 8)
    assert rust_runtime.Engine(model).prefill_chunk == 16
    pa, pb = prompt_ids(5, seed=21), prompt_ids(90, seed=22)
    sa = eng.submit(pa, 200, temperature=0.0)
    it = iter(sa)
    first = [next(it)]  # A is decoding from here on (200 tokens: still while B runs)
    before = eng.stats()
    sb = eng.submit(pb, 10, temperature=0.7, seed=3)
    got_b = run(sb)
    st = eng.stats()
    got_a = first + list(it)
    # B's 90 prompt tokens took ceil(90 / 8) = 12 steps, then 9 decode steps (whole: 1 + 9); the counters
    # are published after each step, so they may lag by one
    assert st["steps"] - before["steps"] >= 12 + 9 - 1
    assert eng.stats()["prefill_tokens"] == len(pa) + len(pb)
    assert got_b[0][0] == [(t, lp) for t, lp in model.generate(pb, 10, temperature=0.7, seed=3)]
    toks_a = [(t, lp) for _i, t, lp, _top, f in got_a if f is None]
    assert toks_a == [(t, lp) for t, lp in model.generate(pa, 200, temperature=0.0)]
    eng.close()


def test_the_rust_defaults_and_limits_are_serve_policys(model):
    """One scheduling policy (issue 26): rust_runtime.Engine's defaults (src/policy.rs) are serve.policy's, and
    it refuses what serve.policy.check_engine_limits refuses."""
    from serve import policy

    eng = rust_runtime.Engine(model)
    assert (eng.max_batch, eng.token_budget, eng.prefill_chunk) == (
        policy.DEFAULT_MAX_BATCH, policy.DEFAULT_TOKEN_BUDGET, policy.DEFAULT_PREFILL_CHUNK)
    eng.close()
    top = rust_runtime.Engine(model, max_batch=policy.MAX_BATCH_LIMIT, token_budget=policy.MAX_TOKEN_BUDGET,
                              prefill_chunk=policy.MAX_TOKEN_BUDGET)
    top.close()
    for kw in (dict(max_batch=policy.MAX_BATCH_LIMIT + 1), dict(token_budget=policy.MAX_TOKEN_BUDGET + 1),
               dict(prefill_chunk=policy.MAX_TOKEN_BUDGET + 1)):
        expect_error(lambda kw=kw: rust_runtime.Engine(model, **kw), ValueError, next(iter(kw)))
        with pytest.raises(ValueError, match=next(iter(kw))):
            policy.check_engine_limits(**{"max_batch": 1, "token_budget": 1, **kw})


def test_the_timeout_of_serve_engine_reaches_rust(model):
    """serve.engine.RustEngine passes timeout_s on (it never did): every choice ends "timeout", with the tokens
    it made before; and serve's SamplingParams cross as one object (its fields as the sampling keywords)."""
    from serve.engine import RustEngine
    from serve.sampling import SamplingParams

    eng = RustEngine(rust_runtime.Engine(model, max_batch=4))
    try:
        p = prompt_ids(6, seed=9)
        # 1 ms: far less than 400 decode steps of two sequences take (at 50 ms, a quiet run of this machine's CI
        # finished all 400 first and ended "length")
        sub = eng.submit(p, 400, SamplingParams(temperature=0.9, top_k=2**70, seed=-1), n=2, ignore_eos=True,
                         timeout_s=1e-3)
        for i in range(2):
            evs = list(sub.events(i))
            assert evs[-1].finish == "timeout" and len(evs) < 400
        want = [(t, lp) for t, lp in model.generate(p, 5, temperature=0.9, seed=2**64 - 1)]
        got = list(eng.submit(p, 5, SamplingParams(temperature=0.9, seed=-1)).events(0))
        assert [(e.token, e.logprob) for e in got if e.finish is None] == want
        with pytest.raises(ValueError, match="timeout is -1"):
            eng.submit(p, 5, SamplingParams(), timeout_s=-1.0)
        assert wait_until(lambda: eng.stats()["running"] == 0)  # published after the scheduler's next pass
    finally:
        eng.close()
