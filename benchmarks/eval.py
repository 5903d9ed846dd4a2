"""Shalik's next-sentence benchmark, scored directly through ``serve.load(BUNDLE).score``: accuracy with 95 %
Wilson score intervals for a bundle and for its random-init twin (same shape, untrained), beside chance (25 %).

The tasks are ``benchmarks/eval_tasks/{bn,en}_next_sentence.jsonl`` (``build.py`` there: four-way multiple
choice from the validation split). Each choice is scored exactly as lm-evaluation-harness scores a
``multiple_choice`` request through ``local-completions``, so the figures equal what ``lm_eval --model
local-completions --include_path benchmarks/eval_tasks`` reports against ``uvicorn serve.app:app`` (the test
``tests/test_clients_lm_eval.py`` checks it item by item):

* the request is (context, " " + choice): the target delimiter (one space) goes with the continuation;
* ``whole = tokenize(context + " " + choice)``, ``ctx = tokenize(context)``, ``cont = whole[len(ctx):]``;
* the prompt is ``(ctx + cont)[-(max_length - 1):]`` (``max_length`` = context length − 1, as the README
  recommends passing to lm-eval), which the model reads after ``<|endoftext|>``;
* log-likelihood = sum of the log-probs of the ``cont`` tokens; ``acc`` picks the highest (ties: the first),
  ``acc_norm`` the highest log-likelihood per character of the choice (delimiter not counted).

Beside the models, a no-model baseline picks the choice sharing the largest share of its words with the context
(``word_overlap``): it shows how much signal the context carries, i.e. what a model that reads the context could
use (a model near chance while this is well above it is not using the context).

The 95 % interval is Wilson's score interval for a binomial proportion (items are treated as independent; items
of one document share text, so the real uncertainty is somewhat larger).

Writes ``--out``.md and ``--out``.json (default ``benchmarks/results/eval``; results for other checkpoints already
in the JSON are kept when they were made on the same task files) and, unless ``--no-card``, refreshes the benchmark
section of each evaluated bundle's model card (``export.card.refresh_card``).

    python benchmarks/eval.py [BUNDLE] [--twin TWIN_BUNDLE] [--tasks bn_next_sentence en_next_sentence]
                              [--limit N] [--threads N] [--out benchmarks/results/eval] [--no-card]

BUNDLE defaults to ``runs/small/bundle``; the twin to ``runs/<name>-init/bundle`` when it exists (make one with
``python -m train.run --config small --name small-init --no-preflight --set train.max_steps=0 &&
python -m export.onnx runs/small-init``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TASK_DIR = ROOT / "benchmarks" / "eval_tasks"
TASKS = ("bn_next_sentence", "en_next_sentence")
CHANCE = 0.25
DELIMITER = " "
Z95 = 1.959963984540054


def read_items(path: str | Path) -> list[dict]:
    """The items of a task's JSON Lines file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def encode_pair(lm, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``TemplateLM._encode_pair`` for a causal model: trailing whitespace of the context moves to the
    continuation; the whole string is tokenized and the continuation is what follows the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = lm.tokenize(context + continuation)
    ctx = lm.tokenize(context)
    return ctx, whole[len(ctx):]


def continuation_loglikelihood(lm, ctx: Sequence[int], cont: Sequence[int], max_length: int | None = None) -> float:
    """Sum of the log-probs (nats) of ``cont`` after ``ctx`` (both token ids; ``<|endoftext|>`` comes first),
    left-truncated to ``max_length - 1`` tokens as lm-eval's API models do."""
    keep = (max_length or lm.context_length - 1) - 1
    ids = (list(ctx) + list(cont))[-keep:]
    nll = lm.score(ids).token_nll
    return -float(sum(nll[len(nll) - len(cont):]))


