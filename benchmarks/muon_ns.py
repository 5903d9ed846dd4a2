"""Muon's Newton–Schulz iteration in bfloat16 (torch's) against float32, in a CPU training step of the ``cpu``
preset, interleaved in one process: what :func:`train.optim.newton_schulz_dtype` gains on a CPU without native
bfloat16, where bfloat16 matmuls are emulated (and what float32 would cost on one with it).

Two lanes, each with its own copy of the same model and of the default optimizer (:class:`train.optim.MuonAdamW`),
one full step each (forward, backward, optimizer step) on the same random batch, float32 throughout but the
iteration: ``ns-bfloat16`` and ``ns-float32``. Each round runs both lanes, in a rotated order; reported per lane
the fastest and the median step and optimizer step (wall), and float32's speed over bfloat16's (median of per-round
ratios of step times).

    python benchmarks/muon_ns.py [--config cpu] [--threads 2] [--rounds 5]

Writes benchmarks/results/muon_ns.md and .json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import timing, train_step  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from train.device import native_cpu_bf16  # noqa: E402
from train.model import CausalLMLoss, LlamaForCausalLM  # noqa: E402
from train.optim import build_optimizer_for, newton_schulz_dtype  # noqa: E402
from train.run import model_config_for  # noqa: E402

LANES = {"ns-bfloat16": torch.bfloat16, "ns-float32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    train_step.add_args(p, threads=2)
    a = p.parse_args(argv)
    cfg, x = train_step.setup(a)
    lanes = {}
    for name, dtype in LANES.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(model_config_for(cfg, a.vocab))
        opt = build_optimizer_for(model, cfg.train, "cpu")
        opt.muon.ns_dtype = dtype
        lanes[name] = (CausalLMLoss(model), opt)

    def step(name: str) -> tuple[float, float]:
        loss_fn, opt = lanes[name]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(x[:, :-1], x[:, 1:]).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    names = list(LANES)
    runs, (load0, load1) = train_step.interleave(step, names, a.rounds)
    res = {"config": a.config, "rows": a.rows, "threads": a.threads, "rounds": a.rounds, "cpu": timing.cpu_name(),
           "simd": torch.backends.cpu.get_cpu_capability(),
           "native_bf16": native_cpu_bf16(), "default": str(newton_schulz_dtype("cpu")).removeprefix("torch."),
           "commit": timing.git_commit(), "torch": torch.__version__, "loadavg": [load0, load1], "lanes": {}}
    for n in names:
        steps, opts = [s for s, _ in runs[n]], [o for _, o in runs[n]]
        res["lanes"][n] = {"step_min_s": min(steps), "step_median_s": timing.median(steps),
                           "optimizer_min_s": min(opts), "optimizer_median_s": timing.median(opts)}
    speed = timing.median_ratio([s for s, _ in runs["ns-bfloat16"]], [s for s, _ in runs["ns-float32"]])
    res["float32_speed_over_bfloat16"] = speed
    lines = [f"# Muon's Newton–Schulz dtype ({a.config}, {a.rows} × {cfg.train.seq_len} tokens a step, "
             f"{a.threads} thread(s))", "",
             f"`python benchmarks/muon_ns.py --config {a.config} --rows {a.rows} --threads {a.threads} --rounds "
             f"{a.rounds}` on {res['cpu']} ({res['simd']}; native bfloat16: {res['native_bf16'] or 'none'}; the default here: "
             f"{res['default']}), torch {torch.__version__}; load average {load0:.1f} → {load1:.1f}. One full "
             "step a lane a round, rotated order.", "",
             "| lane | step best s | step median s | optimizer best s | optimizer median s |", "|---|---:|---:|---:|---:|"]
    for n, v in res["lanes"].items():
        lines.append(f"| {n} | {v['step_min_s']:.3f} | {v['step_median_s']:.3f} | {v['optimizer_min_s']:.3f} | "
                     f"{v['optimizer_median_s']:.3f} |")
    lines += ["", f"Step speed of float32's iteration over bfloat16's (median of per-round ratios): **{speed:.2f}×**."]
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "muon_ns.json", res)
    atomic_write_text(a.out / "muon_ns.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
