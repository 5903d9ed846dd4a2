"""Next-token sampling in pure numpy, in docs/design.md's order.

For one step, given the model's raw logits (float ``[V]``, any float dtype; computed here in float64):

1. ``repetition_penalty`` over every id seen so far (prompt + generated, each id once): a positive logit is
   divided by the penalty, a negative one multiplied (so a repeated token always becomes less likely; case S1);
2. ``presence_penalty`` / ``frequency_penalty`` over the generated ids only:
   ``logit -= presence * [count > 0] + frequency * count`` (case S4). The penalties' ranges
   (:data:`REPETITION_PENALTY_RANGE`, :data:`PENALTY_RANGE`) keep a model's logits finite in float32; should one be
   pushed past the float range anyway, it gives the largest finite value of that sign, never ±inf;
3. ``temperature < GREEDY_TEMPERATURE`` (1e-5, vLLM's rule; 0 included) → greedy: the argmax, ties to the
   lowest id (case S3); otherwise divide ``logits - max`` by it (no temperature overflows that);
4. ``top_k`` (0 = off): keep the k largest and every id tied with the k-th (Hugging Face's ``TopKLogitsWarper``
   and vLLM keep ties the same way);
5. ``top_p`` (1 = off): keep the smallest set, largest first, whose probability reaches ``top_p`` — never
   empty, so ``top_p = 0`` or a tiny one (1e-8, even for fp16 logits) keeps exactly the top token (case S2);
6. draw with the request's own ``numpy.random.Generator`` (no global RNG; case S5).

Logits with a NaN or +inf, or all ``-inf``, raise :class:`serve.errors.ModelOutputError`. Log-probabilities
reported to the user come from :func:`log_softmax` of the raw logits (before penalties and temperature).

The Rust runtime samples the same way (``rust_runtime/src/sampling.rs``, exposed as ``rust_runtime.Sampler``);
``tests/test_sampling.py`` runs its cases against both. Its arithmetic is float32, this one's float64.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serve.errors import ModelOutputError, RequestError, shown

SEED_MODULUS = 2**64
GREEDY_TEMPERATURE = 1e-5  # temperatures below it are greedy (vLLM's _SAMPLING_EPS); rust_runtime uses the same
#: repetition_penalty's range, both ends included (1 = off). Hugging Face and vLLM take any penalty > 0, but they
#: apply it in the logits' float32, where a tiny one (1e-45) overflows: transformers then samples from inf, and
#: rust_runtime (float32 too) tied every penalised logit at the largest float while this sampler (float64) did not,
#: so the two backends disagreed. Within [0.1, 10] a penalty scales a logit by at most 10, which keeps any logit a
#: model produces finite in float32 and both samplers computing the same thing; it spans every practical use
#: (1.0-1.5, below 1 to favour repeats) and mirrors the HTTP bound of 10 the server always had.
#: rust_runtime.REPETITION_PENALTY_RANGE (src/sampling.rs) is this; the HTTP schema reads it.
REPETITION_PENALTY_RANGE = (0.1, 10.0)
#: presence_penalty's and frequency_penalty's range, both ends included (0 = off): OpenAI's, for the same reason
#: (a penalty of 1e10 rounds logits together in float32 but not in float64). rust_runtime.PENALTY_RANGE is this.
PENALTY_RANGE = (-2.0, 2.0)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Validated on construction (:class:`RequestError` naming the field).

    temperature: >= 0 (below ``GREEDY_TEMPERATURE`` = greedy); top_k: >= 0 (0 = off); top_p: in [0, 1] (1 = off, 0 = the top token);
    presence_penalty, frequency_penalty: in :data:`PENALTY_RANGE` ([-2, 2], OpenAI's; 0 = off); repetition_penalty:
    in :data:`REPETITION_PENALTY_RANGE` ([0.1, 10]; 1 = off); seed: any int (reduced mod 2**64) or None for fresh
    entropy.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        def number(name: str, *, lo: float | None = None, hi: float | None = None) -> None:
            v = getattr(self, name)
            try:
                finite = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
            except OverflowError:  # an int past the float range
                finite = False
            if not finite:
                raise RequestError(f"{name} must be a finite number, got {shown(v)}", param=name)
            got = shown(v) if isinstance(v, int) else v  # a float as str() spells it
            if lo is not None and v < lo:
                raise RequestError(f"{name} must be >= {lo}, got {got}", param=name)
            if hi is not None and v > hi:
                raise RequestError(f"{name} must be <= {hi}, got {got}", param=name)

        number("temperature", lo=0.0)
        number("top_p", lo=0.0, hi=1.0)
        number("presence_penalty", lo=PENALTY_RANGE[0], hi=PENALTY_RANGE[1])
        number("frequency_penalty", lo=PENALTY_RANGE[0], hi=PENALTY_RANGE[1])
        number("repetition_penalty", lo=REPETITION_PENALTY_RANGE[0], hi=REPETITION_PENALTY_RANGE[1])
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer) or self.top_k < 0:
            raise RequestError(f"top_k must be an int >= 0 (0 = off), got {shown(self.top_k)}", param="top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer)):
            raise RequestError(f"seed must be an int or None, got {shown(self.seed)}", param="seed")

    @property
    def greedy(self) -> bool:
        """True when temperature is below ``GREEDY_TEMPERATURE`` (the argmax is taken; the RNG is never drawn)."""
        return self.temperature < GREEDY_TEMPERATURE


def make_rng(seed: int | None, index: int = 0) -> np.random.Generator:
    """The generator for choice ``index`` of a request seeded with ``seed``.

    Each choice gets its own stream derived from ``(seed, index)`` (``SeedSequence`` spawn keys), so
    ``n`` choices differ from each other yet the set is reproducible, and choice 0 of ``n=4`` equals the
    single choice of ``n=1``. ``seed=None`` draws fresh OS entropy. Negative seeds are taken mod 2**64.
    """
    if seed is None:
        ss = np.random.SeedSequence()
    else:
        ss = np.random.SeedSequence(entropy=int(seed) % SEED_MODULUS, spawn_key=(int(index),))
    return np.random.Generator(np.random.PCG64(ss))


def check_logits(logits: np.ndarray) -> np.ndarray:
    """``logits`` as a float64 1-D copy; :class:`ModelOutputError` for NaN, +inf or all ``-inf``."""
    x = np.array(logits, dtype=np.float64).reshape(-1)
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ModelOutputError("the model produced NaN or +inf logits; cannot sample the next token")
    if not np.isfinite(x).any():
        raise ModelOutputError("the model produced logits that are all -inf; no token can be sampled")
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis in float64 (shape kept). ``-inf`` logits give ``-inf``."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token id, log-prob)`` of a 1-D log-prob vector, largest first (ties: lower id)."""
    n = min(int(n), logprobs.shape[-1])
    if n <= 0:
        return []
    part = np.argpartition(-logprobs, n - 1)[:n] if n < logprobs.shape[-1] else np.arange(logprobs.shape[-1])
    order = part[np.lexsort((part, -logprobs[part]))]
    return [(int(i), float(logprobs[i])) for i in order]


