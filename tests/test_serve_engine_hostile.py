"""The engine under hostile use: absurd arguments refused up front, lists with one bad prompt failing before
anything runs, streams closed early or cancelled from other threads, ``lm.close()`` while generations run,
many threads at once (answers equal to each request alone), failing backends, and the HTTP server's
disconnects, timeouts and queue limits — the engine always ends with no running sequence and keeps serving."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from serve.backends.base import BackendError
from serve.errors import ContextLengthError, RequestError
from serve.http.app import create_app
from serve.http.settings import Settings
from serve.lm import LM, MAX_CHOICES, MAX_TOP_LOGPROBS
from tests.polling import wait_until
from tests.scripted import ScriptedBackend, scripted_lm, scripted_tokenizer


def running(lm: LM) -> int:
    return lm.engine.stats()["running"]


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("n", [0, -1, True, 1.5, None, "2", MAX_CHOICES + 1, 10**12])
def test_bad_n_is_refused_before_anything_is_built(n):
    lm = scripted_lm(["ab"], context=64)
    with pytest.raises(RequestError, match=r"n must be an integer in \[1, 1024\]") as e:
        lm.start_choices("x", n, 2)  # 10**12 used to build 10**12 Generation objects (a hang, then MemoryError)
    assert e.value.param == "n" and lm._engine is None


@pytest.mark.parametrize("k", [-1, True, 1.5, "3", MAX_TOP_LOGPROBS + 1, 2**64])
def test_bad_top_logprobs_is_refused_up_front(k):
    lm = scripted_lm(["ab"], context=64)
    with pytest.raises(RequestError, match=r"top_logprobs \(logprobs in /v1/completions\) must be an integer in \[0, 1000\]"):
        lm.start("x", 2, top_logprobs=k)  # 2**64 used to reach Rust and raise OverflowError while iterating


@pytest.mark.parametrize("m", [-1, True, 1.5, "3", 10**12])
def test_bad_max_new_tokens_is_refused(m):
    lm = scripted_lm(["ab"], context=64)
    with pytest.raises(RequestError, match="max_tokens"):
        lm.generate("x", m)
    assert lm._engine is None


def test_n_on_a_one_generation_call_is_a_clear_error():
    lm = scripted_lm(["ab"], context=64)
    for call in (lm.generate, lm.complete, lm.start, lambda *a, **k: list(lm.stream(*a, **k))):
        with pytest.raises(RequestError, match=r"n is 2, but this call makes one generation") as e:
            call("x", 2, n=2)  # used to be "TypeError: start_choices() got multiple values for argument 'n'"
        assert e.value.param == "n"
    assert lm.generate("x", 2, n=1) == "abab" and lm.generate(["x", "y"], 1, n=2) == ["ab"] * 4


def test_a_list_with_one_bad_prompt_fails_before_anything_runs():
    lm = scripted_lm(["ab"], context=64)
    for bad, msg in ((["x", [5, 10**9]], "prompt 1: token id 1000000000 is out of range"),
                     (["x", "y", [5, "y"]], "prompt 2: token ids must be integers, got 'y'"),
                     ([[5], []], "prompt 1: expected at least one token id"),
                     (["x", [5] * 64], "prompt 1: the prompt is 65 tokens"),
                     ([["x"]], "token ids must be integers, got 'x'")):
        with pytest.raises(RequestError, match=msg):  # naming the first bad prompt of a list
            lm.generate(bad, 3, temperature=0)
    with pytest.raises(ContextLengthError, match="prompt 1: the prompt is 65 tokens") as e:
        lm.complete_batch(["x", [5] * 64], 3)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert lm._engine is None  # nothing was submitted: the engine never even started
    assert lm.generate(["x", [5, 6], ""], 2, temperature=0) == ["abab"] * 3  # text, ids and empty text mix


def test_stop_and_echo_with_several_choices():
    lm = scripted_lm(["ab", "cd"], context=64)
    out = lm.complete_batch(["xy"], 6, n=3, stop="c", echo=True, temperature=0)
    assert [(c.text, c.finish_reason, c.prompt.text) for c in out] == [("ab", "stop", "xy")] * 3
    none = lm.complete_batch(["xy"], 0, n=2, echo=True)
    assert [(c.text, c.finish_reason, c.prompt.token_ids) for c in none] == [("", "length", lm.tokenize("xy"))] * 2
    assert lm.complete("x", 5, ignore_eos=True, temperature=0).completion_tokens == 5
    assert running(lm) == 0


# ---------------------------------------------------------------- streams, cancel, close


def test_closing_streams_early_again_and_again_frees_the_engine():
    lm = scripted_lm(["ab"], context=512, delay_s=0.001)
    lm.configure_engine(2)
    for _ in range(6):
        s = lm.stream("x", 400, temperature=0)
        next(s)
        s.close()
        gens = lm.start_choices("x", 2, 400, temperature=0)
        it = iter(gens[1])
        next(it)
        it.close()
        gens[0].cancel()
    assert wait_until(lambda: running(lm) == 0)
    assert lm.complete("y", 3, temperature=0).completion_tokens == 3


def test_a_generation_closed_early_is_cancelled_not_length():
    lm = scripted_lm(["ab", "c"], context=128)
    gens = lm.start_choices("x", 3, 60, temperature=0)
    its = [iter(g) for g in gens]
    for it in its:
        next(it)
    its[0].close()
    its[2].close()
    rest = LM.collect(gens[1], [next(its[1]), *its[1]])
    assert [g.finish_reason for g in gens] == ["cancelled", "length", "cancelled"]  # were all "length"
    assert rest.completion_tokens == 59 and rest.text == ("abc" * 30)[2:]
    last = lm.start("x", 2, temperature=0)
    chunks = list(iter(last))
    iter(last).close()  # closing after the end changes nothing
    assert last.finish_reason == "length" and "".join(c.text for c in chunks) == "abc"
    assert wait_until(lambda: running(lm) == 0)


def test_cancel_from_another_thread_mid_stream():
    lm = scripted_lm(["ab"], context=2000, delay_s=0.002)
    gen = lm.start("x", 1500, temperature=0)
    chunks = []
    for c in gen:
        chunks.append(c)
        if len(chunks) == 3:
            threading.Thread(target=gen.cancel).start()
    assert gen.finish_reason == "cancelled" and 3 <= len(chunks) < 1500
    assert wait_until(lambda: running(lm) == 0)


def test_close_while_generations_run_cancels_them_and_a_new_engine_starts():
    lm = scripted_lm(["ab"], context=2000, delay_s=0.002)
    gens = [g for p in ("x", "y", "z") for g in lm.start_choices(p, 2, 1500, temperature=0)]
    out: list = [None] * len(gens)

    def drain(i):
        out[i] = LM.collect(gens[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    assert wait_until(lambda: all(g.tokens_generated > 0 for g in gens))
    old = lm.engine
    lm.close()
    for t in threads:
        t.join(timeout=60)  # a deadline for a broken engine only; close() ends them at once
    assert [c.finish_reason for c in out] == ["cancelled"] * len(gens)
    assert all(0 < c.completion_tokens < 1500 for c in out)
    assert lm.complete("x", 3, temperature=0).text == "ababab" and lm.engine is not old


def test_a_submission_racing_close_runs_in_the_next_engine():
    lm = scripted_lm(["ab"], context=64)
    old = lm.engine
    real = old.submit

    def racing(*a, **kw):  # lm.close() lands between the group reading lm.engine and its submit
        lm.close()
        return real(*a, **kw)

    old.submit = racing
    out = lm.complete("x", 3, temperature=0)  # used to raise BackendError("the engine is closed"): an HTTP 400
    assert (out.text, out.finish_reason) == ("ababab", "length") and lm.engine is not old

    def refuse(*a, **kw):
        raise BackendError("refused")

    lm.engine.submit = refuse  # a refusal by the LM's current engine is still raised
    with pytest.raises(BackendError, match="refused"):
        lm.complete("x", 1)


class Fatal(BaseException):
    """Not an Exception: escapes the engine's per-step error handling."""


