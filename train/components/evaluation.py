"""Validation NLL and bits per character per language (and, at the end of a run, per source file over the whole
validation split: :func:`evaluate_sources`), and greedy samples of fixed prompts.

``nll`` is the mean negative log-likelihood in nats per target token; ``bpc`` is bits per NFC character:
``sum NLL / ln 2 / characters`` where the characters of a token span are the UTF-8 lead bytes of its tokens
(``train.tokenizer.token_char_counts``; the ``<|endoftext|>`` separator counts 0 characters but its NLL counts).

:class:`Evaluator`, the Trainer's component, is the periodic evaluation of a run: validation NLL and bits per
character per language (:func:`evaluate`), at step 0 also the random-init twin's, and greedy samples of the fixed
prompts; and the final report (:meth:`Evaluator.final`): the whole validation split per source file beside the
compressor floor (:mod:`train.compression`), and the samples a user would draw beside the greedy ones; rank 0
only."""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from train import compression
from train import windows as W
from train.components.placement import Placement
from train.components.run_data import RunData
from train.components.run_log import RunLog
from train.components.state import TrainState
from train.hf_files import SAMPLING
from train.model import LlamaForCausalLM, causal_lm_loss, stop_set

SAMPLE_PROMPTS = [
    ("bn", "আমি বাংলায় গান গাই"),
    ("bn", "একদিন সকালে"),
    ("bn", "বাংলা ভাষা"),
    ("en", "It was a dark and stormy night"),
    ("en", "The old man said"),
]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, val: dict[str, list[np.ndarray]], char_counts: np.ndarray,
             device: torch.device, autocast=None, batch_size: int = 8) -> dict[str, dict]:
    """``{lang: {nll, bpc, tokens, chars}, "all": {…}}`` over the given val windows (int64 arrays of ≤ seq+1, in
    :mod:`train.windows`' layout: positions marked context only are inputs, not targets).

    Windows of equal length are batched; the model is put in eval mode and restored.
    """
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    out: dict[str, dict] = {}
    tot = {"nll_sum": 0.0, "tokens": 0, "chars": 0}
    for lang, windows in val.items():
        nll_sum, tokens, chars = 0.0, 0, 0
        by_len: dict[int, list[np.ndarray]] = {}
        for w in windows:
            by_len.setdefault(len(w), []).append(w)
        for _n, group in sorted(by_len.items()):
            for i in range(0, len(group), batch_size):
                batch = torch.from_numpy(np.stack(group[i:i + batch_size])).to(device)
                x, y = W.inputs(batch), W.labels(batch)
                with ctx:
                    logits, _ = model(x)
                nll_sum += float(causal_lm_loss(logits, y, reduction="sum"))
                ys = y[y != W.IGNORE].cpu().numpy()
                tokens += int(ys.size)
                chars += int(char_counts[ys].sum())
        if tokens == 0:
            continue
        out[lang] = {"nll": nll_sum / tokens, "bpc": nll_sum / math.log(2) / max(chars, 1), "tokens": tokens,
                     "chars": chars}
        tot["nll_sum"] += nll_sum
        tot["tokens"] += tokens
        tot["chars"] += chars
    if tot["tokens"]:
        out = {"all": {"nll": tot["nll_sum"] / tot["tokens"], "bpc": tot["nll_sum"] / math.log(2) / max(tot["chars"], 1),
                       "tokens": tot["tokens"], "chars": tot["chars"]}, **out}
    model.train(was_training)
    return out


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, tokenizer, eot_id: int, max_new_tokens: int = 32,
                   prompts=SAMPLE_PROMPTS, stop_ids=None) -> list[dict]:
    """Greedy continuations ``[{prompt, lang, text}]``; every prompt is encoded as ``<|endoftext|>`` + prompt;
    generation stops at ``stop_ids`` (default ``eot_id``)."""
    was_training = model.training
    model.eval()
    out = []
    for lang, prompt in prompts:
        ids = [eot_id] + tokenizer.encode(prompt, add_special_tokens=False).ids
        new = model.generate_greedy(ids, max_new_tokens, eot_id=eot_id if stop_ids is None else stop_ids)
        out.append({"prompt": prompt, "lang": lang, "text": tokenizer.decode(new)})
    model.train(was_training)
    return out


