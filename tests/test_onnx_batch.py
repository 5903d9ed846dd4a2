"""serve.backends.onnx: OnnxBackend.decode_batch (several sequences in one session run, left-padded) against
one-at-a-time OnnxSequence.decode, its kept batched cache, and its refusals of bad input."""

from __future__ import annotations

import numpy as np
import pytest

from contract.quant import parse
from serve.backends.base import BackendError
from serve.backends.onnx import OnnxBackend

# fp32: float noise (a padded row's softmax runs over more slots, the masked ones exactly zero). q8_0: the graph's
# MatMulNBits quantizes activations per row and block, but its integer kernels may tile a batch differently from one
# row; and an older bundle's per-channel graph (DynamicQuantizeLinear) took ONE activation scale over every row of the
# batch, moving a row's logits by quantization noise of the kind of its own error against fp32. The bound is twice
# the q8_0 model's own largest logit error on the same prompts decoded one at a time, measured in this module (the
# per-channel graph's gap was 0.013-0.46 as the fixture's weights moved; its batch movement 0.006-0.07, up to 1.5x
# the gap): padding or a cache that leaked between rows moves logits by O(1), far past it.
FP32_TOL, Q8_SHARE = 2e-5, 2.0
PROMPTS = ([0], [0, 5, 9], [0, 17, 33, 4, 81, 250, 7], [0] + list(range(40, 52)))


@pytest.fixture(scope="module", params=[None, "q8_0"])
def backend(request, bundle) -> OnnxBackend:
    return OnnxBackend(bundle, quantize=parse(request.param), threads=1)


@pytest.fixture(scope="module")
def q8_gap(bundle) -> float:
    """Largest |q8_0 − fp32| logit over 16 greedy single-sequence decode steps of :data:`PROMPTS`."""
    q, f = OnnxBackend(bundle, quantize=parse("q8_0"), threads=1), OnnxBackend(bundle, quantize=None, threads=1)
    qs, toks = prefilled(q)
    fs, _ = prefilled(f)
    gap = 0.0
    for _ in range(16):
        lq = np.stack([s.decode(t) for s, t in zip(qs, toks, strict=True)])
        lf = np.stack([s.decode(t) for s, t in zip(fs, toks, strict=True)])
        gap = max(gap, float(np.abs(lq - lf).max()))
        toks = [int(t) for t in lf.argmax(-1)]
    assert 0.0 < gap < 2.0, gap  # q8_0 does move the logits, and not absurdly (range ~4 on the tiny bundle)
    return gap


@pytest.fixture
def tol(request, backend) -> float:
    return FP32_TOL if backend.quantize is None else Q8_SHARE * request.getfixturevalue("q8_gap")


def prefilled(backend, prompts=PROMPTS):
    """New sequences with ``prompts`` prefilled, and the greedy next token of each."""
    seqs = [backend.new_sequence() for _ in prompts]
    firsts = [int(s.prefill(p).argmax()) for s, p in zip(seqs, prompts, strict=True)]
    return seqs, firsts


def snapshot(seqs):
    """Each sequence's position and a copy of its cache."""
    return [(s.position, None if s._rows() is None else [(k.copy(), v.copy()) for k, v in s._rows()])
            for s in seqs]


def test_greedy_32_steps_4_prompt_lengths(backend, tol):
    batched, toks_b = prefilled(backend)
    single, toks_s = prefilled(backend)
    assert toks_b == toks_s
    worst, flips, decided = 0.0, 0, 0
    for _ in range(32):  # both fed the single sequences' greedy tokens, so one near-tie cannot fork the rest
        lb = backend.decode_batch(batched, toks_s)
        ls = np.stack([s.decode(t) for s, t in zip(single, toks_s, strict=True)])
        assert lb.shape == (4, backend.vocab_size) and lb.dtype == np.float32
        worst = max(worst, float(np.abs(lb - ls).max()))
        top2 = np.sort(ls, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * tol  # a margin the batch's deviation cannot cross
        decided += int(clear.sum())
        flips += int((lb.argmax(-1) != ls.argmax(-1))[clear].sum())
        toks_s = [int(t) for t in ls.argmax(-1)]
    # float32: every step is decided (tol 1e-4); a q8_0 row may move within the q8_0 model's own error (above), so
    # a greedy choice closer than that may go either way; every clear one must agree
    assert flips == 0 and decided >= (120 if backend.quantize is None else 64), (flips, decided)
    assert worst < tol, worst
    assert [s.position for s in batched] == [len(p) + 32 for p in PROMPTS] == [s.position for s in single]
    for a, b in zip(batched, single, strict=True):  # the caches too, row by row, without their padding
        for (ka, va), (kb, vb) in zip(a._rows(), b._rows(), strict=True):
            assert ka.shape == kb.shape and np.abs(ka - kb).max() < tol and np.abs(va - vb).max() < tol


def test_batch_of_one_is_decode(backend):
    (a,), (t,) = prefilled(backend, PROMPTS[2:3])
    (b,), _ = prefilled(backend, PROMPTS[2:3])
    for _ in range(3):
        la = backend.decode_batch([a], [t])
        lb = b.decode(t)
        assert la.shape == (1, backend.vocab_size) and np.array_equal(la[0], lb)
        t = int(lb.argmax())


def test_membership_changes_and_solo_steps(backend, tol):
    """Sequences leave, join and step alone between batches; every logit stays that of one-at-a-time decode."""
    batched, tb = prefilled(backend)
    single, ts = prefilled(backend)
    tb, ts = dict(enumerate(tb)), dict(enumerate(ts))
    plan = [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3], [1, 2, 3], [3, 0], [2], [0, 1, 2, 3], [3, 1], [0, 1, 2, 3]]
    for rows in plan:
        lb = backend.decode_batch([batched[r] for r in rows], [tb[r] for r in rows])
        for i, r in enumerate(rows):
            ls = single[r].decode(ts[r])
            assert np.abs(lb[i] - ls).max() < tol, (rows, r)
            tb[r], ts[r] = int(lb[i].argmax()), int(ls.argmax())
            assert tb[r] == ts[r]
    for r in (0, 2):  # solo decode and prefill straight from a batched row
        assert np.abs(batched[r].decode(tb[r]) - single[r].decode(ts[r])).max() < tol
        assert np.abs(batched[r].prefill([3, 4], True) - single[r].prefill([3, 4], True)).max() < tol
    assert [s.position for s in batched] == [s.position for s in single]