class FatalOnce(ScriptedBackend):
    """Its first prefill waits for ``release`` (set by the test), then raises :class:`Fatal`, which kills the
    engine's scheduler thread: the test, not the timing, decides which requests are inside the engine then.
    (Not the first decode: a sequence decoding alone skips ``decode_batch`` and could finish before the rest
    were submitted.)"""

    fired = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def new_sequence(self):
        seq = super().new_sequence()
        prefill = seq.prefill

        def fatal_once(*a, **kw):
            if not self.fired:
                self.fired = True
                assert self.release.wait(timeout=60), "the test never released the fatal prefill"
                raise Fatal("the backend pulled the plug")
            return prefill(*a, **kw)

        seq.prefill = fatal_once
        return seq


CAUSE = "the engine stopped: Fatal: the backend pulled the plug"


def outcome(g) -> tuple[str, str]:
    """("done", text) for a generation that completed, ("error", message) for one that raised BackendError."""
    try:
        return "done", LM.collect(g).text
    except BackendError as e:
        return "error", str(e)


def obeys_the_dying_engine_rule(o: tuple[str, str], text: str) -> bool:
    """docs/design.md: a request submitted while the engine dies joins the replacement (and completes) or
    fails with the dying engine's cause — never "the engine is closed" — whichever side of the race it lands."""
    return o == ("done", text) or (o[0] == "error" and CAUSE in o[1])


