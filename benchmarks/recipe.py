"""The training recipe, old against new, on the same data and tokens: AdamW + cosine to lr/10 (the 2019 recipe)
against Muon on the hidden matrices + AdamW on the rest with a linear decay to zero (train/optim.py).

Every (recipe, learning rate) of the grid runs ``--preset`` for ``--steps`` steps on the first seed; the two recipes
at one learning rate run **side by side**, each in its own process on one thread (``OMP_NUM_THREADS=1``), so both
see the same machine load at every moment and the step-time ratio is a paired measurement; the best learning rate
of each recipe is then confirmed on every other seed the same way. Reports validation bits/char per
language at each evaluation, the best learning rate of each recipe (lowest mean final validation NLL over the
seeds), the **tokens-to-target ratio** (tokens the old recipe's best needs for its final validation NLL ÷ tokens
the new recipe's best needs for the same NLL, interpolated between evaluations, per seed) and the step-time ratio.
Writes ``benchmarks/results/recipe-<preset>.{md,json,png}``.

    python benchmarks/recipe.py [--preset tiny] [--steps 200] [--lrs 1e-3 3e-3 1e-2 2e-2 4e-2] [--seeds 1337 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from train import compression  # noqa: E402
from train.config import load_config  # noqa: E402
from train.data import prepare  # noqa: E402
from train.run import Trainer  # noqa: E402

SPLIT = "whole works"  # how train.data picks the validation documents (a report says which split it measured)
RECIPES = {
    "adamw-cosine": {"train.optimizer": '"adamw"', "train.schedule": '"cosine"', "min_lr_frac": 0.1},
    "muon-linear": {"train.optimizer": '"muon"', "train.schedule": '"linear"', "min_lr_frac": 0.0},
}


def train_run(preset: str, sets: list[str], seed: int, steps: int, eval_every: int) -> dict:
    """One ``train.run`` of ``preset`` with ``--set`` overrides ``sets`` for ``steps`` steps, in a temporary folder
    (no checkpoints kept, preflight off): its evaluation rows (step, tokens, val per language), wall seconds, median
    tokens/s after the first logging window, the final per-source bits/char and the distinct-word share of its
    sampled continuations. Raises SystemExit when the run stops early (a signal)."""
    out_dir = Path(tempfile.mkdtemp(prefix="recipe-"))
    try:
        sets = list(sets) + [
            f"train.max_steps={steps}", f"train.eval_every={eval_every}", "train.ckpt_every=100000",
            "train.preflight=false", f"run.seed={seed}", f"run.out_dir={json.dumps(str(out_dir))}",
            f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"]
        cfg = load_config(preset, sets)
        prepare(cfg, log=lambda m: None)
        t0 = time.time()
        trainer = Trainer(cfg, log=lambda m: None)
        trainer.train()
        wall = time.time() - t0
        if trainer.step != steps:  # stopped by a signal: a partial run must not enter the comparison
            raise SystemExit(f"benchmarks: the run {' '.join(sets[:4])} stopped at step {trainer.step} of {steps}")
        rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((trainer.run_dir / "summary.json").read_text())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    evals = [{"step": r["step"], "tokens": r["tokens"], "val": r["val"]} for r in rows if r["kind"] == "eval"]
    tps = [r["tokens_per_s"] for r in rows if r["kind"] == "train"][1:]  # the first window holds the warm-up
    shares = [x["distinct_sampled"] for x in summary.get("samples", []) if x.get("distinct_sampled") is not None]
    return {"evals": evals, "wall_s": wall, "tokens_per_s": statistics.median(tps) if tps else None,
            "final_bpc": {k: v["bpc"] for k, v in (summary.get("val_sources") or {}).items()},
            "distinct_sampled": statistics.mean(shares) if shares else None}


def recipe_sets(recipe: str, lr: float) -> list[str]:
    """The ``--set`` overrides of ``recipe`` at learning rate ``lr`` (min_lr follows the recipe's fraction)."""
    spec = dict(RECIPES[recipe])
    frac = spec.pop("min_lr_frac")
    return [f"{k}={v}" for k, v in spec.items()] + [f"train.lr={lr}", f"train.min_lr={lr * frac}"]


def run_once(preset: str, recipe: str, lr: float, seed: int, steps: int, eval_every: int) -> dict:
    """:func:`train_run` of ``recipe`` at ``lr``, labelled."""
    return {"recipe": recipe, "lr": lr, "seed": seed,
            **train_run(preset, recipe_sets(recipe, lr), seed, steps, eval_every)}


def side_by_side(children: list[list[str]]) -> list[dict]:
    """Run each child command (``python SCRIPT ARGS... --out FILE``, which writes its result as JSON to FILE) at
    once, each on one thread (``OMP_NUM_THREADS=1``), so that all see the same machine load at every moment; their
    results in order. Raises SystemExit naming a child that failed."""
    procs = []
    with tempfile.TemporaryDirectory(prefix="bench-pair-") as tmp:
        for i, cmd in enumerate(children):
            out = Path(tmp) / f"{i}.json"
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            procs.append((out, subprocess.Popen([sys.executable, *cmd, "--out", str(out)], env=env,
                                                stdout=subprocess.DEVNULL)))
        for _, proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"benchmarks: a child run failed (exit {proc.returncode}): {' '.join(proc.args)}")
        return [json.loads(out.read_text()) for out, _ in procs]


