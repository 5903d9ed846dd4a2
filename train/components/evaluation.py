"""The periodic evaluation of a run: validation NLL and bits per character per language (:func:`train.evaluate.
evaluate`), at step 0 also the random-init twin's, and greedy samples of the fixed prompts; and the final report
(:meth:`Evaluator.final`): the whole validation split per source file beside the compressor floor
(:mod:`train.compression`), and the samples a user would draw beside the greedy ones; rank 0 only."""

from __future__ import annotations

import time

from train import compression
from train.components.placement import Placement
from train.components.run_data import RunData
from train.components.run_log import RunLog
from train.components.state import TrainState
from train.evaluate import SAMPLE_PROMPTS, evaluate, evaluate_sources, greedy_samples, user_samples
from train.hf_files import SAMPLING
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
        self.prompts = SAMPLE_PROMPTS  # (lang, prompt text) of the samples; a subclass may change them
        self.stop_ids = None  # where the samples stop (default: data.eot_id)
        self.random_init_twin = True  # at step 0 of a run that starts from weights, also the random init's figures

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
        elif state.step == 0 and self.random_init_twin:
            twin = LlamaForCausalLM(model.config).to(self.placement.device)
            row["random_init"] = self._val(twin)
            del twin
        self.run_log.append_metrics(row)
        samples = greedy_samples(model, self.data.tokenizer, self.data.eot_id, prompts=self.prompts,
                                 stop_ids=self.stop_ids)
        self.run_log.append_samples(state.step, samples)
        parts = ", ".join(f"{k} {v['nll']:.3f} nats ({v['bpc']:.3f} bpc)" for k, v in val.items())
        self.run_log.log(f"eval step {state.step}: {parts} [{time.time() - t0:.1f} s]")
        s0 = next((s for s in samples if s["lang"] == "bn"), None)
        if s0:
            self.run_log.log(f"  sample: {s0['prompt']}{s0['text']!r}")
        self.run_log.plot(self.title)
        return row

    def final(self, model: LlamaForCausalLM, cfg, state: TrainState) -> dict | None:
        """The end-of-run report (None on ranks > 0): ``{"val_sources": evaluate_sources(...), "compression_floor":
        {source or language: {ppmd16, xz}}, "samples": user_samples(...)}``, logged as a table and written to
        samples.jsonl. A floor that cannot be measured (``pyppmd`` missing, unreadable inputs) is logged and left
        out; the model's figures stay."""
        if not self.placement.dist.is_main:
            return None
        t0 = time.time()
        out: dict = {}
        try:
            floor = compression.measure(cfg, log=self.run_log.log)
            sources = compression.validation_sources(cfg, log=self.run_log.log)
        except (ImportError, OSError, ValueError) as e:
            self.run_log.log(f"final evaluation: no compressor floor ({type(e).__name__}: {e})")
            floor, sources = None, None
        if sources:
            val = evaluate_sources(model, sources, self.data.tokenizer, self.data.eot_id, self.data.char_counts,
                                   cfg.train.seq_len, self.placement.device, self.placement.autocast,
                                   batch_size=self.batch_size)
            out["val_sources"] = val
            out["compression_floor"] = {k: {c: v[c] for c in compression.COMPRESSORS}
                                        for k, v in [*floor["sources"].items(), *floor["languages"].items()]}
            model_bpc = {k: v["bpc"] for k, v in val.items()}
            self.run_log.log("final evaluation, the whole validation split, bits per character (lower is better):\n"
                             + compression.format_table(floor, model_bpc))
        samples = user_samples(model, self.data.tokenizer, self.data.eot_id, SAMPLING, seed=cfg.run.seed)
        out["samples"] = samples
        self.run_log.append_samples(state.step, [{"kind": "final", **s} for s in samples])
        for s in samples:
            self.run_log.log(f"  [{s['lang']}, sampled] {s['prompt']}{s['sampled']!r} (distinct words "
                             f"{_share(s['distinct_sampled'])})")
            self.run_log.log(f"  [{s['lang']}, greedy]  {s['prompt']}{s['greedy']!r} (distinct words "
                             f"{_share(s['distinct_greedy'])})")
        self.run_log.log(f"final evaluation: {time.time() - t0:.1f} s")
        return out


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