def test_an_engine_thread_killed_by_its_backend_ends_every_request_and_is_replaced(monkeypatch):
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the dying thread's report
    tok = scripted_tokenizer()
    backend = FatalOnce(tok.get_vocab_size(with_added_tokens=True), 64, None)
    lm = LM(backend, tok, max_batch=2)
    dying = lm.engine
    inside = [g for p in ("x", "y", "z") for g in lm.start_choices(p, 1, 5, temperature=0)]
    for g in inside:  # the running pair and a queued third, all in before the fatal decode is released
        g.submit()
    assert lm._engine is dying and not dying.closed
    racing = lm.start_choices("w", 1, 5, temperature=0)[0]
    real = dying.submit

    def dies_first(*a, **kw):  # the group has read lm.engine; its thread dies before the submit lands
        backend.release.set()
        dying._thread.join(timeout=60)
        assert dying.closed and not dying._thread.is_alive() and lm._engine is dying
        return real(*a, **kw)

    dying.submit = dies_first
    racing.submit()  # used to raise BackendError("the engine is closed") (issue 29)
    assert lm._engine is not dying and not lm._engine.closed
    outs: list = []
    t = threading.Thread(target=lambda: outs.extend(outcome(g) for g in (*inside, racing)), daemon=True)
    t.start()
    t.join(timeout=60)  # ends at once: the requests inside were ended before the thread died (they used to hang)
    assert len(outs) == 4
    alone = LM(ScriptedBackend(tok.get_vocab_size(with_added_tokens=True), 64, None), tok)
    want = [LM.collect(g).text for p in ("x", "y", "z", "w") for g in alone.start_choices(p, 1, 5, temperature=0)]
    assert all(obeys_the_dying_engine_rule(o, t) for o, t in zip(outs, want))
    # and, the race driven by events, exactly which side each landed on: the three inside share the cause (they
    # used to wait forever), the racing one completed in the replacement as it would alone
    assert outs == [("error", CAUSE)] * 3 + [("done", want[3])] and len(want[3]) > 0
    assert lm.complete("y", 2, temperature=0).completion_tokens == 2 and running(lm) == 0


def test_an_engine_closed_between_the_read_and_the_submit_sends_the_request_to_its_replacement(monkeypatch):
    """Issue 29's reproduction: the engine closes itself (not via lm.close(), so lm._engine still names it)
    after LM chose it; the request goes to the replacement instead of failing with "the engine is closed"."""
    lm = scripted_lm(["ab"], context=64)
    engine_cls = type(lm.engine)
    real = engine_cls.submit
    calls: list = []

    def close_once(self, *a, **kw):
        calls.append(self)
        if len(calls) == 1:
            self.close()
        return real(self, *a, **kw)

    monkeypatch.setattr(engine_cls, "submit", close_once)
    first = lm._engine
    out = LM.collect(lm.start_choices("x", 1, 5, temperature=0)[0])
    assert (out.text, out.finish_reason) == ("ab" * 5, "length")
    assert len(calls) == 2 and calls[0] is first and first.closed and calls[1] is lm._engine is not first


class ForkFails(ScriptedBackend):
    def new_sequence(self):
        seq = super().new_sequence()

        def fork():
            raise RuntimeError("fork exploded")

        seq.fork = fork
        return seq


