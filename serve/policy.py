"""The engines' scheduling policy: the defaults, the request phases and the pure planning step.

Both engines follow it — :class:`serve.engine.StepEngine` (Python, over any backend) and ``rust_runtime.Engine``
(``rust_runtime/src/policy.rs``, the same function written in Rust; ``tests/data/scheduler_cases.json`` holds
the table of cases that both engines run, see ``tests/test_scheduler_cases.py`` and the Rust engine's tests, and
``tests/test_engine.py`` checks that Rust's defaults equal these). Each step of an engine is:

1. **retire**: requests cancelled (or a choice of them), or past their deadline, leave — waiting or running;
2. **plan** (:func:`plan_step`, pure: it never runs the model): admit waiting requests first come, first served
   while their choices fit in ``max_batch`` sequences (a request that does not fit waits, and so does everything
   behind it); every decoding sequence gets one token; then prompt chunks in admission order under the prefill
   budget (:func:`prefill_budget`: the whole ``token_budget`` when nothing decodes, else at most
   ``prefill_chunk`` tokens — Sarathi-Serve's stall-free batching — capped by what the decodes leave);
3. **run** the backend on that work (one batched forward in Rust);
4. **sample** every sequence that got logits (a prompt whose last chunk ran forks into its ``n`` choices first);
5. **post** the events and retire the choices that ended (end-of-text, ``max_new_tokens``).

The shape follows vLLM's scheduler (it plans, the model runner runs) and llama.cpp server's slot states
(:class:`Phase`). Stdlib only.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

# sequences per step: where more streams stop paying for their latency (benchmarks/results/serve_batching.md)
DEFAULT_MAX_BATCH = 16
DEFAULT_TOKEN_BUDGET = 256  # tokens per step (decode tokens + prefill chunks); llama.cpp's n_batch
# prompt tokens in a step that also decodes: a cap on how much a step beside decodes grows, so arriving prompts do not
# stall the streams (benchmarks/results/serve_batching_prefill_chunk.md)
DEFAULT_PREFILL_CHUNK = 16
MAX_BATCH_LIMIT = 4096  # the most sequences one engine steps together
MAX_TOKEN_BUDGET = 1 << 20  # the most tokens (token_budget, prefill_chunk) one step may carry


class Phase(enum.Enum):
    """Where a request stands (vLLM's RequestStatus, llama.cpp server's slot states).

    A request is WAITING in the queue (holding no sequence), then PREFILLING in the batch (one sequence whose
    cache its prompt enters chunk by chunk; it holds ``n`` slots, one per choice to come), then each of its
    choices is DECODING (one sequence each, fed its last token every step) until it is FINISHED (stop, length,
    cancelled, timeout or error) and holds nothing.
    """

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class Entry:
    """What the planner sees of a queued request or a batch entry.

    slots: sequences it holds in the batch (``n`` while waiting or prefilling, 1 for a decoding choice);
    prompt_left: prompt tokens not yet in its cache (0: it decodes).
    """

    slots: int
    prompt_left: int


@dataclass(frozen=True)
class Plan:
    """One step's work. ``admit``: the first ``admit`` waiting entries join the batch, after the running ones
    (``batch = running + waiting[:admit]``); ``decode``: indices into that batch that decode one token;
    ``prefill``: (index into the batch, prompt tokens) chunks, in batch order."""

    admit: int
    decode: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> int:
        """Tokens the step feeds the model (decodes + prompt chunks)."""
        return len(self.decode) + sum(t for _, t in self.prefill)


def check_engine_limits(max_batch: int, token_budget: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
    """ValueError unless ``max_batch`` is an int in [1, MAX_BATCH_LIMIT] and ``token_budget`` and
    ``prefill_chunk`` ints in [1, MAX_TOKEN_BUDGET] (rust_runtime.Engine refuses the same)."""
    for name, v, hi in (("max_batch", max_batch, MAX_BATCH_LIMIT), ("token_budget", token_budget, MAX_TOKEN_BUDGET),
                        ("prefill_chunk", prefill_chunk, MAX_TOKEN_BUDGET)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= hi:
            raise ValueError(f"{name} must be an int >= 1 (at most {hi}), got {v!r}")


def prefill_budget(token_budget: int, prefill_chunk: int, decoding: int) -> int:
    """Prompt tokens a step may take beside ``decoding`` decode tokens: the whole ``token_budget`` when nothing
    decodes, else ``prefill_chunk`` capped by what the decodes leave of the budget (never below 0)."""
    if decoding == 0:
        return token_budget
    return max(0, min(prefill_chunk, token_budget - decoding))


def plan_step(waiting: Sequence[Entry], running: Sequence[Entry], max_batch: int, token_budget: int,
              prefill_chunk: int) -> Plan:
    """The work of one step (module docstring, step 2), given the queue in arrival order and the batch in
    admission order. Pure: reads its arguments only. Assumes every entry's ``slots`` <= ``max_batch`` (the
    engines refuse a larger ``n`` at submission), so the queue always drains."""
    used = sum(e.slots for e in running)
    admit = 0
    for e in waiting:
        if used + e.slots > max_batch:
            break
        used += e.slots
        admit += 1
    batch = [*running, *waiting[:admit]]
    decode = tuple(i for i, e in enumerate(batch) if e.prompt_left == 0)
    budget = prefill_budget(token_budget, prefill_chunk, len(decode))
    prefill = []
    for i, e in enumerate(batch):
        if e.prompt_left > 0 and budget > 0:
            take = min(e.prompt_left, budget)
            budget -= take
            prefill.append((i, take))
    return Plan(admit, decode, tuple(prefill))