def run_side_by_side(preset: str, jobs: list[tuple[str, float]], seed: int, steps: int, eval_every: int) -> list[dict]:
    """:func:`run_once` of every (recipe, learning rate) of ``jobs`` at once (:func:`side_by_side`)."""
    me = str(Path(__file__).resolve())
    return side_by_side([[me, "--one", rec, "--preset", preset, "--steps", str(steps), "--eval-every",
                          str(eval_every), "--lrs", str(lr), "--seeds", str(seed)] for rec, lr in jobs])


def tokens_to_reach(evals: list[dict], target: float) -> float | None:
    """Tokens at which the validation NLL (all languages) first reaches ``target``, linearly interpolated between
    evaluations; None if it never does."""
    prev = None
    for e in evals:
        nll = e["val"]["all"]["nll"]
        if nll <= target:
            if prev is None:
                return float(e["tokens"])
            (t0, n0), (t1, n1) = prev, (e["tokens"], nll)
            return t0 + (t1 - t0) * (n0 - target) / max(n0 - n1, 1e-12)
        prev = (e["tokens"], nll)
    return None


def best_lrs(runs: list[dict], seed: int) -> dict[str, float]:
    """Per recipe, the learning rate with the lowest final validation NLL on ``seed`` (the grid's seed)."""
    return {rec: min((r for r in runs if r["recipe"] == rec and r["seed"] == seed),
                     key=lambda r: r["evals"][-1]["val"]["all"]["nll"])["lr"] for rec in RECIPES}


def paired_step_time_ratio(runs: list[dict], seed: int) -> float:
    """New ÷ old step time (old tokens/s ÷ new tokens/s) from runs that ran side by side on ``seed``: the one pair
    when the seed has one run of each recipe (a confirmation), else the median over the grid's pairs (same lr)."""
    old, new = list(RECIPES)
    mine = [r for r in runs if r["seed"] == seed]
    by = {(r["recipe"], r["lr"]): r for r in mine}
    if sum(r["recipe"] == old for r in mine) == 1 and sum(r["recipe"] == new for r in mine) == 1:
        ro, rn = (next(r for r in mine if r["recipe"] == k) for k in (old, new))
        return ro["tokens_per_s"] / rn["tokens_per_s"]
    return statistics.median(by[old, lr]["tokens_per_s"] / by[new, lr]["tokens_per_s"]
                             for (rec, lr) in by if rec == old and (new, lr) in by)


def summarise(runs: list[dict], grid_seed: int) -> dict:
    """Best lr per recipe (on the grid's seed), per-seed tokens-to-target and step-time ratios (new ÷ old)."""
    final = {}
    for r in runs:
        final.setdefault((r["recipe"], r["lr"]), []).append(r["evals"][-1]["val"]["all"]["nll"])
    best = best_lrs(runs, grid_seed)
    old, new = list(RECIPES)
    per_seed = []
    for seed in dict.fromkeys([grid_seed] + [r["seed"] for r in runs]):  # the grid seed first, even after --resume
        ro = next(r for r in runs if r["recipe"] == old and r["lr"] == best[old] and r["seed"] == seed)
        rn = next(r for r in runs if r["recipe"] == new and r["lr"] == best[new] and r["seed"] == seed)
        target = ro["evals"][-1]["val"]["all"]["nll"]
        need_old, need_new = tokens_to_reach(ro["evals"], target), tokens_to_reach(rn["evals"], target)
        per_seed.append({"seed": seed, "target_nll": target, "tokens_old": need_old, "tokens_new": need_new,
                         "tokens_to_target": (need_old / need_new) if need_new else None,
                         "step_time_ratio": paired_step_time_ratio(runs, seed),
                         "final_old": ro["evals"][-1]["val"], "final_new": rn["evals"][-1]["val"]})
    return {"best_lr": best, "final_nll": {f"{k[0]}@{k[1]:g}": v for k, v in final.items()}, "per_seed": per_seed}