def test_a_failing_fork_ends_the_request_instead_of_hanging_it():
    tok = scripted_tokenizer()
    lm = LM(ForkFails(tok.get_vocab_size(with_added_tokens=True), 64, None), tok)
    gens = lm.start_choices("x", 3, 4, temperature=0)
    box: list = []
    t = threading.Thread(target=lambda: box.append(pytest.raises(RuntimeError, LM.collect, gens[1])), daemon=True)
    t.start()
    t.join(timeout=60)  # the request was in neither list of the scheduler: its choices never ended
    assert box and "fork exploded" in str(box[0].value)
    assert running(lm) == 0 and lm.complete("y", 2, temperature=0).completion_tokens == 2


class NanFor(ScriptedBackend):
    """Random logits, but NaN for every sequence whose prompt starts with token ``bad``."""

    def __init__(self, *a, bad: int, **kw):
        super().__init__(*a, **kw)
        self.bad = bad

    def new_sequence(self):
        seq = super().new_sequence()
        prefill, advance = seq.prefill, seq._advance
        state = {"bad": False}

        def pre(ids, all_logits=False):
            state["bad"] = state["bad"] or (len(ids) > 1 and ids[1] == self.bad)
            return prefill(ids, all_logits)

        def adv(t):
            row = advance(t)
            return np.full_like(row, np.nan) if state["bad"] and seq.steps > 2 else row

        seq.prefill, seq._advance = pre, adv
        return seq


