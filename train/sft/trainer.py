"""Supervised fine-tuning as a configuration of :class:`train.run.Trainer`: the same loop, preflight, ``--resume``,
DDP, checkpoints, progress, summary and run folder, with three parts replaced — the data (conversations with
their loss mask, :class:`train.sft.data.SFTData`), the starting weights (the pretrained run's, grown by the chat
tokens, :func:`train.sft.init.load_base`) and the evaluation (assistant-token loss per language, replies to
fixed chat prompts stopping at ``<|im_end|>``)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from contract.chat_format import IM_END, render
from train import windows as W
from train.components.checkpoint import checkpoint_identity
from train.components.evaluation import Evaluator, user_samples
from train.config import Config
from train.hf_files import SAMPLING
from train.run import Trainer
from train.sft.data import SFTData
from train.sft.init import load_base

CHAT_PROMPTS = [
    ("bn", [{"role": "user", "content": "বাংলা ভাষা কী?"}]),
    ("bn", [{"role": "user", "content": "«সোনার তরী» কার লেখা?"}]),
    ("bn", [{"role": "user", "content": "এই লেখাটি চালিয়ে যাও।\n\nএকদিন সকালে"}]),
    ("en", [{"role": "user", "content": "Who wrote \"Oliver Twist\"?"}]),
    ("en", [{"role": "user", "content": "Continue this text.\n\nIt was a dark and stormy night"}]),
]


class SFTEvaluator(Evaluator):
    """Validation NLL on assistant tokens per language (the masked windows go through the same
    :func:`train.components.evaluation.evaluate`), greedy replies to :data:`CHAT_PROMPTS`; at the end the sampled and greedy
    replies and the base model's figures (the step-0 evaluation: the pretrained weights with the template)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts = [(lang, render(msgs, add_generation_prompt=True)) for lang, msgs in CHAT_PROMPTS]
        self.stop_ids = (self.data.eot_id, self.data.tokenizer.token_to_id(IM_END))
        self.random_init_twin = False  # the reference is the base model (step 0), not a random twin

    def final(self, model, cfg: Config, state) -> dict | None:
        if not self.placement.dist.is_main:
            return None
        t0 = time.time()
        evals = {r.get("step"): r["val"] for r in self.run_log.metrics() if r.get("kind") == "eval" and "val" in r}
        base, tuned = evals.get(0), evals.get(state.step)
        samples = user_samples(model, self.data.tokenizer, self.data.eot_id, SAMPLING, seed=cfg.run.seed,
                               max_new_tokens=128, prompts=self.prompts, stop_ids=self.stop_ids)
        self.run_log.append_samples(state.step, [{"kind": "final", **s} for s in samples])
        if base and tuned:
            self.run_log.log("assistant-token validation NLL, base model with the template → fine-tuned: " + ", ".join(
                f"{k} {v['nll']:.3f} → {tuned[k]['nll']:.3f}" for k, v in base.items() if k in tuned))
        for s in samples:
            q = s["prompt"].split("\n", 1)[1].split("<|im_end|>")[0]
            self.run_log.log(f"  [{s['lang']}, sampled] {q!r} → {s['sampled']!r}")
            self.run_log.log(f"  [{s['lang']}, greedy]  {q!r} → {s['greedy']!r}")
        self.run_log.log(f"final evaluation: {time.time() - t0:.1f} s")
        return {"samples": samples, "base_val": base, "sft": self.data.summary(state.tokens)}


class SFTTrainer(Trainer):
    """``SFTTrainer(cfg, base=CHECKPOINT, …).train()``: fine-tune the pretrained checkpoint ``base`` on
    ``cfg.data.paths``' conversations (see the module doc). ``--resume`` continues the fine-tuning run itself."""

    def __init__(self, cfg: Config, *, base: Path, **kwargs):
        super().__init__(cfg, **kwargs)
        self.base = base

    def load_data(self) -> SFTData:
        t = self.cfg.train
        return SFTData.load(self.cfg, self.base, t.micro_batch_size * t.grad_accum, self.log,
                            fixed_length=t.compile in (True, "auto"))  # compiled layers want static shapes

    def _find_init_source(self) -> dict | None:
        return checkpoint_identity(self.base)

    def init_weights(self) -> None:
        if self.resume:  # the run's own checkpoint is loaded next; the base only fixes the shapes
            return
        load_base(self.model, self.base, self.log)
        self.state.at_init = False
        self.log(f"fine-tuning from {self.base} (fresh optimizer, step 0)")

    def make_evaluator(self) -> SFTEvaluator:
        return SFTEvaluator(self.data, self.placement, self.cfg.train.micro_batch_size, self.run_log,
                            self.cfg.run.name)

    def preflight_batches(self) -> tuple[np.ndarray, np.ndarray]:
        """The two shortest conversations of the first micro-batch (cut to the longer of them) and the micro-batch:
        every check then sees the masked loss, with targets in both small rows."""
        t, p = self.cfg.train, self.placement
        windows = self.data.loader.peek_windows(max(t.micro_batch_size, 2))
        real = [int(np.max(np.nonzero(W.token_ids(w) != self.data.pad_id)[0])) + 1 for w in windows]
        two = np.argsort(real, kind="stable")[:2]
        n_big = 1 if p.device.type == "cuda" else p.micro
        return windows[two, :max(real[i] for i in two)].copy(), windows[:n_big].copy()
