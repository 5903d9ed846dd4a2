"""The periodic evaluation of a run: validation NLL and bits per character per language (:func:`train.evaluate.
evaluate`), at step 0 also the random-init twin's, and greedy samples of the fixed prompts; rank 0 only."""

from __future__ import annotations

import time

from train.components.placement import Placement
from train.components.run_data import RunData
from train.components.run_log import RunLog
from train.components.state import TrainState
from train.evaluate import evaluate, greedy_samples
from train.model import LlamaForCausalLM


class Evaluator:
    """Evaluates ``model`` on ``data.val`` in ``placement``'s autocast, ``batch_size`` windows at a time, and
    records the ``eval`` row, the samples, a log line and loss.png through ``run_log``."""

    def __init__(self, data: RunData, placement: Placement, batch_size: int, run_log: RunLog, title: str):
        self.data = data
        self.placement = placement
        self.batch_size = batch_size
        self.run_log = run_log
        self.title = title

    def _val(self, model: LlamaForCausalLM) -> dict[str, dict]:
        return evaluate(model, self.data.val, self.data.char_counts, self.placement.device, self.placement.autocast,
                        batch_size=self.batch_size)

    def __call__(self, model: LlamaForCausalLM, state: TrainState) -> dict | None:
        """The ``{"kind": "eval", step, tokens, val[, random_init]}`` row written (None on ranks > 0). At step 0
        ``random_init`` is the model's own figure when it is the random init, else (``--init-from``) that of a
        freshly initialised twin (which draws from the global RNG, as it always has)."""
        if not self.placement.dist.is_main:
            return None
        t0 = time.time()
        val = self._val(model)
        row = {"kind": "eval", "step": state.step, "tokens": state.tokens, "val": val}
        if state.step == 0 and state.at_init:
            row["random_init"] = val
        elif state.step == 0:
            twin = LlamaForCausalLM(model.config).to(self.placement.device)
            row["random_init"] = self._val(twin)
            del twin
        self.run_log.append_metrics(row)
        samples = greedy_samples(model, self.data.tokenizer, self.data.eot_id)
        self.run_log.append_samples(state.step, samples)
        parts = ", ".join(f"{k} {v['nll']:.3f} nats ({v['bpc']:.3f} bpc)" for k, v in val.items())
        self.run_log.log(f"eval step {state.step}: {parts} [{time.time() - t0:.1f} s]")
        s0 = next((s for s in samples if s["lang"] == "bn"), None)
        if s0:
            self.run_log.log(f"  sample: {s0['prompt']}{s0['text']!r}")
        self.run_log.plot(self.title)
        return row