def test_a_failing_choice_in_a_batch_cancels_the_unread_rest():
    tok = scripted_tokenizer()
    lm = LM(NanFor(tok.get_vocab_size(with_added_tokens=True), 30_000, None, delay_s=0.002, bad=10), tok)
    with pytest.raises(Exception, match="(?i)nan|finite"):
        lm.complete_batch([[10], [11], [12]], 20_000, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    assert wait_until(lambda: running(lm) == 0)  # the two healthy ones no longer run on, unread
    assert time.monotonic() - t0 < 30  # run on, they would hold the engine for 20,000 × 2 ms = 40 s at least


def test_forty_threads_small_batch_answers_equal_each_alone():
    lm = scripted_lm(None, context=128)
    lm.configure_engine(4)
    reqs = [([5 + i % 7], dict(temperature=0.8, seed=i) if i % 2 else dict(temperature=0)) for i in range(40)]
    alone = [lm.complete(p, 5, top_logprobs=2, **o) for p, o in reqs]
    together: list = [None] * len(reqs)

    def work(i):
        p, o = reqs[i]
        together[i] = lm.complete(p, 5, top_logprobs=2, **o)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [(c.token_ids, c.logprobs, c.top_logprobs) for c in together] == \
           [(c.token_ids, c.logprobs, c.top_logprobs) for c in alone]
    assert len({tuple(c.token_ids) for c in alone}) > 1 and running(lm) == 0


# ---------------------------------------------------------------- the Rust engine

rust_runtime = pytest.importorskip("rust_runtime", reason="rust_runtime is not built: pip install -e .")


@pytest.fixture(scope="module")
def rust_lm(tmp_path_factory):
    from tests.test_serve_engine import load_rust_lm

    lm = load_rust_lm(tmp_path_factory, max_batch=4)
    yield lm
    lm.close()


def test_rust_close_then_a_new_generation_starts_a_new_engine(rust_lm):
    before = rust_lm.complete("ab", 4, temperature=0)
    rust_lm.close()  # used to hand back the stopped engine: "the engine thread has stopped"
    after = rust_lm.complete("ab", 4, temperature=0)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_rust_close_while_generations_run_cancels_them(rust_lm):
    gens = [rust_lm.start("ab", 250, ignore_eos=True, temperature=0) for _ in range(12)]
    for g in gens:
        g.submit()
    rust_lm.close()
    reasons = [LM.collect(g).finish_reason for g in gens]
    assert "cancelled" in reasons and set(reasons) <= {"cancelled", "length"}
    assert rust_lm.generate("ab", 3, temperature=0)


def test_rust_top_logprobs_limit_and_streams_closed_early(rust_lm):
    c = rust_lm.complete("ab", 2, top_logprobs=MAX_TOP_LOGPROBS, ignore_eos=True, seed=0)  # exactly 2 tokens
    every = {rust_lm.table.display(i) for i in range(rust_lm.vocab_size)}  # a dict by display string
    assert MAX_TOP_LOGPROBS > rust_lm.vocab_size and [len(d) for d in c.top_logprobs] == [len(every)] * 2
    for _ in range(5):
        s = rust_lm.stream("ab", 200, ignore_eos=True, temperature=0)
        next(s)
        s.close()
    assert wait_until(lambda: running(rust_lm) == 0)
    assert rust_lm.complete("ab", 3, ignore_eos=True).completion_tokens == 3


def test_a_last_token_without_text_is_still_counted_and_returned():
    # a model's vocabulary may be wider than its tokenizer's (the Rust fixture's 512 rows): an id with no text that
    # came last was dropped from the output: 7 of 400 seeds of the Rust fixture returned 2 tokens of 3 asked
    tok = scripted_tokenizer(["ab"])
    width = tok.get_vocab_size()
    lm = LM(ScriptedBackend(width + 8, script=[tok.token_to_id("ab"), width + 3]), tok)
    c = lm.complete("x", 2, temperature=0)
    assert (c.completion_tokens, c.token_ids, c.text, c.text_offset) == (2, [258, width + 3], "ab", [0, 2])
    chunks = list(lm.start("x", 4, temperature=0))
    assert [(ch.text, ch.token_ids) for ch in chunks] == [("ab", [258]), ("ab", [width + 3, 258]), ("", [width + 3])]


def test_rust_forty_threads_bit_identical_to_alone(rust_lm):
    reqs = [("ab cd"[: 1 + i % 5], dict(temperature=0) if i % 2 else dict(seed=i, temperature=0.9))
            for i in range(40)]
    alone = [rust_lm.complete(p, 6, **o) for p, o in reqs]
    together: list = [None] * len(reqs)

    def work(i):
        p, o = reqs[i]
        together[i] = rust_lm.complete(p, 6, **o)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [(c.token_ids, c.logprobs) for c in together] == [(c.token_ids, c.logprobs) for c in alone]
    assert wait_until(lambda: running(rust_lm) == 0)  # published after the scheduler's next pass


# ---------------------------------------------------------------- HTTP


def engine_running(c: TestClient) -> float:
    """shalik_engine_running_sequences on /metrics."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("shalik_engine_running_sequences "):
            return float(line.split()[1])
    raise AssertionError("shalik_engine_running_sequences not in /metrics")


def test_http_n_64_with_a_small_batch_all_choices_complete():
    lm = scripted_lm(["ab", "cd"], context=64)
    with TestClient(create_app(Settings(max_concurrency=2), lm)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 64, "temperature": 0})
        assert r.status_code == 200
        choices = r.json()["choices"]
        assert [ch["index"] for ch in choices] == list(range(64)) and {ch["text"] for ch in choices} == {"abcdab"}
        assert r.json()["usage"]["completion_tokens"] == 64 * 3 and lm.engine.max_batch == 2
        r = c.post("/v1/completions", json={"prompt": ["x", "y"], "max_tokens": 2, "n": 64, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 128  # prompts × n at the limit
        assert wait_until(lambda: engine_running(c) == 0)  # published after the scheduler's next pass


def test_http_a_failing_choice_gives_an_error_and_frees_every_sequence():
    tok = scripted_tokenizer()
    lm = LM(NanFor(tok.get_vocab_size(with_added_tokens=True), 30_000, [5], delay_s=0.002, bad=10), tok)
    with TestClient(create_app(Settings(), lm)) as c:
        r = c.post("/v1/completions", json={"prompt": [[10], [11], [12]], "max_tokens": 20_000, "temperature": 0})
        assert r.status_code == 500 and r.json()["error"]["code"] == "model_output", r.text
        t0 = time.monotonic()
        assert wait_until(lambda: engine_running(c) == 0)  # the two healthy prompts were cancelled
        assert time.monotonic() - t0 < 30  # run on, they would take 20,000 × 2 ms = 40 s at least
        ok = c.post("/v1/completions", json={"prompt": [11], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


class StepFails(ScriptedBackend):
    """Fails every batched decode step once ``armed``."""

    armed = True

    def decode_batch(self, seqs, token_ids):
        if self.armed:
            raise RuntimeError("decode exploded")
        return super().decode_batch(seqs, token_ids)


def test_http_a_backend_failure_mid_step_is_an_error_event_and_the_server_keeps_serving():
    tok = scripted_tokenizer()
    # a scripted byte (no end-of-text to sample): random logits ended a choice early in about 1 run of 75
    backend = StepFails(tok.get_vocab_size(with_added_tokens=True), 64, [tok.token_to_id("a")])
    lm = LM(backend, tok)
    with TestClient(create_app(Settings(), lm), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "n": 2})
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError"
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 5, "n": 2, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert s.status_code == 200 and "internal error: RuntimeError: decode exploded" in "".join(lines[-2:])
        backend.armed = False
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        assert [ch["text"] for ch in ok.json()["choices"]] == ["aaa", "aaa"]
        assert wait_until(lambda: engine_running(c) == 0)  # published after the scheduler's next pass


def test_http_timeout_while_queued_in_the_engine_frees_it():
    lm = scripted_lm(["ab"], context=4000, delay_s=0.002)
    with TestClient(create_app(Settings(max_concurrency=1, request_timeout_s=0.3), lm)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3000, "n": 3})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert wait_until(lambda: engine_running(c) == 0)
        body = {"prompt": "x", "max_tokens": 3000, "n": 3, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as s:
            lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert s.status_code == 200 and lines[-1] == "[DONE]" and '"code":"timeout"' in lines[-2]
        assert wait_until(lambda: engine_running(c) == 0)
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_http_queue_full_is_429_while_the_engine_is_busy():
    lm = scripted_lm(["ab"], context=4000, delay_s=0.002)
    with TestClient(create_app(Settings(max_concurrency=1, max_queue=0), lm)) as c:
        gen = threading.Thread(target=lambda: c.post("/v1/completions", json={"prompt": "x", "max_tokens": 300}))
        gen.start()
        assert wait_until(lambda: engine_running(c) == 1)
        r = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["type"]
        gen.join(timeout=60)  # 300 tokens at 2 ms: 0.6 s on a quiet machine
        assert wait_until(lambda: engine_running(c) == 0)  # published after the scheduler's next pass
        assert c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}).status_code == 200


def test_http_disconnect_mid_stream_with_several_choices_drops_them_all():
    import httpx

    from tests.test_http_live import live_server, metric

    with live_server(["ab"], lm={"context": 20_000, "delay_s": 0.005}, max_concurrency=2) as srv:
        client = httpx.Client(timeout=10)
        body = {"prompt": "x", "max_tokens": 10_000, "n": 5, "stream": True}
        with client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()  # not closed until the response is: leaving a for loop over it would close it
            while not next(lines).startswith("data: "):
                pass
            assert metric(srv, "shalik_engine_running_sequences") == 2  # 5 choices in groups of the batch (2)
            assert metric(srv, "shalik_engine_waiting_sequences") == 3
        client.close()
        assert wait_until(lambda: metric(srv, "shalik_engine_running_sequences") == 0)
        assert metric(srv, "shalik_engine_waiting_sequences") == 0
        with httpx.Client(timeout=10) as c2:
            r = c2.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
        assert r.status_code == 200 and [ch["text"] for ch in r.json()["choices"]] == ["abab"] * 3


# ---------------------------------------------------------------- the onnx backend behind the Python engine


def test_onnx_threads_early_closes_and_close_mid_run(bundle):
    """Twelve threads over a batch of 4 get each request's greedy tokens alone (fp32 rows are independent, up to
    float noise: token ids compared), streams closed early free their places, and ``close()`` mid-run cancels."""
    from serve import load

    lm = load(bundle, backend="onnx", threads=1, verify=False, max_batch=4)
    prompts = ["আমি বাংলায়", "The river", "নদী", "x"] * 3
    alone = [lm.complete(p, 6, temperature=0).token_ids for p in prompts]
    together: list = [None] * len(prompts)

    def work(i):
        together[i] = lm.complete(prompts[i], 6, temperature=0).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert together == alone
    for _ in range(3):
        s = lm.stream("নদী", 60, temperature=0, ignore_eos=True)
        next(s)
        s.close()
    assert wait_until(lambda: running(lm) == 0)
    gens = lm.start_choices("নদী", 3, 110, ignore_eos=True)
    for g in gens:
        g.submit()
    lm.close()
    reasons = [LM.collect(g).finish_reason for g in gens]
    assert set(reasons) <= {"cancelled", "length"} and "cancelled" in reasons
    assert lm.complete("x", 2, temperature=0, ignore_eos=True).completion_tokens == 2
    lm.close()
