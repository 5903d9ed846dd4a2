"""One scheduling policy (serve.policy, rust_runtime/src/policy.rs; issue 26): the pure planning step, and the
table of scheduler cases in tests/data/scheduler_cases.json run against serve's Python engine here (the Rust
engine runs the same file in its own tests: rust_runtime/src/engine.rs).

The engine is driven one step at a time (``_Scheduler.tick(now)``, step k at k seconds), over a backend whose
logits hash every id a sequence has been fed, so a choice fed a wrong token, chunked wrongly or forked from the
wrong cache gets other tokens than it gets alone.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from serve.backends.base import check_ids
from serve.engine import StepEngine, TokenEvent, _Request, _Scheduler
from serve.policy import (
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_TOKEN_BUDGET,
    MAX_BATCH_LIMIT,
    Entry,
    Plan,
    check_engine_limits,
    plan_step,
    prefill_budget,
)
from serve.sampling import SamplingParams

CASES = json.loads((Path(__file__).parent / "data" / "scheduler_cases.json").read_text(encoding="utf-8"))["cases"]
VOCAB, CONTEXT = 96, 32  # the Rust tests' fixture model: a case runs on both


class HashSequence:
    """A sequence whose logits are a pseudo-random function of every id it holds."""

    def __init__(self, ids: list[int] | None = None):
        self.ids = list(ids or [])

    @property
    def position(self) -> int:
        return len(self.ids)

    def prefill(self, ids, all_logits=False):
        self.ids += check_ids(ids, VOCAB, self.position, CONTEXT)
        return self._logits()

    def decode(self, token_id):
        self.ids += check_ids([token_id], VOCAB, self.position, CONTEXT)
        return self._logits()

    def fork(self) -> HashSequence:
        return HashSequence(self.ids)

    def _logits(self) -> np.ndarray:
        seed = zlib.crc32(np.asarray(self.ids, dtype=np.int64).tobytes())
        return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32)


class HashBackend:
    name, vocab_size, max_position_embeddings = "hash", VOCAB, CONTEXT

    def new_sequence(self) -> HashSequence:
        return HashSequence()


def make_request(spec: dict, j: int) -> _Request:
    """Request ``j`` of a case: its prompt from its own pattern (the Rust runner's), greedy unless it names a
    temperature; cancellations apply at once (the test is the scheduler thread)."""
    ids = [(i * 7 + j * 13 + 1) % VOCAB for i in range(spec["prompt"])]
    params = SamplingParams(temperature=spec.get("temperature", 0.0), seed=spec.get("seed"))
    return _Request(lambda fn: fn(), ids, spec["max_new"], params, spec.get("n", 1), 0, True,
                    timeout_s=spec.get("timeout"))


def drain(req: _Request, index: int) -> tuple[list[int], str]:
    """The tokens and the finish reason posted for choice ``index`` (all posted already)."""
    toks, finish = [], None
    while finish is None:
        ev: TokenEvent = req.queues[index].get_nowait()
        if ev.finish is None:
            toks.append(ev.token)
        finish = ev.finish
    return toks, finish


def alone(spec: dict, j: int) -> list[list[int]]:
    """Each choice's tokens with the request alone in a default-sized engine."""
    sched = _Scheduler(HashBackend(), -1, DEFAULT_MAX_BATCH, DEFAULT_TOKEN_BUDGET, DEFAULT_PREFILL_CHUNK)
    req = make_request({**spec, "timeout": None}, j)
    sched.add(req, 0.0)
    while sched.tick(0.0) is not None:
        pass
    return [drain(req, i)[0] for i in range(req.n)]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_python_engine_runs_each_case(case):
    lim = case["limits"]
    sched = _Scheduler(HashBackend(), -1, lim["max_batch"], lim["token_budget"], lim["prefill_chunk"])
    specs = case["requests"]
    reqs = [make_request(s, j) for j, s in enumerate(specs)]
    label = {id(r): s["id"] for r, s in zip(reqs, specs, strict=True)}
    total = ran_steps = 0
    fed = dict.fromkeys(label.values(), 0)  # tokens fed per request: its first token comes when the prompt is in
    first: dict[str, int] = {}
    for k in range(len(case["steps"]) + 1):
        for r, s in zip(reqs, specs, strict=True):
            if s.get("at", 0) == k:
                sched.add(r, float(k))
            if s.get("cancel_at") == k:
                r.cancel()
            for step, index in s.get("cancel_choice", []):
                if step == k:
                    r.cancel_choice(index)
        ran = sched.tick(float(k))
        got = {label[id(r)]: t for r, t in (ran or {}).items()}
        waiting = [label[id(r)] for r in sched.waiting]
        for s in specs:
            fed[s["id"]] += got.get(s["id"], 0)
            if fed[s["id"]] >= s["prompt"] > 0 and s["id"] not in first:
                first[s["id"]] = k
        if k < len(case["steps"]):
            step = case["steps"][k]
            assert (got, waiting) == (step["run"], step.get("waiting", [])), f"step {k}"
            total += sum(got.values())
            ran_steps += ran is not None
        else:
            assert ran is None and not sched.busy(), "idle after the listed steps"
    st = sched.stats
    assert (st["steps"], st["prefill_tokens"] + st["decode_tokens"]) == (ran_steps, total)
    assert sched.running == 0
    if "first_tokens" in case:
        assert sorted(first, key=lambda a: (first[a], [s["id"] for s in specs].index(a))) == case["first_tokens"]
    for j, (r, s) in enumerate(zip(reqs, specs, strict=True)):
        own = alone(s, j)
        for i, (want_n, want_finish) in enumerate(s["end"]):
            toks, finish = drain(r, i)
            assert (len(toks), finish) == (want_n, want_finish), f"{s['id']} choice {i}"
            assert toks == own[i][:len(toks)], f"{s['id']} choice {i}: its tokens alone"


def test_the_step_engine_thread_times_out_and_refuses_what_rust_refuses():
    """The timeout on the real clock, through the thread; n > max_batch and a bad timeout are refused up front
    (rust_runtime.Engine refuses both too)."""
    eng = StepEngine(HashBackend(), eot_id=-1, max_batch=2)
    try:
        sub = eng.submit([1, 2], 20, SamplingParams(temperature=0), n=2, ignore_eos=True, timeout_s=1e-9)
        assert [list(sub.events(i)) for i in range(2)] == [[TokenEvent(None, finish="timeout")]] * 2
        for kw, pat in ((dict(n=3), r"n is 3; expected 1 <= n <= max_batch = 2"),
                        (dict(timeout_s=0), "timeout is 0; expected seconds > 0"),
                        (dict(timeout_s=float("nan")), "timeout is nan")):
            with pytest.raises(ValueError, match=pat):
                eng.submit([1, 2], 3, SamplingParams(), **kw)
        assert eng.stats()["running"] == 0
    finally:
        eng.close()


# ---------------------------------------------------------------- the planner alone (rust: policy::tests)


def test_the_prefill_budget_is_the_token_budget_alone_else_the_chunk_capped_by_the_decodes():
    assert [prefill_budget(64, 4, 0), prefill_budget(64, 4, 3), prefill_budget(10, 16, 7),
            prefill_budget(10, 16, 12)] == [64, 4, 3, 0]


def test_prompt_chunks_go_in_admission_order_whatever_the_batch_layout():
    # C (arrival 2) sits where a finished sequence was, before B (arrival 1): B's prompt goes first
    assert plan_step([], [Entry(1, 6, 2), Entry(1, 3, 1)], 4, 4, 4) == Plan(0, (), ((1, 3), (0, 1)))
    # an admitted request comes after every running prompt
    assert plan_step([Entry(1, 2, 3)], [Entry(1, 0, 0), Entry(1, 5, 2)], 4, 4, 8) == Plan(1, (0,), ((1, 3),))


def test_admission_is_fifo_and_a_request_that_does_not_fit_blocks_the_queue():
    assert plan_step([Entry(3, 5), Entry(1, 2)], [Entry(1, 0)], 3, 8, 2) == Plan(0, (0,), ())
    assert plan_step([Entry(3, 10), Entry(1, 2)], [], 3, 8, 2) == Plan(1, (), ((0, 8),))
    p = plan_step([Entry(1, 1)], [Entry(1, 0), Entry(1, 3), Entry(1, 0)], 4, 8, 2)
    assert p == Plan(1, (0, 2), ((1, 2),)) and p.tokens == 4


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "4", MAX_BATCH_LIMIT + 1])
def test_limits_name_the_bad_one(bad):
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        check_engine_limits(bad, 8)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        check_engine_limits(4, 8, bad if bad != MAX_BATCH_LIMIT + 1 else 2**21)
    check_engine_limits(np.int64(MAX_BATCH_LIMIT), 1, 1)