def report(res: dict, floor: dict | None) -> str:
    s = res["summary"]
    lines = [f"# Training recipe: {' vs '.join(RECIPES)} at `{res['preset']}`", "",
             f"`python benchmarks/recipe.py --preset {res['preset']} --steps {res['steps']} "
             + (f"--confirm {' '.join(f'{k}={v:g}' for k, v in s['best_lr'].items())}" if res.get("confirm") else
                f"--lrs {' '.join(f'{x:g}' for x in res['lrs'])}")
             + f" --seeds {' '.join(map(str, res['seeds']))}` "
             f"({res['steps']} steps each, interleaved; measured {res['date']}; validation split: "
             f"{res.get('split', 'not recorded')}).", "",
             ("## The learning rates given (`--confirm`), on every seed (final validation NLL, nats/token, all "
              "languages; mean over the seeds)" if res.get("confirm") else
              "## Learning-rate grid (final validation NLL, nats/token, all languages; seed " + str(res["seeds"][0])
              + "; the best also mean over every seed)"), "",
             "| recipe | " + " | ".join(f"lr {x:g}" for x in res["lrs"]) + " |",
             "|---|" + "---|" * len(res["lrs"])]
    for rec in RECIPES:
        cells = []
        for lr in res["lrs"]:
            v = s["final_nll"].get(f"{rec}@{lr:g}")
            mark = " **best**" if lr == s["best_lr"][rec] else ""
            cells.append(f"{statistics.mean(v):.3f}{mark}" if v else "–")
        lines.append(f"| {rec} | " + " | ".join(cells) + " |")
    lines += ["", "## Best of each, per seed", "",
              "| seed | target NLL | tokens old | tokens new | tokens-to-target | step-time ratio (paired) | "
              + " | ".join(f"{k} bpc old → new" for k in s["per_seed"][0]["final_old"] if k != "all") + " |",
              "|---|---|---|---|---|---|" + "---|" * (len(s["per_seed"][0]["final_old"]) - 1)]
    for p in s["per_seed"]:
        ttt = f"{p['tokens_to_target']:.2f}×" if p["tokens_to_target"] else "not reached"
        new_tok = f"{p['tokens_new']:,.0f}" if p["tokens_new"] else "–"
        langs = " | ".join(f"{p['final_old'][k]['bpc']:.3f} → {p['final_new'][k]['bpc']:.3f}"
                           for k in p["final_old"] if k != "all")
        lines.append(f"| {p['seed']} | {p['target_nll']:.3f} | {p['tokens_old']:,.0f} | {new_tok} | {ttt} | "
                     f"{p['step_time_ratio']:.3f} | {langs} |")
    if floor:
        srcs = list(floor["sources"])
        best = s["best_lr"]
        lines += ["", "## Whole validation split per source file (bits/char), best of each recipe, beside the "
                  "compressor floor", "", "| run | " + " | ".join(srcs) + " | distinct words (sampled) |",
                  "|---|" + "---|" * len(srcs) + "---|"]
        for r in res["runs"]:
            if r["lr"] == best[r["recipe"]] and r.get("final_bpc"):
                d = f"{r['distinct_sampled']:.2f}" if r.get("distinct_sampled") is not None else "–"
                lines.append(f"| {r['recipe']} lr {r['lr']:g} seed {r['seed']} | "
                             + " | ".join(f"{r['final_bpc'].get(k, float('nan')):.3f}" for k in srcs) + f" | {d} |")
        for c, label in (("ppmd16", "PPMd-16"), ("xz", "xz -9e")):
            lines.append(f"| {label} (primed with the training split) | "
                         + " | ".join(f"{floor['sources'][k][c]:.3f}" for k in srcs) + " | |")
    lines += ["", f"![validation NLL against tokens](recipe-{res['preset']}.png)", ""]
    return "\n".join(lines)