def _clamp_finite(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new`` where ``old`` was finite clipped to the float64 range (a penalty's limit), else ``new``."""
    big = np.finfo(np.float64).max
    return np.where(np.isfinite(old), np.clip(new, -big, big), new)


def apply_repetition_penalty(logits: np.ndarray, ids: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty on every id in ``ids`` (prompt + generated; each id once): positive logits / penalty,
    negative ones * penalty; other ids unchanged; a result past the float range is the largest finite value.
    Returns a new float64 array (``penalty == 1`` returns a copy)."""
    out = np.array(logits, dtype=np.float64)
    if penalty == 1.0 or len(ids) == 0:
        return out
    idx = np.unique(np.asarray(ids, dtype=np.int64))
    x = out[idx]
    with np.errstate(over="ignore"):
        out[idx] = _clamp_finite(np.where(x > 0, x / penalty, x * penalty), x)
    return out


def apply_presence_frequency_penalties(logits: np.ndarray, generated_ids: Sequence[int], presence: float,
                                       frequency: float) -> np.ndarray:
    """OpenAI's penalties over the generated ids only: ``logit -= presence*[count>0] + frequency*count``.

    A finite logit pushed past the float range becomes the largest finite value of that sign. Returns a new
    float64 array."""
    out = np.array(logits, dtype=np.float64)
    if (presence == 0.0 and frequency == 0.0) or len(generated_ids) == 0:
        return out
    ids, counts = np.unique(np.asarray(generated_ids, dtype=np.int64), return_counts=True)
    x = out[ids]
    with np.errstate(over="ignore", invalid="ignore"):
        out[ids] = _clamp_finite(x - (presence + frequency * counts), x)
    return out


def _top_k_ids(z: np.ndarray, k: int) -> np.ndarray:
    """Ids (ascending) of the ``k`` largest values of ``z`` and of every id tied with the k-th largest
    (``z >= kth``, as Hugging Face's ``TopKLogitsWarper`` and vLLM keep them); ``0 < k < len(z)``."""
    kth = np.partition(z, z.shape[0] - k)[z.shape[0] - k]
    return np.flatnonzero(z >= kth)


def _nucleus(z: np.ndarray, top_p: float) -> np.ndarray:
    """Positions (ascending) of the smallest set of ``z``'s entries, most probable first under softmax(z),
    whose probability reaches ``top_p``; never empty; ties at the boundary go to the lower position.

    Sorts probabilities only (not ids), and only the 64 largest when they already reach ``top_p``."""
    with np.errstate(over="ignore"):
        w = np.exp(z - np.max(z))
    w /= w.sum()
    n = w.shape[0]
    top = -np.sort(-np.partition(w, n - 64)[n - 64:]) if n > 64 else -np.sort(-w)
    if top.sum() < top_p and top.shape[0] < n:
        top = -np.sort(-w)
    keep = max(1, min(int(np.searchsorted(np.cumsum(top), top_p, side="left")) + 1, top.shape[0]))
    tau = top[keep - 1]
    above = np.flatnonzero(w > tau)
    ties = np.flatnonzero(w == tau)[: keep - above.shape[0]]
    return np.sort(np.concatenate([above, ties]))


def _kept_candidates(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray | None:
    """Ids kept by top-k then top-p (renormalised within the top-k) on temperature-scaled logits ``z``, or
    None when neither filter is active (then every id is a candidate)."""
    k_active = 0 < top_k < z.shape[0]
    p_active = top_p < 1.0
    if not (k_active or p_active):
        return None
    if not k_active:
        return _nucleus(z, top_p)
    cand = _top_k_ids(z, top_k)
    return cand[_nucleus(z[cand], top_p)] if p_active else cand


def process_logits(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int] = (),
                   generated_ids: Sequence[int] = ()) -> np.ndarray:
    """Steps 1–2 (penalties) on checked logits; float64 ``[V]``. Raises ModelOutputError for bad logits."""
    x = check_logits(logits)
    if params.repetition_penalty != 1.0:
        x = apply_repetition_penalty(x, [*prompt_ids, *generated_ids], params.repetition_penalty)
    return apply_presence_frequency_penalties(x, generated_ids, params.presence_penalty, params.frequency_penalty)


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None,
                 prompt_ids: Sequence[int] = (), generated_ids: Sequence[int] = ()) -> int:
    """Pick the next token id from raw logits (float ``[V]``) following the module's order.

    ``rng`` is the request's generator (may be None when ``params.greedy``). Raises ModelOutputError for
    NaN/+inf/all ``-inf`` logits.
    """
    x = process_logits(logits, params, prompt_ids, generated_ids)
    if params.greedy:
        return int(np.argmax(x))  # first maximum: ties go to the lowest id
    if rng is None:
        raise ValueError("sample_token: a numpy Generator is required when temperature >= GREEDY_TEMPERATURE")
    with np.errstate(over="ignore"):  # (x - max) / T <= 0: no temperature can overflow it to +inf
        z = (x - np.max(x)) / params.temperature
    cand = _kept_candidates(z, params.top_k, params.top_p)
    zc = z if cand is None else z[cand]
    with np.errstate(over="ignore"):
        p = np.exp(zc - np.max(zc))
    cum = np.cumsum(p)
    j = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    j = min(j, zc.shape[0] - 1)
    while p[j] == 0.0:  # never land on an id with zero probability (e.g. -inf logits at the end)
        j -= 1
    return j if cand is None else int(cand[j])


class Sampler:
    """Stateful per-sequence sampler: remembers the prompt and generated ids for the penalties.

    ``Sampler(params, prompt_ids, rng)(logits) -> int`` picks a token and records it as generated. The vocab
    is the first call's logits length: a prompt id outside ``[0, vocab)`` or a later call with another length
    is a :class:`RequestError` (``param="prompt_ids"`` / ``"logits"``); bad logits a ModelOutputError.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], rng: np.random.Generator | None):
        self.params = params
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.generated: list[int] = []
        self.rng = rng
        self.vocab: int | None = None
        bad = [i for i in self.prompt_ids if i < 0]
        if bad:
            raise RequestError(f"prompt_ids: token id {bad[0]} is out of range: expected 0 <= id", param="prompt_ids")

    def __call__(self, logits: np.ndarray) -> int:
        tok = sample_token(self._checked(logits), self.params, self.rng, self.prompt_ids, self.generated)
        self.generated.append(tok)
        return tok

    def penalize(self, logits: np.ndarray) -> np.ndarray:
        """The logits (float ``[V]``) after the penalties of the current state (float64 ``[V]``): what the next
        call samples from before the temperature. Records nothing; errors as for a call."""
        return process_logits(self._checked(logits), self.params, self.prompt_ids, self.generated)

    def _checked(self, logits: np.ndarray) -> np.ndarray:
        x = check_logits(logits)
        if self.vocab is None:
            bad = [i for i in self.prompt_ids if i >= x.shape[0]]
            if bad:
                raise RequestError(f"prompt_ids: token id {bad[0]} is out of range: expected 0 <= id < vocab = "
                                   f"{x.shape[0]} (the logits' length)", param="prompt_ids")
            self.vocab = x.shape[0]
        elif x.shape[0] != self.vocab:
            raise RequestError(f"logits: expected {self.vocab} values (the vocab of the first call), got "
                               f"{x.shape[0]}", param="logits")
        return x
