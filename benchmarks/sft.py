"""What fine-tuning did: the main job's model fine-tuned on the embedded set (``python -m train.sft``) against the
same base model prompted with the same template, and which batch layout trains faster here.

    OMP_NUM_THREADS=1 python benchmarks/sft.py [--base runs/cpu] [--name cpu-sft] [--prompts 40] [--layout-rounds 2]

1. **Layout** (``--layout-rounds``): the same conversations as training steps of the base model, forward +
   backward, either padded (one conversation a row, right-padded to the step's longest, causal attention with no
   mask: what ``train.sft`` does) or packed (conversations concatenated into rows of ``train.seq_len`` with a
   block-diagonal causal mask and positions restarting at each conversation). Interleaved rounds (timing.py);
   conversation tokens per second, median per layout and the median of the rounds' ratios.
2. **Fine-tuning**: ``python -m train.sft BASE --name NAME`` (the README command), timed; reused when the run is
   already there (``--retrain`` to run it again).
3. **Replies**: for ``--prompts`` validation conversations per language (held out by work; drawn at random, so
   in the split's mix of tasks), the conversation up to its last assistant turn is the prompt (``<|im_start|>assistant\\n`` after it);
   the base (its pretrained weights with the chat tokens added, the fine-tuning run's step 0) and the fine-tuned
   model each reply greedily and sampled (the bundle's sampling defaults, seeded), at most 128 tokens. Per
   language: the share of replies that end with ``<|im_end|>`` (before any ``<|endoftext|>``) within 128 tokens,
   the share whose script is the language asked (contract.text.detect_language; an empty reply counts as
   wrong), exact match on the title / author tasks (NFC, case, surrounding quotes and final punctuation ignored),
   and the validation NLL on assistant tokens over the whole validation split. Samples are shown.

4. **The same prompts as before** (``--compare-data PATH``): the fine-tuned model's replies, greedy and sampled, to
   the validation prompts of another version of the set, drawn the same way, so a changed set is compared on the
   prompts that gave the earlier figures.

Writes benchmarks/results/sft.md and sft.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import unicodedata
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import timing  # noqa: E402
from contract.atomic import atomic_write_json, atomic_write_text  # noqa: E402
from contract.chat_format import IM_END, render  # noqa: E402
from contract.text import detect_language  # noqa: E402
from train import windows as W  # noqa: E402
from train.components.checkpoint import find_checkpoint, load_model  # noqa: E402
from train.components.evaluation import evaluate, sampled_continuation  # noqa: E402
from train.device import autocast_ctx, native_cpu_bf16, resolve_dtype  # noqa: E402
from train.hf_files import SAMPLING  # noqa: E402
from train.model import CausalLMLoss, LlamaForCausalLM, ModelConfig, compute_dtype  # noqa: E402
from train.sft.cli import sft_config  # noqa: E402
from train.sft.data import SFTData, base_checkpoint  # noqa: E402
from train.sft.encode import encode_conversations, pad_windows, to_window  # noqa: E402
from train.sft.formats import read_conversations  # noqa: E402
from train.sft.init import load_base  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MAX_NEW = 128
EXACT_TASKS = ("title", "author", "author_of_title")
TARGETS = {"im_end": 0.95, "language": 0.90}


# ------------------------------------------------------------------ 1. layout
def packed_rows(windows: list[np.ndarray], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy first-fit packing of windows into rows of ``seq_len + 1``: (rows, segment ids ``[n, seq_len + 1]``,
    -1 on padding)."""
    rows, segs, cur, cur_seg = [], [], [], []
    for i, w in enumerate(windows):
        if len(cur) + len(w) > seq_len + 1:
            rows.append(cur)
            segs.append(cur_seg)
            cur, cur_seg = [], []
        cur += list(w)
        cur_seg += [i] * len(w)
    rows.append(cur)
    segs.append(cur_seg)
    out = np.full((len(rows), seq_len + 1), ~np.int64(pad_id))
    seg = np.full((len(rows), seq_len + 1), -1)
    for r, (row, s) in enumerate(zip(rows, segs, strict=True)):
        out[r, :len(row)] = row
        seg[r, :len(s)] = s
    return out, seg