def score_item(lm, item: dict, max_length: int | None = None) -> dict:
    """One item's per-choice log-likelihoods, and the choices picked by acc and by acc_norm."""
    lls = [continuation_loglikelihood(lm, *encode_pair(lm, item["context"], DELIMITER + c), max_length)
           for c in item["choices"]]
    pred = max(range(len(lls)), key=lambda i: (lls[i], -i))
    norm = [ll / len(c) for ll, c in zip(lls, item["choices"])]
    pred_norm = max(range(len(norm)), key=lambda i: (norm[i], -i))
    return {"id": item.get("id"), "lls": lls, "pred": pred, "pred_norm": pred_norm, "gold": item["gold"]}


def word_overlap_pick(item: dict) -> int:
    """The choice with the largest share of its (case-folded) words also in the context; ties: the first."""
    context = set(re.findall(r"\w+", item["context"].casefold()))
    shares = []
    for choice in item["choices"]:
        words = set(re.findall(r"\w+", choice.casefold()))
        shares.append(len(context & words) / max(len(words), 1))
    return max(range(len(shares)), key=lambda i: (shares[i], -i))


def accuracy(picks: list[int], items: list[dict]) -> dict:
    """Share of items whose pick is the gold choice, with its Wilson interval."""
    k = sum(p == it["gold"] for p, it in zip(picks, items))
    return {"n": len(items), "acc": k / len(items) if items else float("nan"), "acc_ci": list(wilson(k, len(items))),
            "acc_correct": k}


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (95 % by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


def summarize(scored: list[dict]) -> dict:
    """acc and acc_norm with their Wilson intervals, and the per-item picks."""
    out = accuracy([s["pred"] for s in scored], scored)
    norm = accuracy([s["pred_norm"] for s in scored], scored)
    out.update({"acc_norm": norm["acc"], "acc_norm_ci": norm["acc_ci"], "acc_norm_correct": norm["acc_correct"]})
    out["pred"] = [s["pred"] for s in scored]
    out["pred_norm"] = [s["pred_norm"] for s in scored]
    return out


def evaluate_bundle(bundle: Path, tasks: dict[str, list[dict]], threads: int | None = None,
                    log=print) -> dict:
    """Score every task on one bundle; returns its eval.json entry (without ``twin``)."""
    from contract.bundle import read_manifest
    from serve import load

    manifest = read_manifest(bundle)
    lm = load(bundle, threads=threads)
    entry = {"name": bundle.resolve().parent.name, "bundle": _display(bundle), "params": manifest.get("params"),
             "source": {k: manifest.get("source", {}).get(k) for k in ("checkpoint", "step", "sha256")},
             "context_length": lm.context_length, "results": {}}
    for task, items in tasks.items():
        t0 = time.perf_counter()
        r = summarize([score_item(lm, it) for it in items])
        entry["results"][task] = r
        log(f"{entry['name']:>14} {task}: acc {r['acc']:.3f} ({r['acc_ci'][0]:.3f}–{r['acc_ci'][1]:.3f}), "
            f"acc_norm {r['acc_norm']:.3f} on {r['n']} items in {time.perf_counter() - t0:.0f} s")
    return entry


def _display(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def default_twin(bundle: Path) -> Path | None:
    """``runs/<name>-init/bundle`` beside ``runs/<name>/bundle``, when it exists."""
    twin = bundle.resolve().parent.parent / f"{bundle.resolve().parent.name}-init" / "bundle"
    return twin if twin.is_dir() else None


def merge_results(old: dict | None, new_models: list[dict], task_info: dict, baselines: dict) -> dict:
    """New entries replace old ones of the same checkpoint; old entries made on other task files are dropped."""
    kept = []
    if old and old.get("tasks") == task_info:
        shas = {m["source"]["sha256"] for m in new_models}
        kept = [m for m in old.get("models", []) if (m.get("source") or {}).get("sha256") not in shas]
    return {"benchmark": "Shalik next-sentence (benchmarks/eval_tasks)", "created": time.strftime("%Y-%m-%d"),
            "chance": CHANCE, "ci": "95 % Wilson score interval", "delimiter": DELIMITER,
            "scoring": "sum of continuation log-probs (acc) and per character of the choice (acc_norm), as "
                       "lm-evaluation-harness multiple_choice", "tasks": task_info, "baselines": baselines,
            "models": kept + new_models}


def render_markdown(results: dict) -> str:
    """eval.md: one row per (model, task)."""
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    cell = lambda r, k: f"{pct(r[k])} ({100 * r[k + '_ci'][0]:.1f}–{100 * r[k + '_ci'][1]:.1f})"  # noqa: E731
    lines = ["# Next-sentence benchmark", "",
             f"Four-way multiple choice from the validation split (`benchmarks/eval_tasks/`), scored through "
             f"`serve.load(BUNDLE).score` exactly as lm-evaluation-harness scores `multiple_choice`; chance "
             f"{pct(results['chance'])}. acc: summed log-likelihood of `\" \" + choice` after the context; acc_norm: "
             f"per character of the choice. Brackets: {results['ci']}. Made {results['created']} by "
             "`python benchmarks/eval.py`.", "",
             "| model | checkpoint step | task | items | acc | acc_norm | chance |", "|---|---:|---|---:|---:|---:|---:|"]
    for m in results["models"]:
        for task, r in m["results"].items():
            lines.append(f"| {m['name']} (`{m['bundle']}`) | {m['source'].get('step')} | {task} | {r['n']} | "
                         f"{cell(r, 'acc')} | {cell(r, 'acc_norm')} | {pct(results['chance'])} |")
    for task, r in results.get("baselines", {}).get("word_overlap", {}).items():
        lines.append(f"| word overlap with the context (no model) | — | {task} | {r['n']} | {cell(r, 'acc')} | — | "
                     f"{pct(results['chance'])} |")
    lines += ["", "Task files:", ""]
    for task, info in results["tasks"].items():
        lines.append(f"- `{task}.jsonl`: {info['items']} items, seed {info['seed']}, sha256 `{info['sha256'][:16]}…`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from contract.atomic import atomic_write_json, atomic_write_text, sha256_file

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bundle", nargs="?", default=str(ROOT / "runs" / "small" / "bundle"))
    p.add_argument("--twin", default=None, help="random-init twin bundle (default: runs/<name>-init/bundle if present)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--limit", type=int, default=None, help="first N items of each task (for a quick look)")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: all cores)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval"), help="writes OUT.md and OUT.json")
    p.add_argument("--no-card", dest="card", action="store_false", help="do not refresh the bundles' model cards")
    a = p.parse_args(argv)
    bundle = Path(a.bundle)
    from contract.bundle import MANIFEST

    if not (bundle / MANIFEST).is_file():
        print(f"error: {bundle} is not a bundle (no {MANIFEST}); export one with python -m export.onnx RUN",
              file=sys.stderr)
        return 2
    twin = Path(a.twin) if a.twin else default_twin(bundle)
    build = json.loads((TASK_DIR / "build.json").read_text(encoding="utf-8"))
    tasks, info = {}, {}
    for t in a.tasks:
        path = TASK_DIR / f"{t}.jsonl"
        tasks[t] = read_items(path)[:a.limit]
        info[t] = {"items": len(tasks[t]), "sha256": sha256_file(path), "seed": build["seed"]}
    models = [evaluate_bundle(bundle, tasks, a.threads)]
    if twin is not None:
        models.append(evaluate_bundle(twin, tasks, a.threads))
        models[0]["twin"] = models[1]["source"]["sha256"]
    else:
        print("note: no random-init twin (pass --twin)", file=sys.stderr)
    out = Path(a.out)
    old = None
    if out.with_suffix(".json").is_file():
        old = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    baselines = {"word_overlap": {t: accuracy([word_overlap_pick(it) for it in items], items)
                                  for t, items in tasks.items()}}
    results = merge_results(old, models, info, baselines)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), results)
    atomic_write_text(out.with_suffix(".md"), render_markdown(results))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    if a.card:
        from contract.bundle import CARD
        from export.card import refresh_card

        for m in models:
            b = ROOT / m["bundle"] if not Path(m["bundle"]).is_absolute() else Path(m["bundle"])
            if refresh_card(b, out.with_suffix(".json")):
                print(f"refreshed the benchmark section of {b / CARD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