def strided_spans(length: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, window length, targets to skip)`` for windows of at most ``seq_len + 1`` tokens over a stream of
    ``length`` tokens, advancing by ``stride``, so that every target (positions 1..length-1) is scored exactly once:
    by the first window that holds it after the targets the previous window scored (Hugging Face's strided
    perplexity). Each window after the first gives its targets at least ``seq_len - stride`` tokens of context."""
    spans, begin, prev_end = [], 0, 0
    while length >= 2:
        end = min(begin + seq_len + 1, length)
        spans.append((begin, end - begin, max(prev_end, begin + 1) - begin - 1))
        prev_end = end
        if end == length:
            break
        begin += stride
    return spans


@torch.no_grad()
def evaluate_sources(model: LlamaForCausalLM, sources: dict, tokenizer, eot_id: int, char_counts: np.ndarray,
                     seq_len: int, device: torch.device, autocast=None, batch_size: int = 8,
                     stride: int | None = None) -> dict[str, dict]:
    """NLL and bits per NFC character of every validation document of every source — the text the compressor floor
    (:mod:`train.compression`) is measured on: ``{source: {lang, nll, bpc, tokens, chars}, lang: {...}, "all": {...}}``
    (nats per target token; bits per character).

    ``sources`` maps a name to an object with ``lang`` and ``docs`` (NFC strings). Each source is one token stream,
    every document as ``<|endoftext|>`` + its tokens (as the shards lay it out), scored by :func:`strided_spans`
    (``stride`` defaults to ``seq_len // 2``). Characters are counted as in :func:`evaluate`, so they sum to the
    documents' NFC characters.
    """
    stride = stride or max(seq_len // 2, 1)
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    out: dict[str, dict] = {}
    for name, src in sources.items():
        ids: list[int] = []
        for doc in src.docs:
            ids.append(eot_id)
            ids.extend(tokenizer.encode(doc, add_special_tokens=False).ids)
        stream = np.asarray(ids, dtype=np.int64)
        by_len: dict[int, list[tuple[int, int]]] = {}
        for begin, n, skip in strided_spans(len(stream), seq_len, stride):
            by_len.setdefault(n, []).append((begin, skip))
        nll_sum, tokens, chars = 0.0, 0, 0
        for n, group in sorted(by_len.items()):
            for i in range(0, len(group), batch_size):
                part = group[i:i + batch_size]
                batch = torch.from_numpy(np.stack([stream[b:b + n] for b, _ in part])).to(device)
                with ctx:
                    logits, _ = model(batch[:, :-1])
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll = (-logp.gather(-1, batch[:, 1:, None])[..., 0]).double().cpu().numpy()
                ys = batch[:, 1:].cpu().numpy()
                for row, (_, skip) in enumerate(part):
                    nll_sum += float(nll[row, skip:].sum())
                    tokens += n - 1 - skip
                    chars += int(char_counts[ys[row, skip:]].sum())
        out[name] = {"lang": src.lang, "nll": nll_sum / max(tokens, 1),
                     "bpc": nll_sum / math.log(2) / max(chars, 1), "tokens": tokens, "chars": chars}
    groups: dict[str, list[dict]] = {}
    for v in list(out.values()):
        groups.setdefault(v["lang"], []).append(v)
    groups["all"] = list(out.values())
    for key, vs in groups.items():
        nll_sum = sum(v["nll"] * v["tokens"] for v in vs)
        tokens, chars = sum(v["tokens"] for v in vs), sum(v["chars"] for v in vs)
        out[key] = {"nll": nll_sum / max(tokens, 1), "bpc": nll_sum / math.log(2) / max(chars, 1), "tokens": tokens,
                    "chars": chars}
    model.train(was_training)
    return out


def _process_logits(logits: torch.Tensor, seen: list[int], temperature: float, top_k: int, top_p: float,
                    repetition_penalty: float) -> torch.Tensor:
    """Hugging Face's logits processors in its order — repetition penalty (CTRL: a seen token's positive logit is
    divided by the penalty, a negative one multiplied), temperature, top-k, top-p (nucleus: the smallest set whose
    probability reaches ``top_p``) — on one row of float32 logits ``[V]``; removed tokens get -inf."""
    x = logits.float().clone()
    if repetition_penalty != 1.0 and seen:
        idx = torch.tensor(sorted(set(seen)), device=x.device)
        v = x[idx]
        x[idx] = torch.where(v > 0, v / repetition_penalty, v * repetition_penalty)
    x = x / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x[x < kth] = float("-inf")
    if top_p < 1.0:
        srt, order = torch.sort(x, descending=True)
        cum = torch.softmax(srt, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(srt, dim=-1) >= top_p  # keep up to and including the token that reaches top_p
        x[order[drop]] = float("-inf")
    return x


@torch.no_grad()
def sampled_continuation(model: LlamaForCausalLM, ids: list[int], max_new_tokens: int, eot_id, seed: int,
                         temperature: float, top_k: int = 0, top_p: float = 1.0,
                         repetition_penalty: float = 1.0) -> list[int]:
    """A continuation of ``ids`` drawn with the KV cache and :func:`_process_logits` (the penalty counts the prompt's
    tokens too, as Hugging Face's does), from a ``torch.Generator`` seeded with ``seed``; stops at ``eot_id`` (an id
    or several) or the context. ``temperature`` 0 is greedy."""
    if temperature == 0:
        return model.generate_greedy(ids, max_new_tokens, eot_id=eot_id)
    device = model.lm_head.weight.device
    max_new_tokens = max(0, min(max_new_tokens, model.config.max_position_embeddings - len(ids)))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    stops = stop_set(eot_id)
    logits, past = model(torch.tensor([ids], dtype=torch.long, device=device), use_cache=True)
    seen, out = list(ids), []
    while len(out) < max_new_tokens:
        x = _process_logits(logits[0, -1], seen, temperature, top_k, top_p, repetition_penalty)
        nxt = int(torch.multinomial(torch.softmax(x, dim=-1).cpu(), 1, generator=gen))
        if nxt in stops:
            break
        out.append(nxt)
        seen.append(nxt)
        if len(out) < max_new_tokens:
            logits, past = model(torch.tensor([[nxt]], device=device), past_key_values=past)
    return out


def user_samples(model: LlamaForCausalLM, tokenizer, eot_id: int, sampling: dict, seed: int = 1234,
                 max_new_tokens: int = 48, prompts=SAMPLE_PROMPTS, stop_ids=None) -> list[dict]:
    """For each prompt (encoded as ``<|endoftext|>`` + prompt), the continuation a user would draw (``sampling``:
    the bundle's defaults, ``train.hf_files.SAMPLING``; seeded) and the greedy one, both stopping at ``stop_ids``
    (default ``eot_id``), each with its share of distinct words:
    ``[{prompt, lang, sampled, greedy, distinct_sampled, distinct_greedy}]``."""
    from contract.text import distinct_word_share  # noqa: PLC0415

    was_training = model.training
    model.eval()
    out = []
    for i, (lang, prompt) in enumerate(prompts):
        ids = [eot_id] + tokenizer.encode(prompt, add_special_tokens=False).ids
        stops = eot_id if stop_ids is None else stop_ids
        sampled = tokenizer.decode(sampled_continuation(model, ids, max_new_tokens, stops, seed + i, **sampling))
        greedy = tokenizer.decode(model.generate_greedy(ids, max_new_tokens, eot_id=stops))
        out.append({"prompt": prompt, "lang": lang, "sampled": sampled, "greedy": greedy,
                    "distinct_sampled": distinct_word_share(sampled), "distinct_greedy": distinct_word_share(greedy)})
    model.train(was_training)
    return out


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