def test_kept_cache_equals_repadding(backend, monkeypatch):
    """Feeding the previous step's padded presents back gives exactly what re-padding every step gives."""
    kept, tk = prefilled(backend)
    repad, tr = prefilled(backend)
    for _ in range(4):
        lk = backend.decode_batch(kept, tk)
        monkeypatch.setattr(backend, "keep_batched_cache", False)
        lr = backend.decode_batch(repad, tr)
        monkeypatch.undo()
        assert np.array_equal(lk, lr)
        tk = tr = [int(t) for t in lk.argmax(-1)]


def test_padding_slots_do_not_leak(backend):
    """The mask hides the padding of the kept cache: poisoning those slots (1e4 in every key and value) changes
    no logit, not even in the last bit."""
    clean, toks = prefilled(backend)
    poisoned, _ = prefilled(backend)
    backend.decode_batch(clean, toks)
    backend.decode_batch(poisoned, toks)
    batch = poisoned[0]._slot[0]
    for i, s in enumerate(poisoned):
        for k, v in batch.past:
            k[i, :, :batch.width - s.position] = 1e4
            v[i, :, :batch.width - s.position] = 1e4
    assert batch.width - min(s.position for s in poisoned) == len(PROMPTS[-1]) - len(PROMPTS[0])
    nxt = [5, 6, 7, 8]
    assert np.array_equal(backend.decode_batch(poisoned, nxt), backend.decode_batch(clean, nxt))


def test_position_zero_in_a_batch(backend, tol):
    """A sequence with an empty cache may ride along (its row is all padding but the token itself)."""
    seqs, toks = prefilled(backend, PROMPTS[1:3])
    fresh, ref = backend.new_sequence(), backend.new_sequence()
    got = backend.decode_batch([fresh] + seqs, [0] + toks)
    assert np.abs(got[0] - ref.decode(0)).max() < tol and fresh.position == 1


def _bad_inputs(backend, seqs, other, full):
    s0, s1 = seqs
    return [
        (([], []), "empty list"),
        (([s0, s1], [1]), "2 sequences but 1 token ids"),
        (([s0, s1, s0], [1, 2, 3]), r"seqs\[2\] is seqs\[0\] again"),
        (([s0, other], [1, 2]), r"seqs\[1\] \(OnnxSequence\) is not a sequence of this backend"),
        (([s0, "seq"], [1, 2]), r"seqs\[1\] \(str\) is not a sequence"),
        (([s0, s1], [1, backend.vocab_size]), rf"token_ids\[1\]: token id {backend.vocab_size} is out of range"),
        (([s0, s1], [-1, 2]), r"token_ids\[0\]: token id -1 is out of range"),
        (([s0, s1], [1, 2.0]), r"token_ids\[1\]: token ids must be integers"),
        (([s0, s1], [True, 2]), r"token_ids\[0\]: token ids must be integers"),
        (([s1, full], [1, 2]), rf"seqs\[1\] / token_ids\[1\]: sequence too long: "
                               rf"{backend.max_position_embeddings} cached \+ 1 new"),
    ]


def test_bad_input_is_refused_and_changes_nothing(backend, bundle):
    seqs, toks = prefilled(backend, PROMPTS[1:3])
    backend.decode_batch(seqs, toks)  # the caches now live in a kept batch: a refusal must not disturb it
    other = OnnxBackend(bundle, threads=1).new_sequence()
    other.prefill([0, 1])
    full = backend.new_sequence()
    full.prefill(list(range(backend.max_position_embeddings)))
    everyone = [*seqs, other, full]
    before = snapshot(everyone)
    for (ss, ids), msg in _bad_inputs(backend, seqs, other, full):
        with pytest.raises(BackendError, match=msg):
            backend.decode_batch(ss, ids)
        after = snapshot(everyone)
        assert [p for p, _ in after] == [p for p, _ in before], msg
        for (_, ca), (_, cb) in zip(after, before, strict=True):
            assert all(np.array_equal(a, b) for la, lb in zip(ca, cb, strict=True)
                       for a, b in zip(la, lb, strict=True)), msg
    assert seqs[0]._slot is not None and seqs[0]._slot[0] is seqs[1]._slot[0]  # still one kept batch


def test_batch_pays_from_two(backend):
    """benchmarks/onnx_batching.py: decode_batch wins from B = 2 on; B = 1 is the same call. The engine never
    batches a quantized graph (an older bundle's per-channel one takes one activation scale per batch)."""
    expected = [False, True, True, True] if backend.quantize is None else [False] * 4
    assert [backend.batch_pays(b) for b in (1, 2, 4, 16)] == expected