def write_summary(out: Path) -> None:
    """``recipe.md``: one row per preset measured (``recipe-<preset>.json``) — best learning rates, per-seed
    tokens-to-target and step-time ratios, final bits/char per language old → new — with links to each report."""
    lines = ["# Training recipe: AdamW + cosine to lr/10 against Muon + linear decay to zero", "",
             "Each preset's full report (learning-rate grid, per-seed table, loss curves) is linked in the first "
             "column; `python benchmarks/recipe.py --help` says how each is made. The validation split column says "
             f"which documents were scored: `{SPLIT}` (train.data's split, no part of a validation work trained on) "
             "or the old split (documents chosen by a hash of their text, parts of works shared with training).", "",
             "| preset | validation split | steps | best lr (old / new) | seeds | tokens-to-target (per seed) | "
             "step-time ratio new ÷ old (per seed) | val bits/char old → new (per seed) |",
             "|---|---|---|---|---|---|---|---|"]
    order = {"tiny": 0, "small": 1}
    done = [json.loads(q.read_text()) | {"page": q.stem} for q in out.glob("recipe-*.json")
            if not q.name.endswith(".partial.json")]
    for res in sorted(done, key=lambda r: (order.get(r["preset"], 9), r.get("split") != SPLIT, r["page"])):
        s, (old, new) = res["summary"], list(RECIPES)
        ttt = ", ".join(f"{p['tokens_to_target']:.2f}×" if p["tokens_to_target"] else "not reached"
                        for p in s["per_seed"])
        st = ", ".join(f"{p['step_time_ratio']:.3f}" for p in s["per_seed"])
        bpc = "; ".join(", ".join(f"{k} {p['final_old'][k]['bpc']:.3f} → {p['final_new'][k]['bpc']:.3f}"
                                  for k in p["final_old"] if k != "all") for p in s["per_seed"])
        lines.append(f"| [{res['preset']}]({res['page']}.md) | {res.get('split', 'not recorded')} | {res['steps']} | "
                     f"{s['best_lr'][old]:g} / "
                     f"{s['best_lr'][new]:g} | {', '.join(map(str, res['seeds']))} | {ttt} | {st} | {bpc} |")
    lines += ["", "Tokens-to-target: the tokens the old recipe's best run needs for its own final validation NLL ÷ "
              "the tokens the new recipe's best run needs for the same NLL (interpolated between evaluations). "
              "Step-time ratio: median tokens/s of the old run ÷ the new one's, the two side by side on one "
              "thread each.", ""]
    atomic_write_text(out / "recipe.md", "\n".join(lines))


