"""A CPU training step in float32 against bfloat16 autocast, interleaved in one process: what ``train.dtype =
"auto"`` gains on a CPU with native bfloat16, and what the head + loss path costs.

Lanes, each one full step of the run's step module (:class:`train.model.CausalLMLoss`; forward, backward, clip,
the default optimizer) on the same weights and the same random batch:

* ``float32``: what ``auto`` ran on every CPU before;
* ``bf16-chunked``: bfloat16 autocast with the head + loss in checkpointed chunks (the CUDA path, which the CPU
  ran before);
* ``bf16``: bfloat16 autocast with the whole logits (``chunk_tokens=None``, the CPU path in eager);
* ``float32-head``, ``bf16-head``: the same with the head + loss compiled (``train.compile = "head"``; the layers
  stay eager);
* ``float32-layers``: float32 with each decoder layer and the head + loss compiled and SDPA's attention (what
  ``auto`` runs on a CPU without native bfloat16);
* ``bf16-layers``: bfloat16 with each decoder layer and the head + loss compiled (``train.compile = "auto"``) and
  SDPA's attention (``train.attention = "sdpa"``);
* ``bf16-layers-blocked``: the same with :func:`train.model.blocked_causal_attention` (``train.attention =
  "auto"`` there: the ``cpu`` preset's path).

Compiled lanes are compiled before the warm-up, which is not timed.

Each round runs every lane once, in a rotated order. Reported per lane: the fastest and the median step in wall
time and in process CPU time, and each bfloat16 lane's speed over float32's (median of per-round ratios). With
``--threads 1`` the CPU time is the step's work even on a machine shared with other jobs (with more threads it
also counts threads spinning at barriers while a sibling waits for a core).

    python benchmarks/cpu_bf16.py [--config cpu] [--rows 8] [--threads 1] [--rounds 5]

Writes benchmarks/results/cpu_bf16.md and .json (``cpu_bf16_t2.*`` for ``--threads 2``, the main job's).
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
from train.device import autocast_ctx, native_cpu_bf16  # noqa: E402
from train.model import CausalLMLoss, LlamaForCausalLM  # noqa: E402
from train.optim import build_optimizer_for  # noqa: E402
from train.run import model_config_for  # noqa: E402

# lane: (autocast dtype, chunk_tokens, compiled: False | "head" | "layers", attention)
LANES = {"float32": (torch.float32, None, False, "sdpa"), "bf16-chunked": (torch.bfloat16, 8192, False, "sdpa"),
         "bf16": (torch.bfloat16, None, False, "sdpa"), "float32-head": (torch.float32, None, "head", "sdpa"),
         "bf16-head": (torch.bfloat16, None, "head", "sdpa"), "float32-layers": (torch.float32, None, "layers", "sdpa"),
         "bf16-layers": (torch.bfloat16, None, "layers", "sdpa"),
         "bf16-layers-blocked": (torch.bfloat16, None, "layers", "blocked")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    train_step.add_args(p, threads=1)
    p.add_argument("--lanes", nargs="+", choices=list(LANES), default=list(LANES),
                   help="lanes to time; float32, the reference, always runs (a CPU without native bfloat16 emulates "
                        "the bf16 lanes at several seconds a step)")
    a = p.parse_args(argv)
    names = [n for n in LANES if n == "float32" or n in a.lanes]
    cfg, x = train_step.setup(a)
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config_for(cfg, a.vocab))
    opt = build_optimizer_for(model, cfg.train, "cpu")
    cpu = torch.device("cpu")
    mods = {}
    for name in names:
        _, chunk, compiled, _ = LANES[name]
        mods[name] = CausalLMLoss(model, chunk_tokens=chunk)
        if compiled == "head":
            mods[name].compile_head()
        elif compiled == "layers":
            mods[name].compile_blocks(a.rows)

    def step(name: str) -> tuple[float, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        model.set_training_attention(LANES[name][3])  # the lanes share the model: each sets its own kernel
        opt.zero_grad(set_to_none=True)
        with autocast_ctx(cpu, LANES[name][0]):
            loss = mods[name](x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        return time.perf_counter() - w0, time.process_time() - c0

    runs, (load0, load1) = train_step.interleave(step, names, a.rounds)
    tokens = a.rows * cfg.train.seq_len
    res = {"config": a.config, "rows": a.rows, "tokens_a_step": tokens, "threads": a.threads, "rounds": a.rounds,
           "cpu": timing.cpu_name(), "commit": timing.git_commit(), "native_bf16": native_cpu_bf16(), "torch": torch.__version__,
           "loadavg": [load0, load1], "lanes": {}}
    for n in names:
        wall, cput = [w for w, _ in runs[n]], [c for _, c in runs[n]]
        res["lanes"][n] = {"wall_min_s": min(wall), "wall_median_s": timing.median(wall),
                           "cpu_min_s": min(cput), "cpu_median_s": timing.median(cput),
                           "tokens_per_s_wall_best": tokens / min(wall)}
        if n != "float32":
            for k, i in (("cpu", 1), ("wall", 0)):
                res["lanes"][n][f"speed_over_float32_{k}"] = timing.median_ratio(
                    [r[i] for r in runs["float32"]], [r[i] for r in runs[n]])
    lines = [f"# cpu_bf16 ({a.config}, {a.rows} × {cfg.train.seq_len} tokens a step, {a.threads} thread(s))", "",
             f"`python benchmarks/cpu_bf16.py --config {a.config} --rows {a.rows} --threads {a.threads} --rounds "
             f"{a.rounds}{'' if names == list(LANES) else ' --lanes ' + ' '.join(names[1:])}` on {res['cpu']} (native bfloat16: {res['native_bf16'] or 'none'}), torch {torch.__version__}; "
             f"load average {load0:.1f} → {load1:.1f} (other jobs ran beside). One full step a lane a round, "
             f"rotated order; speed = median of per-round ratios of step times.", "",
             "| lane | wall best s | wall median s | CPU best s | CPU median s | speed × float32 (CPU time) | "
             "speed × float32 (wall) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for n, v in res["lanes"].items():
        lines.append(f"| {n} | {v['wall_min_s']:.3f} | {v['wall_median_s']:.3f} | {v['cpu_min_s']:.3f} | "
                     f"{v['cpu_median_s']:.3f} | {v.get('speed_over_float32_cpu', 1.0):.2f} | "
                     f"{v.get('speed_over_float32_wall', 1.0):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "cpu_bf16" if a.threads == 1 else f"cpu_bf16_t{a.threads}"
    atomic_write_json(a.out / f"{stem}.json", res)
    atomic_write_text(a.out / f"{stem}.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
