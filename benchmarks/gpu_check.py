"""The device check's driver (run by ``benchmarks/gpu_check.sh``): a real ``train.run`` Trainer on one GPU, the
optimizer steps after the compile warm-up timed with CUDA events, the figures written to ``gpu_check.json``.

``python benchmarks/gpu_check.py --config base-400m --steps 55 --untimed 3 --out OUT [--set k=v ...]``

gpu_check.json: tokens_per_s and MFU over the timed steps (model FLOPs per token × tokens/s ÷ the GPU's dense bf16
peak), peak memory allocated since the first timed step (``torch.cuda.reset_peak_memory_stats``) and over the
whole training (summary.json), the compile path and recompiles, the SDPA backend, the planner's estimate, torch and
GPU names. The file is rewritten (atomically) every 10 timed steps (every step on CPU), so a run stopped at the time limit still leaves
its figures; ``complete`` says whether every step ran.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from contract.atomic import atomic_write_json
from train.config import add_config_args, config_from_args
from train.device import peak_memory_bytes, reset_peak_memory
from train.run import Trainer


class TimedTrainer(Trainer):
    """A Trainer whose optimizer steps after ``untimed`` warm-up steps are timed (CUDA events on a GPU)."""

    def __init__(self, cfg, out: Path, untimed: int, **kw):
        super().__init__(cfg, **kw)
        self.out, self.untimed = out, untimed
        self.n_timed, self.timed_tokens = 0, 0
        self.t0_event = self.end_event = None
        self.t0_wall = self.end_wall = None
        self._first_step = 0
        self.cuda = self.device.type == "cuda"

    def _train_step(self, train_model):
        if self.step - self._first_step == self.untimed:
            if self.cuda:
                torch.cuda.synchronize()
                self.t0_event = torch.cuda.Event(enable_timing=True)
                self.t0_event.record()
            reset_peak_memory(self.device)
            self.t0_wall = time.perf_counter()
        stats = super()._train_step(train_model)
        if self.t0_wall is not None:
            self._mark_end()
            self.n_timed += 1
            self.timed_tokens += stats.tokens
            if self.n_timed % 10 == 0 or not self.cuda:
                self.write(complete=False)
        return stats

    def train(self):
        summary = super().train()
        self.write(complete=True, summary=summary)
        return summary

    def _mark_end(self) -> None:
        """The end of the latest timed step (eval and the final checkpoint stay outside the timing)."""
        if self.cuda:
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.end_event.record()
        self.end_wall = time.perf_counter()

    def _elapsed(self) -> float:
        if self.n_timed == 0:
            return 0.0
        if self.cuda:
            self.end_event.synchronize()
            return self.t0_event.elapsed_time(self.end_event) / 1e3
        return self.end_wall - self.t0_wall

    def write(self, complete: bool, summary: dict | None = None) -> None:
        dt = self._elapsed()
        tps = self.timed_tokens / dt if dt > 0 and self.n_timed else None
        mfu = self.flops_per_token * tps / self.peak if (tps and self.peak) else None
        t = self.cfg.train
        out = {
            "complete": complete,
            "config": self.cfg.run.name,
            "device": str(self.device),
            "gpu": torch.cuda.get_device_name(self.device) if self.cuda else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": str(self.dtype).replace("torch.", ""),
            "micro_batch_size": self.micro,
            "grad_accum": self.accum,
            "seq_len": t.seq_len,
            "timed_steps": self.n_timed,
            "untimed_steps": self.untimed,
            "timer": "cuda events" if self.cuda else "perf_counter (CPU dry run)",
            "timed_s": dt,
            "tokens_per_s": tps,
            "mfu": mfu,
            "peak_flops": self.peak,
            "flops_per_token": self.flops_per_token,
            "peak_memory_gib_timed_steps": peak_memory_bytes(self.device) / 2**30 if self.n_timed else None,
            "peak_memory_gib_training": summary["peak_memory_gb"] * 1e9 / 2**30 if summary else None,
            "compile": vars(self.compile_info),
            "attention_backend": {"name": self.sdpa[0], "detail": self.sdpa[2]},
            "plan": self.plan.to_dict() if self.plan else None,
        }
        atomic_write_json(self.out / "gpu_check.json", out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--name", default="gpu-check")
    p.add_argument("--steps", type=int, default=55, help="optimizer steps in all (after the compile warm-up)")
    p.add_argument("--untimed", type=int, default=3, help="steps before timing starts")
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    p.add_argument("--preflight", action="store_true", help="run preflight first (not within the 6-minute budget)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    cfg.run.name = args.name
    cfg.train.max_steps = args.steps
    cfg.train.eval_every = cfg.train.ckpt_every = 10**9
    cfg.train.eval_tokens = min(cfg.train.eval_tokens, 2 * cfg.train.seq_len)
    args.out.mkdir(parents=True, exist_ok=True)
    tr = TimedTrainer(cfg, args.out, args.untimed, use_preflight=args.preflight)
    tr.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