def plot(res: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    best = res["summary"]["best_lr"]
    for r in res["runs"]:
        if r["lr"] != best[r["recipe"]]:
            continue
        xs = [e["tokens"] for e in r["evals"]]
        ys = [e["val"]["all"]["nll"] for e in r["evals"]]
        ax.plot(xs, ys, marker="o", ls="-" if r["recipe"] == "muon-linear" else "--",
                label=f"{r['recipe']} lr {r['lr']:g} seed {r['seed']}")
    save_figure(fig, ax, path, "training tokens", "validation NLL (nats/token)",
                f"{res['preset']}: best learning rate of each recipe")


def save_figure(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label, grid and legend ``ax``, then write ``fig`` to ``path`` atomically (a temporary file renamed) and close
    it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _recipe_lr(text: str) -> tuple[str, float]:
    """``"muon-linear=0.02"`` → ``("muon-linear", 0.02)``; argparse turns the ValueError into a one-line error."""
    rec, _, lr = text.partition("=")
    if rec not in RECIPES or not lr:
        raise argparse.ArgumentTypeError(f"expected RECIPE=LR with RECIPE one of {', '.join(RECIPES)}, got {text!r}")
    if not float(lr) > 0:
        raise argparse.ArgumentTypeError(f"expected a positive learning rate, got {text!r}")
    return rec, float(lr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 2e-2, 4e-2])
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 7],
                   help="the grid runs on the first; the best lr of each recipe is confirmed on the others")
    p.add_argument("--confirm", nargs=len(RECIPES), metavar="RECIPE=LR", type=_recipe_lr, default=None,
                   help="skip the grid: run each recipe at this learning rate on every seed (e.g. the best of tiny's "
                        "grid, confirmed at small)")
    p.add_argument("--resume", action="store_true", help="keep the finished runs of an interrupted grid")
    p.add_argument("--pairs", type=int, default=None,
                   help="stop after this many new side-by-side pairs (run a long grid in pieces with --resume)")
    p.add_argument("--report", action="store_true",
                   help="only render recipe-PRESET.{md,png} and recipe.md again from recipe-PRESET.json")
    p.add_argument("--one", choices=list(RECIPES), help=argparse.SUPPRESS)  # a child of run_side_by_side
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.confirm is not None:
        args.confirm = dict(args.confirm)
        if set(args.confirm) != set(RECIPES):
            p.error(f"--confirm: expected one RECIPE=LR for each of {', '.join(RECIPES)}")
    if args.one:
        import torch  # noqa: PLC0415

        torch.set_num_threads(1)
        atomic_write_json(Path(args.out), run_once(args.preset, args.one, args.lrs[0], args.seeds[0], args.steps,
                                                   args.eval_every))
        return 0
    if len(args.lrs) < 1 or any(lr <= 0 for lr in args.lrs):
        p.error("--lrs: expected positive learning rates")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        res = json.loads((out / f"recipe-{args.preset}.json").read_text())
        res["summary"] = summarise(res["runs"], res["seeds"][0])
        write_report(res, out)
        return 0
    partial = out / f"recipe-{args.preset}.partial.json"  # every finished run, so an interrupted grid resumes
    runs = json.loads(partial.read_text())["runs"] if args.resume and partial.exists() else []
    done = {(r["seed"], r["lr"], r["recipe"]) for r in runs}
    # tokenizer, shards and the compressor floor once, here, so the side-by-side children only read the cache
    base_cfg = load_config(args.preset, [f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}"])
    prepare(base_cfg)
    floor = compression.measure(base_cfg)
    t0, n_new = time.time(), 0

    def run(pairs: list[tuple[int, list[tuple[str, float]]]]) -> None:
        """Each (seed, [(recipe, lr), ...]) side by side, skipping the runs already done."""
        nonlocal n_new
        pairs = [(seed, todo) for seed, jobs in pairs if (todo := [j for j in jobs if (seed, j[1], j[0]) not in done])]
        for i, (seed, jobs) in enumerate(pairs):
            if args.pairs is not None and n_new >= args.pairs:
                raise SystemExit(f"recipe: stopped after {n_new} new pair(s) (--pairs); continue with --resume")
            for r in run_side_by_side(args.preset, jobs, seed, args.steps, args.eval_every):
                runs.append(r)
                done.add((seed, r["lr"], r["recipe"]))
            atomic_write_json(partial, {"preset": args.preset, "steps": args.steps, "runs": runs})
            n_new += 1
            eta = (time.time() - t0) / n_new * (len(pairs) - i - 1) / 60
            print(f"[{i + 1}/{len(pairs)}] seed {seed}: " + ", ".join(
                f"{r['recipe']} lr {r['lr']:g} val NLL {r['evals'][-1]['val']['all']['nll']:.3f} ({r['wall_s']:.0f} s)"
                for r in runs[-len(jobs):]) + f"; ETA of this phase {eta:.0f} min", flush=True)

    if args.confirm:  # no grid: the given learning rates (the best of a smaller preset's grid) on every seed
        best = args.confirm
        lrs = sorted(set(best.values()))
    else:  # the grid on the first seed, then the best learning rate of each recipe on every other seed
        lrs = args.lrs
        run([(args.seeds[0], [(rec, lr) for rec in RECIPES]) for lr in lrs])
        best = best_lrs(runs, args.seeds[0])
    run([(seed, [(rec, best[rec]) for rec in RECIPES]) for seed in args.seeds[0 if args.confirm else 1:]])
    res = {"preset": args.preset, "split": SPLIT, "steps": args.steps, "lrs": lrs, "seeds": args.seeds,
           "confirm": bool(args.confirm),
           "date": time.strftime("%Y-%m-%d"), "runs": runs, "floor": floor}
    res["summary"] = summarise(runs, args.seeds[0])
    write_report(res, out)
    partial.unlink(missing_ok=True)
    print(report(res, floor))
    return 0


def write_report(res: dict, out: Path) -> None:
    """``recipe-<preset>.{json,png,md}`` of one measured preset and the summary ``recipe.md`` of all."""
    atomic_write_json(out / f"recipe-{res['preset']}.json", res)
    plot(res, out / f"recipe-{res['preset']}.png")
    atomic_write_text(out / f"recipe-{res['preset']}.md", report(res, res.get("floor")))
    write_summary(out)


if __name__ == "__main__":
    sys.exit(main())
