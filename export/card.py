"""The bundle's ``README.md`` model card: what the model is, its data and licences, fertility, evaluation against
the random-init twin, the next-sentence benchmark, the quantized forms' quality gate, limits, usage (Python, HTTP,
transformers) and the parity table.

The benchmark section shows ``benchmarks/results/eval.json`` (written by ``benchmarks/eval.py``) only for an entry
whose source sha256 and step are this checkpoint's — never another model's figures — and otherwise says how to run
it. The benchmark runs on a finished bundle, so ``benchmarks/eval.py`` calls :func:`refresh_card` afterwards: it
rewrites just that section of the bundle's card (between :data:`EVAL_BEGIN` and :data:`EVAL_END`) and the card's
entry in ``manifest.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.atomic import atomic_write_text
from contract.bundle import (
    CARD,
    EOT,
    MANIFEST,
    ONNX,
    PAD,
    TOKENIZER,
    WEIGHTS,
    external_data,
    read_manifest,
    rehash,
)
from export import gate as G
from export.modelfile import MODELFILE, sampling_defaults
from export.parity import format_table
from export.source import Source
from serve.verdict import fmt_figure, fmt_limit
from train.tokenizer.pretokenizers import identify

EVAL_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "eval.json"
EVAL_BEGIN = "<!-- shalik-eval: written from benchmarks/results/eval.json -->"
EVAL_END = "<!-- /shalik-eval -->"
TASK_TITLES = {"bn_next_sentence": "bn-next-sentence", "en_next_sentence": "en-next-sentence"}


def _num(x, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def _model_section(src: Source, name: str) -> list[str]:
    c = src.cfg
    step = "untrained (step 0, random initialisation)" if src.step == 0 else f"step {src.step}"
    return [
        f"# {name} — Shalik bundle",
        "",
        f"A small Bangla-first Llama-style causal language model trained with Shalik; this bundle holds checkpoint "
        f"`{src.ckpt.name}` ({step}), exported for CPU serving with onnxruntime, the Rust runtime or "
        "`transformers`.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {src.model.num_params():,} ({src.model.num_params(non_embedding=True):,} without the "
        "embedding) |",
        f"| layers / hidden / intermediate | {c.num_hidden_layers} / {c.hidden_size} / {c.intermediate_size} |",
        f"| attention heads / KV heads / head dim | {c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim} |",
        f"| context | {c.max_position_embeddings} tokens |",
        f"| vocabulary | {c.vocab_size} (byte-level BPE; `{EOT}` = {src.eot_id}, `{PAD}` = {src.pad_id}) |",
        f"| RoPE θ / RMSNorm ε | {c.rope_theta:g} / {c.rms_norm_eps:g} |",
        f"| tied embeddings | {'yes' if c.tie_word_embeddings else 'no'} |",
        f"| source | `{src.ckpt}` ({WEIGHTS} sha256 `{src.sha256[:16]}…`) |",
        "",
    ]


def _data_section(data: dict | None) -> list[str]:
    out = ["## Training data and licences", ""]
    if not data or not data.get("sources"):
        return out + ["The checkpoint records no data summary.", ""]
    out += ["| source | licence | documents | characters |", "|---|---|---:|---:|"]
    for s in data["sources"]:
        out.append(f"| {s.get('source', '?')} | {s.get('license') or 'unknown'} | {s.get('docs', 0):,} | "
                   f"{s.get('chars', 0):,} |")
    if data.get("tokens_seen") is not None:
        out += ["", f"Tokens seen in training: {data['tokens_seen']:,}."]
    out += ["", "Texts under share-alike licences (e.g. CC-BY-SA) require attribution; check each source's terms "
            "before redistributing generated text at scale.", ""]
    langs = data.get("languages") or {}
    if langs:
        out += ["## Tokenizer fertility", "", "NFC code points per token on the training corpus (higher is better).",
                "", "| language | documents | characters | tokens | chars / token |", "|---|---:|---:|---:|---:|"]
        for lang, v in langs.items():
            out.append(f"| {lang} | {v.get('docs', 0):,} | {v.get('chars', 0):,} | {v.get('tokens', 0):,} | "
                       f"{_num(v.get('chars_per_token'), '.2f')} |")
        out.append("")
    return out


def _eval_section(ev: dict | None, quant: dict | None) -> list[str]:
    out = ["## Evaluation", ""]
    if not ev or not ev.get("val"):
        out += ["No evaluation of this checkpoint was recorded by its run.", ""]
    else:
        ri = ev.get("random_init") or {}
        out += [f"Validation NLL (nats/token) and bits per character at step {ev.get('step')}, against the "
                "random-init twin (same architecture, untrained):", "",
                "| split | NLL | bits/char | random-init NLL | Δ NLL | tokens |", "|---|---:|---:|---:|---:|---:|"]
        for lang, v in ev["val"].items():
            r = ri.get(lang, {})
            delta = v["nll"] - r["nll"] if r.get("nll") is not None else None
            out.append(f"| {lang} | {_num(v.get('nll'))} | {_num(v.get('bpc'))} | {_num(r.get('nll'))} | "
                       f"{_num(delta, '+.3f')} | {v.get('tokens', 0):,} |")
        out.append("")
        out += _floor_section(ev)
    out += _quantization_section(quant)
    return out


def _floor_section(ev: dict) -> list[str]:
    """The model's bits per character on the whole validation split, per source file and language, beside what a
    compressor primed with the same training split needs for the same text (``train.compression``)."""
    val, floor = ev.get("val_sources"), ev.get("compression_floor")
    if not val or not floor:
        return []
    out = ["Against a compressor: bits per character on the whole validation split (lower is better) — this model "
           "beside PPMd (order 16) and xz (-9e), each primed with the same training split (`python -m "
           "train.compression`). A model above PPMd has learned less about this text than a 1990s compressor.", "",
           "| validation text | characters | this model | PPMd-16 | xz | model − PPMd |", "|---|---:|---:|---:|---:|---:|"]
    for key, f in floor.items():
        v = val.get(key)
        if v is None:
            continue
        out.append(f"| {key} | {v['chars']:,} | {_num(v['bpc'])} | {_num(f['ppmd16'])} | {_num(f['xz'])} | "
                   f"{_num(v['bpc'] - f['ppmd16'], '+.3f')} |")
    return out + [""]


def _quantization_section(quant: dict | None) -> list[str]:
    """The quality gate of the quantized forms (:mod:`export.gate`): which passed (the only ones a loader serves
    without ``allow_ungated``), one row per form and language with the continuation agreement, the thresholds as
    the rule states them."""
    forms = (quant or {}).get("forms") or {}
    if not forms:
        return []
    by_verdict = {v: [n for n, r in forms.items() if r.get("ok") is v] for v in (True, False, None)}
    out = [f"Quantized forms against float32 (`{ONNX}`), on the run's validation text "
           f"({(quant or {}).get('tokens', 0):,} tokens). `serve.load`, the server (`SHALIK_QUANTIZE`) and "
           "`rust_runtime.Model.load` serve a quantized form only when it passed; the others are refused unless "
           "`allow_ungated=True` (`SHALIK_ALLOW_UNGATED=1`). "
           + " ".join(f"{what}: {', '.join(f'`{n}`' for n in names)}." for what, names in
                      (("Passed", by_verdict[True]), ("Failed", by_verdict[False]),
                       ("Not measured", by_verdict[None])) if names), ""]
    if G.no_4bit_note(quant or {}):
        out += [f"**No 4-bit form passes the gate for this model** ({', '.join(n for n, r in forms.items() if r.get('bits') == 4)}): "
                "a model this small loses too much at 4 bits; serve it at q8_0 or float32.", ""]
    out += ["| form | file | language | Δ NLL | top-1 agreement with fp32 | mean abs Δ log p of fp32's top token | "
            "identical greedy continuations | gate |", "|---|---|---|---:|---:|---:|---:|---|"]
    conts = {}
    for name, r in forms.items():
        file = f"`{r['file']}`" if r.get("file") else "quantized at load"
        if r.get("ok") is None:
            out.append(f"| {name} | {file} | — | — | — | — | — | not measured: {r.get('note', '')} |")
            continue
        c = r.get("continuations") or {}
        if c:
            conts[(c["prompt_tokens"], c["new_tokens"])] = True
        by = c.get("by_lang") or {}
        total = (sum(v["identical"] for v in by.values()), sum(v["prompts"] for v in by.values()))
        for lang, v in {**r["by_lang"], "all": r["all"]}.items():
            k, n = (by[lang]["identical"], by[lang]["prompts"]) if lang in by else total if by and lang == "all" else (None, 0)
            out.append(f"| {name} | {file} | {lang} | {fmt_figure(v['delta'], signed=True)} | "
                       f"{fmt_figure(v['top1_agreement'])} | {fmt_figure(v['mean_abs_top_logprob_delta'])} | "
                       f"{'—' if k is None else f'{k} of {n}'} | {'pass' if v['ok'] else 'FAIL'} |")
    bits = sorted({(r["bits"], tuple(r["thresholds"].values())) for r in forms.values()}, reverse=True)
    out += [""] + [f"Gate at {b} bits: Δ NLL ≤ {fmt_limit(d)} nats/token, top-1 agreement ≥ {fmt_limit(t)}, mean abs "
                   f"Δ log p ≤ {fmt_limit(lp)} nats, for every language." for b, (d, t, lp) in bits]
    for pt, nt in conts:
        out.append(f"Identical greedy continuations (what a user sees at temperature 0; measured, not gated): of "
                   f"{G.PROMPTS_PER_LANG} prompts of {pt} validation tokens per language, how many continue for "
                   f"{nt} tokens exactly as float32 does.")
    return out + [""]


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _acc_cell(r: dict | None, key: str) -> str:
    if not r:
        return "—"
    lo, hi = r[f"{key}_ci"]
    return f"{_pct(r[key])} ({100 * lo:.1f}–{100 * hi:.1f})"


def read_eval_results(path: str | Path | None = None) -> dict | None:
    """``benchmarks/results/eval.json`` (or ``path``), or None when absent or unreadable."""
    try:
        return json.loads(Path(path or EVAL_RESULTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def find_eval_entry(results: dict | None, sha256: str | None, step: int | None) -> tuple[dict, dict | None] | None:
    """This checkpoint's entry in eval results (same model.safetensors sha256 and step) and its random-init twin's
    entry (or None), or None when the checkpoint was not evaluated."""
    models = (results or {}).get("models") or []
    mine = next((m for m in models if sha256 and (m.get("source") or {}).get("sha256") == sha256
                 and (m.get("source") or {}).get("step") == step), None)
    if mine is None:
        return None
    twin = next((m for m in models if mine.get("twin") and (m.get("source") or {}).get("sha256") == mine["twin"]), None)
    return mine, twin


def benchmark_section(sha256: str | None, step: int | None, results: dict | None) -> list[str]:
    """The next-sentence benchmark section (between :data:`EVAL_BEGIN` and :data:`EVAL_END`) for the checkpoint
    with this model.safetensors ``sha256`` and ``step``."""
    out = [EVAL_BEGIN, "## Next-sentence benchmark", ""]
    found = find_eval_entry(results, sha256, step)
    if found is None:
        return out + [
            "Shalik's own four-way next-sentence tasks (bn-next-sentence, en-next-sentence; built from the validation "
            "split, chance 25 %) have not been run on this checkpoint. Run `python benchmarks/eval.py BUNDLE [--twin "
            "TWIN_BUNDLE]`: it writes `benchmarks/results/eval.{md,json}` and puts the figures here.", "", EVAL_END, ""]
    mine, twin = found
    tasks = results.get("tasks") or {}
    out += [f"Which of four sentences follows a context from a validation document: the true next sentence, or one of "
            f"three of similar length from other validation documents (chance {_pct(results.get('chance', 0.25))}). "
            "Each choice is scored by its summed log-likelihood as a continuation of the context (lm-evaluation-"
            "harness's `acc`) and per character (`acc_norm`); 95 % Wilson intervals in brackets"
            + (f"; the random-init twin is `{twin.get('name')}` (same shape, untrained)" if twin else "")
            + ". The word-overlap column is no model: it picks the choice sharing most words with the context, "
            "showing how much the context gives away to a model that reads it.", "",
            "| task | items | acc | acc_norm | random-init acc | random-init acc_norm | word overlap | chance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    overlap = (results.get("baselines") or {}).get("word_overlap") or {}
    for task, r in (mine.get("results") or {}).items():
        t = (twin or {}).get("results", {}).get(task)
        out.append(f"| {TASK_TITLES.get(task, task)} | {r['n']} | {_acc_cell(r, 'acc')} | {_acc_cell(r, 'acc_norm')} "
                   f"| {_acc_cell(t, 'acc')} | {_acc_cell(t, 'acc_norm')} | {_acc_cell(overlap.get(task), 'acc')} "
                   f"| {_pct(results.get('chance', 0.25))} |")
    seeds = sorted({str(v.get("seed")) for v in tasks.values()})
    out += ["", f"Tasks: `benchmarks/eval_tasks/` (seed {', '.join(seeds)}); figures from "
            f"`benchmarks/results/eval.json` ({results.get('created', '?')}). The same items run through "
            "lm-evaluation-harness's `local-completions` against `uvicorn serve.app:app` with "
            "`--include_path benchmarks/eval_tasks`.", "", EVAL_END, ""]
    return out


def refresh_card(bundle: str | Path, results_path: str | Path | None = None) -> bool:
    """Rewrite the benchmark section of ``bundle``'s README.md from eval results (default
    ``benchmarks/results/eval.json``), and the card's sha256 and size in ``manifest.json``. Returns True when the
    card changed. A card without the section (written before it existed) gets it before "## Limits"."""
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    source = manifest.get("source") or {}
    card_path = bundle / CARD
    card = card_path.read_text(encoding="utf-8")
    section = "\n".join(benchmark_section(source.get("sha256"), source.get("step"), read_eval_results(results_path)))
    if EVAL_BEGIN in card and EVAL_END in card:
        head, rest = card.split(EVAL_BEGIN, 1)
        tail = rest.split(EVAL_END, 1)[1].lstrip("\n")
        new = head + section + tail
    elif "## Limits" in card:
        head, tail = card.split("## Limits", 1)
        new = head + section + "## Limits" + tail
    else:
        new = card.rstrip("\n") + "\n\n" + section
    if new == card:
        return False
    atomic_write_text(card_path, new)
    rehash(bundle, [CARD])
    return True


def _limits_section(src: Source) -> list[str]:
    return [
        "## Limits",
        "",
        f"- A small model ({src.model.num_params() / 1e6:.1f} M parameters) trained on a small corpus: it continues "
        "text, it does not follow instructions, and what it writes is often wrong, repetitive or nonsensical.",
        "- Trained on Bangla and English only; other languages and scripts tokenize poorly.",
        f"- Context of {src.cfg.max_position_embeddings} tokens; the runtimes refuse longer sequences.",
        "- It reproduces the biases of its sources (Wikipedia, public-domain literature, poetry); do not use it for "
        "decisions about people.",
        "",
    ]


def _usage_section(bundle_name: str, onnx_schemes: list[str]) -> list[str]:
    q = f', quantize="{onnx_schemes[0]}"' if onnx_schemes else ""
    return [
        "## Usage",
        "",
        "Python (onnxruntime, no torch):",
        "",
        "```python",
        "from serve import load",
        f'lm = load("{bundle_name}", backend="onnx"{q})   # or backend="rust"',
        'print(lm.generate("আমি বাংলায় গান গাই", max_new_tokens=32, temperature=0))',
        'print(lm.score("বাংলা আমার মাতৃভাষা").nll_mean)',
        "```",
        "",
        "HTTP (OpenAI-style completions):",
        "",
        "```sh",
        f"SHALIK_MODEL={bundle_name} uvicorn serve.app:app --port 8000",
        "curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\",
        "     -d '{\"prompt\": \"আমি বাংলায়\", \"max_tokens\": 32, \"temperature\": 0}'",
        "```",
        "",
        "transformers:",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("{bundle_name}")',
        f'model = AutoModelForCausalLM.from_pretrained("{bundle_name}", dtype=torch.float32)',
        f'ids = tok("{EOT}আমি বাংলায়", return_tensors="pt").input_ids',
        "print(tok.decode(model.generate(ids, max_new_tokens=32, do_sample=False)[0]))",
        "```",
        "",
        f"Every prompt starts with `{EOT}`, as every training document did (`serve` adds it).",
        "",
    ]


def _runtimes_section(bundle_name: str, src: Source) -> list[str]:
    """Default sampling and how to run the bundle in llama.cpp, Ollama and LM Studio (GGUF)."""
    d = sampling_defaults(src.ckpt)
    how = ("greedy (temperature 0)" if d["temperature"] == 0 else
           f"temperature {d['temperature']:g}, top-k {d['top_k'] or 'off'}, top-p {d['top_p']:g}, repetition "
           f"penalty {d['repetition_penalty']:g}")
    out = ["## Default sampling and other runtimes", "",
           f"Default sampling (`generation_config.json`; `python -m serve.generate` uses it): {how}, at most "
           f"{d['max_new_tokens']} new tokens. The `{MODELFILE}` that `python -m export.gguf` writes gives Ollama "
           "the same.", ""]
    tokenizer_json = src.read_json(TOKENIZER)
    split = identify(tokenizer_json) if tokenizer_json else None
    if split is None or not split.name:
        return out + ["This bundle's tokenizer splits text in a way llama.cpp has no name for (Shalik tokenizer "
                      "format 2), so its GGUF (`python -m export.gguf BUNDLE --approximate-pretokenizer`) must "
                      "be fed the token ids of `tokenizer.json`, not text.", ""]
    return out + [
        f"The tokenizer splits text exactly as llama.cpp's `{split.name}` pre-tokenizer, so a GGUF of this bundle "
        "tokenizes text as training did in llama.cpp, Ollama and LM Studio (a llama.cpp older than August 2026 "
        "differs only where `~` touches a non-ASCII letter):",
        "",
        "```sh",
        f"python -m export.gguf {bundle_name} --type q8_0        # model-q8_0.gguf and a {MODELFILE}",
        f"ollama create shalik -f {bundle_name}/{MODELFILE} && ollama run shalik \"আমি বাংলায়\"",
        f"llama-server -m {bundle_name}/model-q8_0.gguf --port 8080   # POST /completion",
        "```",
        "",
        "**Normalise input to Unicode NFC** in those runtimes (Python: `unicodedata.normalize(\"NFC\", text)`): "
        "they apply no normalisation, and Bangla has two spellings of ড় ঢ় য় and of ো ৌ, while the model saw NFC "
        "only; text in another form tokenizes into pieces it never saw. Shalik's own runtimes (`serve.load`, the "
        "server, `rust_runtime`) normalise for you. LM Studio: import the GGUF, choose no prompt template and "
        "`<|endoftext|>` as the stop string.",
        "",
    ]


def render_card(src: Source, bundle_name: str, manifest: dict, eval_results: str | Path | None = None) -> str:
    """The model card as Markdown. ``manifest`` supplies exporter, opset, dtype, parity, quantization, eval
    and data;
    ``bundle_name`` is the path shown in the usage examples; ``eval_results`` is the benchmark results file
    (default ``benchmarks/results/eval.json``)."""
    name = src.run_dir.name if src.run_dir is not None else src.ckpt.name
    parity = manifest.get("parity") or {}
    cases = parity.get("cases") or []
    lines = _model_section(src, name)
    lines += _data_section(manifest.get("data"))
    lines += _eval_section(manifest.get("eval"), manifest.get("quantization"))
    lines += benchmark_section(src.sha256, src.step, read_eval_results(eval_results))
    lines += _limits_section(src)
    lines += _usage_section(bundle_name, [r["scheme"] for r in ((manifest.get("quantization") or {}).get("forms")
                                                                 or {}).values() if r.get("runtime") == "onnx"])
    lines += _runtimes_section(bundle_name, src)
    lines += ["## Files and parity", "",
              f"`{ONNX}` (+ `{external_data(ONNX)}`) was exported by the {manifest.get('exporter')} exporter at opset "
              f"{manifest.get('opset')} in {manifest.get('dtype')}; `{WEIGHTS}` is the checkpoint's file. "
              "Parity against the PyTorch checkpoint (float32 logits within atol = rtol = "
              f"{parity.get('tol', 1e-4):g}; greedy continuations token for token, except at a near-tie, a top-2 "
              "gap under 1e-3):", ""]
    if cases:
        lines += [format_table(cases, markdown=True), ""]
    else:
        lines += ["The parity gate was skipped (`--no-parity`): this bundle is **unchecked**.", ""]
    lines += [f"Gate: **{'passed' if parity.get('ok') else 'skipped' if not cases else 'FAILED'}**. "
              f"`{MANIFEST}` lists every file's sha256 and the library versions.", ""]
    return "\n".join(lines)


def write_card(path: Path, text: str) -> None:
    """Write the card (UTF-8) atomically."""
    atomic_write_text(path, text)
