"""The compute-optimal default for the README's main job: candidate shapes (width, depth, vocabulary) trained with
the winning recipe for the **same wall-clock budget** of this machine, compared on validation bits per character per
source file beside the compressor floor (PPMd-16, xz).

Two phases:

1. **Calibrate**: each candidate trains ``--calib-steps`` steps alone on both cores (as the main job runs), one after
   another; the median step time of the steps after the first logging window gives its step count for the budget,
   ``steps = budget_s / step_s``.
2. **Train**: each candidate runs its step count to the end (evaluations on the way, the final report of
   ``train.run``: whole validation split per source file, sampled continuations), two at a time side by side on one
   thread each (a fixed step count, so the load the pair shares does not move the comparison).

Every candidate keeps the main job's tokens per step (``micro_batch_size × seq_len`` of ``--base``) and its
context length, and the recipe's learning rate (``--lr``; the best of ``benchmarks/recipe.py``'s grid). Writes
``benchmarks/results/presets.{md,json,png}``.

    python benchmarks/presets.py [--budget-min 18] [--lr 0.02] [--only NAME ...] [--resume]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.recipe import SPLIT, recipe_sets, save_figure, side_by_side, train_run  # noqa: E402
from benchmarks.timing import cpu_name, loadavg  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from train import compression  # noqa: E402
from train.config import load_config  # noqa: E402
from train.data import prepare  # noqa: E402

RECIPE = "muon-linear"


def _shape(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> list[str]:
    return [f"model.hidden_size={hidden}", f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}",
            f"model.num_key_value_heads={kv}", f"model.intermediate_size={inter}", f"tokenizer.vocab_size={vocab}"]


# name → --set overrides on --base. Widths and intermediate sizes stay multiples of 128 (the Rust runtime's int
# kernels and candle's q8_0 want 32-blocks; 256 is candle's fast path for the widest).
CANDIDATES: dict[str, list[str]] = {
    "d512-l6-v32k": _shape(512, 6, 8, 4, 1280, 32000),   # configs/small.toml: the main job before this search
    "d384-l6-v16k": _shape(384, 6, 6, 2, 1024, 16000),
    "d256-l6-v16k": _shape(256, 6, 4, 2, 768, 16000),
    "d256-l4-v8k": _shape(256, 4, 4, 2, 768, 8000),
    "d128-l4-v32k": _shape(128, 4, 4, 2, 384, 32000),    # configs/tiny.toml's shape
    # the first search's winner was its smallest (d256-l4-v8k): these two bracket it, shallower and narrower
    "d256-l2-v8k": _shape(256, 2, 4, 2, 768, 8000),
    "d128-l4-v8k": _shape(128, 4, 2, 1, 384, 8000),
}


def _run_child(args) -> dict:
    """The body of a child process: calibrate (``--calib``) or train one candidate; returns its result."""
    import torch  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    sets = CANDIDATES[args.child] + recipe_sets(RECIPE, args.lr)
    if args.calib:
        r = train_run(args.base, sets + ["train.log_every=2", "train.final_eval=false"], args.seed, args.steps,
                      eval_every=10 ** 9)
        return {"name": args.child, "tokens_per_s": r["tokens_per_s"]}
    r = train_run(args.base, sets, args.seed, args.steps, eval_every=max(args.steps // 4, 1))
    return {"name": args.child, "steps": args.steps, **r}


def _child_cmd(args, name: str, steps: int, calib: bool) -> list[str]:
    cmd = [str(Path(__file__).resolve()), "--child", name, "--base", args.base, "--lr", str(args.lr), "--seed",
           str(args.seed), "--steps", str(steps)]
    return cmd + (["--calib", "--threads", "2"] if calib else [])


def params(name: str, base: str) -> dict:
    """Parameter counts of a candidate (all, and without the token embedding), from the model built on the meta
    device (no memory, no init cost): :meth:`train.model.LlamaForCausalLM.num_params`."""
    import torch  # noqa: PLC0415

    from train.model import LlamaForCausalLM, ModelConfig  # noqa: PLC0415

    cfg = load_config(base, CANDIDATES[name])
    with torch.device("meta"):
        m = LlamaForCausalLM(ModelConfig(vocab_size=cfg.tokenizer.vocab_size, **dataclasses.asdict(cfg.model)))
    return {"params": m.num_params(), "non_embedding": m.num_params(non_embedding=True),
            "vocab": cfg.tokenizer.vocab_size}


def report(res: dict) -> str:
    floor = res["floor"]["sources"]
    srcs = list(floor)
    only = "" if set(res["runs"]) == set(CANDIDATES) else f" --only {' '.join(res['runs'])}"
    lines = [f"# The main job's shape at a fixed wall-clock budget ({res['budget_min']:g} min of training steps)", "",
             f"`python benchmarks/presets.py --budget-min {res['budget_min']:g} --lr {res['lr']:g}{only}` "
             f"(recipe {RECIPE}, lr {res['lr']:g}, tokens/step {res['tokens_per_step']:,}, base `{res['base']}`; "
             f"step times calibrated alone on 2 threads of {res.get('cpu', 'an unnamed CPU')} at load average "
             f"{res['calib_load']:.1f}; validation split: {res.get('split', 'hash of the text')}; measured "
             f"{res['date']}).", "",
             "| candidate | params | non-embedding | vocab | step (s) | steps | tokens | "
             + " | ".join(f"{s} bpc" for s in srcs) + " | distinct words (sampled) |",
             "|---|---|---|---|---|---|---|" + "---|" * len(srcs) + "---|"]
    for name, r in res["runs"].items():
        p, c = res["params"][name], res["calib"][name]
        cells = " | ".join(f"{r['final_bpc'].get(s, float('nan')):.3f}" for s in srcs)
        d = f"{r['distinct_sampled']:.2f}" if r.get("distinct_sampled") is not None else "–"
        mark = " **winner**" if name == res["winner"] else ""
        lines.append(f"| {name}{mark} | {p['params'] / 1e6:.1f} M | {p['non_embedding'] / 1e6:.2f} M | {p['vocab']:,} | "
                     f"{c['step_s']:.2f} | {r['steps']} | {r['steps'] * res['tokens_per_step']:,} | {cells} | {d} |")
    lines.append("| PPMd-16 (floor) | | | | | | | " + " | ".join(f"{floor[s]['ppmd16']:.3f}" for s in srcs) + " | |")
    lines.append("| xz -9e | | | | | | | " + " | ".join(f"{floor[s]['xz']:.3f}" for s in srcs) + " | |")
    lines += ["", "The winner has the lowest mean bits/char over the Bangla source files. "
              "![validation NLL against training seconds](presets.png)", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in res["runs"].items():
        step_s = res["calib"][name]["step_s"]
        xs = [e["step"] * step_s / 60 for e in r["evals"]]
        ys = [e["val"]["bn"]["bpc"] for e in r["evals"]]
        ax.plot(xs, ys, marker="o", label=name)
    bn = res["floor"]["languages"]["bn"]["ppmd16"]
    ax.axhline(bn, color="k", ls=":", label=f"PPMd-16 bn {bn:.2f}")
    save_figure(fig, ax, path, "training minutes on 2 quiet-equivalent cores (calibrated step time × steps)",
                "validation bits/char, Bangla", f"candidates at a {res['budget_min']:g}-minute budget ({RECIPE})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="small", help="the preset whose data, batch and context every candidate keeps")
    p.add_argument("--budget-min", type=float, default=18.0, help="minutes of training steps per candidate")
    p.add_argument("--lr", type=float, default=2e-2, help=f"{RECIPE}'s learning rate (the best of recipe.py)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--calib-steps", type=int, default=12)
    p.add_argument("--only", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    p.add_argument("--resume", action="store_true", help="keep the finished phases of an interrupted search")
    p.add_argument("--calibrate-only", action="store_true",
                   help="stop after the calibration (run it on a quiet machine, then the rest with --resume)")
    p.add_argument("--child", choices=list(CANDIDATES), help=argparse.SUPPRESS)
    p.add_argument("--calib", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        atomic_write_json(Path(args.out), _run_child(args))
        return 0
    if args.budget_min <= 0 or args.lr <= 0 or args.calib_steps < 6:
        p.error("--budget-min and --lr: expected positive numbers; --calib-steps: at least 6")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "presets.partial.json"
    state = json.loads(partial.read_text()) if args.resume and partial.exists() else {"calib": {}, "runs": {}}
    base = load_config(args.base, [f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"])
    tokens_per_step = base.train.micro_batch_size * base.train.seq_len * base.train.grad_accum
    for name in args.only:  # every tokenizer and shard set once, here, so the children only read the cache
        prepare(load_config(args.base, CANDIDATES[name] + [f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"]))
    floor = compression.measure(base)
    state.setdefault("calib_load", (loadavg() or [float("nan")])[0])  # the load and CPU the calibration met (kept across --resume)
    state.setdefault("cpu", cpu_name())
    for name in args.only:
        if name in state["calib"]:
            continue
        (r,) = side_by_side([_child_cmd(args, name, args.calib_steps, calib=True)])
        state["calib"][name] = {"tokens_per_s": r["tokens_per_s"], "step_s": tokens_per_step / r["tokens_per_s"]}
        atomic_write_json(partial, state)
        print(f"calibrated {name}: {state['calib'][name]['step_s']:.2f} s/step", flush=True)
    if args.calibrate_only:
        print("calibrated; train with --resume")
        return 0
    steps = {n: max(int(args.budget_min * 60 / state["calib"][n]["step_s"]), 8) for n in args.only}
    todo = [n for n in args.only if n not in state["runs"]]
    t0 = time.time()
    for i in range(0, len(todo), 2):
        pair = todo[i:i + 2]
        for name, r in zip(pair, side_by_side([_child_cmd(args, n, steps[n], calib=False) for n in pair])):
            state["runs"][name] = r
            print(f"{name}: {steps[name]} steps, final bpc " + ", ".join(
                f"{k} {v:.3f}" for k, v in r["final_bpc"].items()) + f" ({r['wall_s'] / 60:.1f} min)", flush=True)
        atomic_write_json(partial, state)
        done = i + len(pair)
        print(f"[{done}/{len(todo)}] ETA {(time.time() - t0) / done * (len(todo) - done) / 60:.0f} min", flush=True)
    bn_srcs = [s for s, v in floor["sources"].items() if v["lang"] == "bn"]
    runs = {n: state["runs"][n] for n in args.only}
    winner = min(runs, key=lambda n: statistics.mean(runs[n]["final_bpc"][s] for s in bn_srcs))
    res = {"base": args.base, "budget_min": args.budget_min, "lr": args.lr, "seed": args.seed,
           "tokens_per_step": tokens_per_step, "calib_load": state["calib_load"], "cpu": state["cpu"],
           "split": SPLIT, "date": time.strftime("%Y-%m-%d"),
           "calib": {n: state["calib"][n] for n in args.only}, "runs": runs, "winner": winner,
           "params": {n: params(n, args.base) for n in args.only}, "floor": floor}
    atomic_write_json(out / "presets.json", res)
    plot(res, out / "presets.png")
    atomic_write_text(out / "presets.md", report(res))
    partial.unlink(missing_ok=True)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