def packed_loss(lm: LlamaForCausalLM, batch: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Summed masked NLL of packed rows: the model's own layers with a block-diagonal causal mask and positions
    restarting at every conversation (what packing needs from the attention code)."""
    x, y, s = W.inputs(batch), W.labels(batch), seg[:, :-1]
    n = x.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = (causal[None] & (s[:, :, None] == s[:, None, :]))[:, None]
    starts = torch.cat([torch.ones_like(s[:, :1], dtype=torch.bool), s[:, 1:] != s[:, :-1]], dim=1)
    idx = torch.arange(n).expand_as(s)
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    pos = idx - first
    h = lm.model.embed_tokens(x)
    cos, sin = lm.model.rotary_emb(pos, compute_dtype(h))
    for layer in lm.model.layers:
        h, _ = layer(h, cos, sin, mask, None)
    logits = lm.lm_head(lm.model.norm(h))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=W.IGNORE,
                                             reduction="sum")


def layout(model: LlamaForCausalLM, data: SFTData, micro: int, seq_len: int, rounds: int, ctx) -> dict:
    """Conversation tokens per second of forward + backward (in the run's autocast ``ctx``), padded vs packed, over
    the same conversations."""
    convs = [data.loader.windows[i] for i in data.loader.order(0)[:micro * 4]]
    real = sum(len(w) for w in convs)
    padded = [pad_windows(convs[i:i + micro], data.pad_id, 8, seq_len + 1) for i in range(0, len(convs), micro)]
    rows, seg = packed_rows(convs, seq_len, data.pad_id)
    loss_mod = CausalLMLoss(model)

    def run_padded():
        for b in padded:
            t = torch.from_numpy(b)
            with ctx():
                loss = loss_mod(W.inputs(t), W.labels(t))
            loss.backward()

    def run_packed():
        per = max(1, len(rows) // len(padded))
        for i in range(0, len(rows), per):
            with ctx():
                loss = packed_loss(model, torch.from_numpy(rows[i:i + per]), torch.from_numpy(seg[i:i + per]))
            loss.backward()

    lanes = {"padded": run_padded, "packed": run_packed}
    for f in lanes.values():  # warm-up
        f()
        model.zero_grad(set_to_none=True)
    secs: dict[str, list[float]] = {k: [] for k in lanes}
    for r in range(rounds):
        for name in timing.rotated(list(lanes), r):
            timing.quiet()
            t0 = time.perf_counter()
            lanes[name]()
            secs[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    tps = {k: [real / s for s in v] for k, v in secs.items()}
    return {"conversations": len(convs), "tokens": real, "padded_rows_tokens": int(sum(b.size for b in padded)),
            "packed_rows_tokens": int(rows.size), "rounds": rounds,
            "tokens_per_s": {k: timing.median(v) for k, v in tps.items()},
            "padded_over_packed": timing.median_ratio(tps["padded"], tps["packed"])}


# ------------------------------------------------------------------ 3. replies
def norm(s: str) -> str:
    s = unicodedata.normalize("NFC", s).strip().casefold()
    s = s.strip("\"'«»“”‘’ ")
    return re.sub(r"[.।!?]+$", "", s).strip()


def prompts_of(convs, per_lang: int, seed: int) -> list:
    """Up to ``per_lang`` of ``convs`` per language, drawn at random (seeded), in their order: the split's own mix
    of tasks (or, drawn from a drawn set, a subset of it)."""
    rng = np.random.default_rng(seed)
    out = []
    for lang in ("bn", "en"):
        mine = [c for c in convs if c.lang == lang]
        out += [mine[i] for i in sorted(rng.choice(len(mine), min(per_lang, len(mine)), replace=False))]
    return out


def reply(model, tok, c, eot: int, im_end: int, mode: str, seed: int) -> dict:
    msgs = c.messages
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    ids = [eot] + tok.encode(render(msgs[:last], add_generation_prompt=True), add_special_tokens=False).ids
    if mode == "greedy":
        out = model.generate_greedy(ids, MAX_NEW, eot_id=im_end)
    else:
        out = sampled_continuation(model, ids, MAX_NEW, im_end, seed, **SAMPLING)
    cut = out.index(eot) if eot in out else None
    body = out[:cut] if cut is not None else out
    ended = cut is None and len(out) < MAX_NEW
    text = tok.decode(body)
    return {"lang": c.lang, "task": c.task, "reply": text, "reference": msgs[last]["content"],
            "ended": ended, "language_ok": bool(text.strip()) and detect_language(text) == c.lang,
            "exact": norm(text) == norm(msgs[last]["content"]) if c.task in EXACT_TASKS else None,
            "question": msgs[last - 1]["content"]}


def score(rows: list[dict]) -> dict:
    out = {}
    for lang in ("bn", "en"):
        rs = [r for r in rows if r["lang"] == lang]
        ex = [r["exact"] for r in rs if r["exact"] is not None]
        out[lang] = {"n": len(rs), "im_end": sum(r["ended"] for r in rs) / max(len(rs), 1),
                     "language": sum(r["language_ok"] for r in rs) / max(len(rs), 1),
                     "exact": sum(ex) / len(ex) if ex else None, "exact_n": len(ex)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/cpu", help="the pretrained run (default: the main job's)")
    p.add_argument("--name", default=None, help="the fine-tuning run's name (default: <base>-sft)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="passed to train.sft")
    p.add_argument("--retrain", action="store_true", help="fine-tune again even if the run exists")
    p.add_argument("--prompts", type=int, default=200, help="validation prompts per language")
    p.add_argument("--base-prompts", type=int, default=None,
                   help="validation prompts per language for the base model (default: --prompts; its replies run "
                        "to 128 tokens, so fewer keep the run short)")
    p.add_argument("--layout-rounds", type=int, default=2)
    p.add_argument("--full-val", action="store_true", help="validation NLL over the whole split (default: the "
                   "run's own evaluation rows: train.eval_tokens targets per language, spread over the split)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--report-only", action="store_true", help="rewrite sft.md from sft.json")
    p.add_argument("--results", default="sft", help="the results' file name (benchmarks/results/NAME.md, .json)")
    p.add_argument("--compare-data", default=None, metavar="PATH",
                   help="also score the fine-tuned model on the validation prompts of another set (e.g. an earlier "
                        "data/sft taken with git show), drawn the same way: the same prompts as that set's figures")
    p.add_argument("--compare-label", default=None, help="how the report names --compare-data")
    args = p.parse_args(argv)
    if args.report_only:
        r = json.loads((RESULTS / f"{args.results}.json").read_text())
        r.setdefault("log_span_s", log_span(ROOT / r["run"] / "train.log"))
        atomic_write_json(RESULTS / f"{args.results}.json", r)
        atomic_write_text(RESULTS / f"{args.results}.md", report(r))
        return 0
    torch.manual_seed(0)
    ckpt = base_checkpoint(args.base)
    cfg = sft_config(args.base, ckpt, None, args.overrides, False, args.name)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    t = cfg.train
    data = SFTData.load(cfg, ckpt, t.micro_batch_size * t.grad_accum, log=print)
    eot, im_end = data.eot_id, data.tokenizer.token_to_id(IM_END)
    base = LlamaForCausalLM(ModelConfig.from_dict({**load_model(ckpt)[1].to_dict(), "vocab_size": data.vocab_size}))
    load_base(base, ckpt, print)
    result = {"base": timing.relative(ckpt), "run": str(run_dir), "cpu": timing.cpu_name(), "loadavg_start": timing.loadavg(),
              "commit": timing.git_commit(), "torch_threads": torch.get_num_threads()}

    if args.layout_rounds:
        dev = torch.device("cpu")
        dtype = resolve_dtype(t.dtype, dev)
        if t.dtype == "auto" and native_cpu_bf16():  # what an auto run picks here once preflight passes (its log says)
            dtype = torch.bfloat16
        result["layout"] = layout(base, data, t.micro_batch_size, t.seq_len, args.layout_rounds,
                                  lambda: autocast_ctx(dev, dtype))
        result["layout"]["dtype"] = str(dtype).replace("torch.", "")
        print("layout:", json.dumps(result["layout"]))

    cmd = [sys.executable, "-m", "train.sft", args.base, "--name", cfg.run.name, *sum((["--set", s] for s in args.overrides), [])]
    if args.retrain or not (run_dir / "summary.json").is_file():
        if args.retrain and run_dir.exists():
            import shutil  # noqa: PLC0415

            shutil.rmtree(run_dir)
        t0 = time.time()
        subprocess.run(cmd, check=True, cwd=ROOT)
        result["finetune_wall_s"] = time.time() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    result["log_span_s"] = log_span(run_dir / "train.log")
    result["command"] = " ".join(["python -m train.sft", args.base] + (["--name", cfg.run.name] if args.name else [])
                                 + sum((["--set", s] for s in args.overrides), []))
    result["summary"] = {k: summary.get(k) for k in ("steps", "tokens", "wall_s", "tokens_per_s", "val", "base_val")}
    tuned, _ = load_model(find_checkpoint(run_dir))
    models = {"base": base.eval(), "fine-tuned": tuned.eval()}

    convs = [c for c in read_conversations(cfg.data.paths, cfg.data.val_fraction) if c.split == "validation"]
    if args.full_val:
        full_val = {}
        for c, (ids, mask) in zip(convs, encode_conversations(data.tokenizer, [c.messages for c in convs], eot),
                                  strict=True):
            full_val.setdefault(c.lang, []).append(pad_windows([to_window(ids, mask)], data.pad_id, 32)[0])
        result["val_scope"] = "the whole validation split"
        result["val_nll"] = {name: evaluate(m, full_val, data.char_counts, torch.device("cpu"), batch_size=16)
                             for name, m in models.items()}
    else:
        n = {lang: len(ws) for lang, ws in data.val.items()}
        result["val_scope"] = (f"the run's own evaluation: {n.get('bn', 0)} bn and {n.get('en', 0)} en conversations "
                               f"spread over the validation split (train.eval_tokens = {t.eval_tokens} targets per "
                               f"language)")
        result["val_nll"] = {"base": summary["base_val"], "fine-tuned": summary["val"]}
    chosen = prompts_of(convs, args.prompts, args.seed)
    base_chosen = chosen if args.base_prompts is None else prompts_of(chosen, args.base_prompts, args.seed)
    result["prompt_tasks"] = {lang: dict(sorted(Counter(c.task for c in chosen if c.lang == lang).items()))
                              for lang in ("bn", "en")}
    result["replies"] = {}
    for name, m in models.items():
        for mode in ("greedy", "sampled"):
            t0 = time.time()
            rows = [reply(m, data.tokenizer, c, eot, im_end, mode, args.seed + i)
                    for i, c in enumerate(base_chosen if name == "base" else chosen)]
            result["replies"][f"{name} {mode}"] = {"scores": score(rows), "rows": rows, "seconds": time.time() - t0}
            print(name, mode, json.dumps(score(rows)))
    if args.compare_data:
        result["compare"] = compare(tuned, data, args.compare_data, args.compare_label or args.compare_data,
                                    cfg.data.val_fraction, args.prompts, args.seed, eot, im_end)
    result["loadavg_end"] = timing.loadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / f"{args.results}.json", result)
    atomic_write_text(RESULTS / f"{args.results}.md", report(result))
    print(RESULTS / f"{args.results}.md")
    return 0


def compare(model, data: SFTData, path: str, label: str, val_fraction: float, per_lang: int, seed: int, eot: int,
            im_end: int) -> dict:
    """The fine-tuned model's scores, greedy and sampled, on ``per_lang`` validation prompts per language of the set
    at ``path``, drawn as :func:`prompts_of` draws them (so the same prompts as that set's own figures), and the
    tasks of the replies that did not end."""
    convs = [c for c in read_conversations([path], val_fraction) if c.split == "validation"]
    chosen = prompts_of(convs, per_lang, seed)
    out = {"label": label, "scores": {}, "misses": {}}
    for mode in ("greedy", "sampled"):
        rows = [reply(model, data.tokenizer, c, eot, im_end, mode, seed + i) for i, c in enumerate(chosen)]
        out["scores"][mode] = score(rows)
        out["misses"][mode] = {lang: dict(Counter(r["task"] for r in rows if r["lang"] == lang and not r["ended"]))
                               for lang in ("bn", "en")}
        print("compare", mode, json.dumps(out["scores"][mode]))
    return out


def log_span(path: Path) -> float:
    """Seconds from the first to the last timestamped line of a train.log (data read to final report)."""
    stamps = [time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
              for line in path.read_text(encoding="utf-8").splitlines() if re.match(r"\d{4}-\d\d-\d\d \d", line)]
    return stamps[-1] - stamps[0] if stamps else float("nan")


def reading(r: dict) -> list[str]:
    """What the table says, computed from the rows: the majority-answer baseline of the exact-match prompts, and
    where the replies that did not end come from."""
    out = []
    rows = r["replies"]["fine-tuned greedy"]["rows"]
    for lang in ("bn", "en"):
        refs = [norm(x["reference"]) for x in rows if x["lang"] == lang and x["exact"] is not None]
        if refs:
            top, n = Counter(refs).most_common(1)[0]
            out.append(f"- {lang}: answering the most common reference ({top!r}) to every title/author prompt would "
                       f"score {n / len(refs):.0%} exact match; the held-out works' titles never appear as answers in "
                       "training, and an author only when another of their works is in the training split.")
    for key in ("fine-tuned greedy", "fine-tuned sampled"):
        for lang in ("bn", "en"):
            miss = Counter(x["task"] for x in r["replies"][key]["rows"] if x["lang"] == lang and not x["ended"])
            if miss:
                out.append(f"- {key}, {lang}: the replies without `<|im_end|>` within {MAX_NEW} tokens are "
                           + ", ".join(f"{n} {t}" for t, n in miss.most_common()) + " prompts.")
    out += [f"- {n}" for n in r.get("notes", [])]
    return ["What the figures say:", "", *out]


def _layout_verdict(ratio: float) -> str:
    why = ("`train.sft` pads: causal attention needs no mask (the attention code is pretraining's), and every "
           "conversation sits at positions from 0, as a runtime encodes it; length-grouped steps leave about 4 % "
           "padding.")
    if abs(ratio - 1) <= 0.05:
        return "Equal within the noise of this shared machine (±5 %). " + why
    return ("Padding is faster here. " if ratio > 1 else f"Packing is {1 / ratio:.2f}× faster here, but ") + why


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def report(r: dict) -> str:
    """benchmarks/results/sft.md from the result dict."""
    s = r["summary"]
    lines = ["# Supervised fine-tuning: what it did", "",
             f"`OMP_NUM_THREADS=1 python benchmarks/sft.py` on {r['cpu']} (Zen 4: AVX-512, AVX512-BF16, VNNI, no AMX; 2 shared cores; other jobs ran beside, load average "
             f"{r['loadavg_start'][0]:.1f} at the start and {r['loadavg_end'][0]:.1f} at the end), "
             f"{r.get('torch_threads', '?')} torch thread(s) here and in the fine-tuning run (`OMP_NUM_THREADS=1`: "
             "on the oversubscribed machine two threads made a step about five times slower), commit "
             f"{r['commit']}. Base: the main job's model (`{r['base']}`), "
             "its pretrained weights with `<|im_start|>` / `<|im_end|>` added (rows at the mean embedding): the "
             "fine-tuning run's step 0, prompted with the same ChatML template.", ""]
    if "layout" in r:
        lay = r["layout"]
        tps = lay["tokens_per_s"]
        lines += ["## Padded or packed", "",
                  f"Forward + backward of the base model ({lay['dtype']} autocast, as the run) over the same "
                  f"{lay['conversations']} conversations ({lay['tokens']:,} tokens), {lay['rounds']} interleaved "
                  "rounds:", "",
                  "| layout | rows × length computed | conversation tokens / s (median) |", "|---|---:|---:|",
                  f"| padded (one conversation a row, causal attention, no mask) | {lay['padded_rows_tokens']:,} | "
                  f"{tps['padded']:,.0f} |",
                  f"| packed (rows of train.seq_len, block-diagonal mask, positions reset) | "
                  f"{lay['packed_rows_tokens']:,} | {tps['packed']:,.0f} |", "",
                  *([f"({lay['note']}.)", ""] if lay.get("note") else []),
                  f"Padded / packed: **{lay['padded_over_packed']:.2f}×** (median of the rounds' ratios). "
                  + _layout_verdict(lay["padded_over_packed"]), ""]
    lines += ["## Fine-tuning", "", f"`{r['command']}`: {s['steps']} steps, {s['tokens']:,} assistant tokens, "
              f"{s['wall_s'] / 60:.1f} min of training"
              + (f" ({r['finetune_wall_s'] / 60:.1f} min for the whole command)" if "finetune_wall_s" in r else
                 f" ({r['log_span_s'] / 60:.1f} min from the data read to the final report in its train.log)"
                 if "log_span_s" in r else "")
              + f", {s['tokens_per_s']:,.0f} target tokens/s."
              + (f" {r['finetune_note']}" if r.get("finetune_note") else ""), ""]
    vn = r["val_nll"]
    lines += ["## Results", "", f"Validation NLL on assistant tokens (nats/token; {r['val_scope']}; works held out of "
              "training):", "", "| model | bn | en | all |", "|---|---:|---:|---:|"]
    for name, v in vn.items():
        lines.append(f"| {name} | {v['bn']['nll']:.3f} | {v['en']['nll']:.3f} | {v['all']['nll']:.3f} |")
    mix = "; ".join(f"{lang}: " + ", ".join(f"{k} {v}" for k, v in m.items())
                    for lang, m in r.get("prompt_tasks", {}).items())
    lines += ["", f"Replies to validation prompts drawn at random (seeded) per language (tasks — {mix}); at most "
              f"{MAX_NEW} new tokens; targets: ≥ 95 % end with `<|im_end|>`, ≥ 90 % in the language asked:", "",
              "| model, decoding | lang | prompts | ends with `<|im_end|>` | language asked | exact match title/author (n) |",
              "|---|---|---:|---:|---:|---:|"]
    for key, v in r["replies"].items():
        for lang, sc in v["scores"].items():
            lines.append(f"| {key} | {lang} | {sc['n']} | {_pct(sc['im_end'])} | {_pct(sc['language'])} | "
                         f"{_pct(sc['exact'])} ({sc['exact_n']}) |")
    if r.get("compare"):
        cmp = r["compare"]
        lines += ["", f"The fine-tuned model on the validation prompts of {cmp['label']}, drawn the same way (the same "
                  "prompts as that set's figures):", "",
                  "| decoding | lang | prompts | ends with `<|im_end|>` | language asked | replies without it, by task |",
                  "|---|---|---:|---:|---:|---|"]
        for mode, by_lang in cmp["scores"].items():
            for lang, sc in by_lang.items():
                miss = ", ".join(f"{t} {n}" for t, n in cmp["misses"][mode][lang].items()) or "–"
                lines.append(f"| {mode} | {lang} | {sc['n']} | {_pct(sc['im_end'])} | {_pct(sc['language'])} | "
                             f"{miss} |")
    lines += ["", *reading(r), "", "## Samples", "", "The first validation prompts of each language and task kind, greedy and "
              "sampled, base and fine-tuned (replies cut at 200 characters).", ""]
    keys = list(r["replies"])
    by_q = {k: {(x["lang"], x["question"]): x for x in r["replies"][k]["rows"]} for k in keys}
    shown, seen = [], set()
    for row in r["replies"][keys[0]]["rows"]:  # the base's prompts: the other models answered them too
        if (row["lang"], row["task"]) not in seen:
            seen.add((row["lang"], row["task"]))
            shown.append(row)
    for row in shown:
        q = row["question"].replace("\n", " ⏎ ")
        lines += [f"**[{row['lang']}, {row['task']}]** {q[:160]}{'…' if len(q) > 160 else ''}", "",
                  f"- reference: {row['reference'][:200]!r}"]
        for k in keys:
            rr = by_q[k].get((row["lang"], row["question"]))
            if rr is not None:
                lines.append(f"- {k}: {rr['reply'][:200]!r}{'' if rr['ended'] else ' (no <|im_end|>)'}")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
