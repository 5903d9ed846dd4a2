"""The parity gate: the bundle must compute what the checkpoint computes, in every runtime that serves it.

Reference: our PyTorch model (float32), logits of one single-shot forward without a cache. Cases (docs/design.md,
"Testing habits"; cases X1–X6 of docs/cases.md):

* logits, batch 1, through the runtime's own Sequence (``prefill``/``decode``, the serving path): prefill of 1, 7,
  64 tokens and of the full context with an empty past; decode with past 1 and 17 and at the last three
  positions of the context. Pass when ``|got - ref| <= atol + rtol·|ref|`` everywhere (fp32: atol = rtol = 1e-4).
* logits, batch 2 with left padding (rows of 12 and 5 tokens; attention_mask, per-row position ids), prefill plus
  3 decode steps, compared over real positions with each row's unpadded logits (ONNX only: batched ``forward``).
* greedy continuations of 32 tokens for three Bangla and two English prompts: token for token, except at a
  near-tie (the reference's top-2 logit gap below 1e-3), where the comparison stops and says so.
* the bundle's model.safetensors: same tensors, bit for bit, as the checkpoint's; one key for the tied matrix;
  reloads tied with logits within 1e-6 (X5). transformers ``AutoModelForCausalLM`` / ``AutoTokenizer`` load the
  folder unchanged: tied, same rope_theta, logits within 1e-4 up to position 127 (X6), same token ids.
* the Rust runtime (``rust_runtime.Model``) when importable: the batch-1 logits cases and the greedy prompts.

Every case is a row ``{runtime, case, value, tol, ok, detail}``; :func:`format_table` prints them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from tokenizers import Tokenizer

from contract.bundle import ONNX, TOKENIZER, WEIGHTS
from serve.backends.onnx import OnnxBackend
from serve.verdict import fmt_figure, fmt_limit
from train.components.checkpoint import load_weights
from train.model import LlamaForCausalLM

FP32_TOL = 1e-4
FP16_TOL = 5e-2          # float16 ONNX weights and cache against the float32 reference (atol = rtol)
TIED_TOL = 1e-6          # X5: our model reloaded from the bundle's safetensors
NEAR_TIE = 1e-3          # top-2 logit gap below which a greedy mismatch is a tie, not an error
GREEDY_TOKENS = 32
PREFILL_LENGTHS = (1, 7, 64)
DECODE_PASTS = (1, 17)
PAD_ROWS = (12, 5)       # real tokens per row of the left-padded batch
PAD_DECODE_STEPS = 3
PROMPTS = (
    ("bn", "আমি বাংলায় গান গাই"),
    ("bn", "বাংলাদেশের রাজধানী ঢাকা একটি"),
    ("bn", "একদা এক রাজা ছিলেন, তাঁর"),
    ("en", "The history of the river"),
    ("en", "Once upon a time, there was"),
)


@dataclass
class Case:
    """One row of the parity table. ``value``: max |Δlogit| (logits cases) or tokens compared (greedy)."""

    runtime: str
    case: str
    value: float | None
    tol: float | None
    ok: bool
    detail: str = ""
    rule: str | None = None  # a quality-gate row: "<=" or ">=" its threshold (printed at the rule's precision)

    def as_dict(self) -> dict:
        """The row as a JSON-ready dict (manifest.json's ``parity.cases``)."""
        return asdict(self)


class TorchSequence:
    """Our PyTorch model behind the serving Sequence protocol (``prefill``/``decode``/``position``), with its
    own KV cache: the greedy reference."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.past = None
        self.position = 0

    @torch.no_grad()
    def prefill(self, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """float32 logits ``[len(ids), V]`` or ``[V]`` (the last position)."""
        n = len(ids)
        pos = torch.arange(self.position, self.position + n)[None]
        logits, self.past = self.model(torch.tensor([ids]), position_ids=pos, past_key_values=self.past,
                                       use_cache=True)
        self.position += n
        out = logits[0].float().numpy()
        return out if all_logits else out[-1]

    def decode(self, token_id: int) -> np.ndarray:
        """One cached step; float32 logits ``[V]``."""
        return self.prefill([int(token_id)])


@torch.no_grad()
def reference_logits(model: LlamaForCausalLM, ids: list[int]) -> np.ndarray:
    """float32 ``[len(ids), V]`` from one forward without a cache (the independent reference)."""
    return model(torch.tensor([ids]))[0][0].float().numpy()


def max_diff(ref: np.ndarray, got: np.ndarray, atol: float, rtol: float) -> tuple[float, bool]:
    """(max |got - ref|, every element within ``atol + rtol·|ref|`` and finite). Shapes must agree."""
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if ref.shape != got.shape:
        return float("inf"), False
    d = np.abs(got - ref)
    if not np.all(np.isfinite(got)):
        return float("inf"), False
    return float(d.max(initial=0.0)), bool(np.all(d <= atol + rtol * np.abs(ref)))


def probe_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """``n`` reproducible ids in ``[2, vocab_size)`` (no special tokens) for the logits cases."""
    rng = np.random.default_rng(seed)
    return rng.integers(2, max(3, vocab_size), size=n).tolist()


def _guard(runtime: str, name: str, tol: float | None, fn: Callable[[], Case]) -> Case:
    """Run one case; an exception from the runtime is a failed case that says what was raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any runtime error is a parity failure, reported in the table
        return Case(runtime, name, None, tol, False, f"{type(e).__name__}: {e}"[:300])


def sequence_logits_cases(runtime: str, new_sequence: Callable[[], object], ids: list[int], ref: np.ndarray,
                          tol: float) -> list[Case]:
    """Batch-1 prefill and decode cases through a Sequence factory; ``ref`` = reference logits of ``ids``
    (``[ctx, V]``, ``ids`` as long as the context)."""
    ctx = len(ids)
    cases = []

    def prefill(n: int) -> Case:
        got = new_sequence().prefill(ids[:n], all_logits=True)
        d, ok = max_diff(ref[:n], got, tol, tol)
        return Case(runtime, _prefill_label(n, ctx), d, tol, ok)

    def decode(past: int, steps: int, label: str) -> Case:
        seq = new_sequence()
        seq.prefill(ids[:past])
        got = np.stack([seq.decode(ids[past + k]) for k in range(steps)])
        d, ok = max_diff(ref[past:past + steps], got, tol, tol)
        return Case(runtime, label, d, tol, ok)

    for n in sorted({min(n, ctx) for n in PREFILL_LENGTHS} | {ctx}):
        cases.append(_guard(runtime, _prefill_label(n, ctx), tol, lambda n=n: prefill(n)))
    for past in DECODE_PASTS:
        if past + 1 <= ctx:
            cases.append(_guard(runtime, f"decode past {past}", tol,
                                lambda p=past: decode(p, 1, f"decode past {p}")))
    last = min(3, ctx - 1)
    if last > 0:
        label = f"decode positions {ctx - last}..{ctx - 1} (context end)"
        cases.append(_guard(runtime, label, tol, lambda: decode(ctx - last, last, label)))
    return cases


def _prefill_label(n: int, ctx: int) -> str:
    return f"prefill {n} (past 0{', full context' if n == ctx else ''})"


def padded_batch_case(runtime: str, forward: Callable, model: LlamaForCausalLM, ids: list[int], pad_id: int,
                      tol: float) -> Case:
    """Left-padded batch of two rows through ``forward(input_ids, attention_mask, position_ids, past) ->
    (logits, presents)`` (numpy), prefill then decode steps, against each row's unpadded reference (X4)."""
    name = f"batch 2, left padding ({PAD_ROWS[0]} and {PAD_ROWS[1]} tokens) + {PAD_DECODE_STEPS} decode steps"

    def run() -> Case:
        width = max(PAD_ROWS)
        span = max(PAD_ROWS) + PAD_DECODE_STEPS
        rows = [ids[k * span:k * span + n + PAD_DECODE_STEPS] for k, n in enumerate(PAD_ROWS)]
        x = np.full((2, width), pad_id, dtype=np.int64)
        mask = np.zeros((2, width), dtype=np.int64)
        for r, n in enumerate(PAD_ROWS):
            x[r, width - n:] = rows[r][:n]
            mask[r, width - n:] = 1
        pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
        logits, past = forward(x, mask, pos, None)
        outs = [logits]
        for k in range(PAD_DECODE_STEPS):
            nxt = np.array([[rows[r][n + k]] for r, n in enumerate(PAD_ROWS)], dtype=np.int64)
            mask = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
            pos = pos[:, -1:] + 1
            logits, past = forward(nxt, mask, pos, past)
            outs.append(logits)
        got = np.concatenate(outs, axis=1)          # [2, width + steps, V]
        worst, ok = 0.0, True
        for r, n in enumerate(PAD_ROWS):
            ref = reference_logits(model, rows[r])  # [n + steps, V]
            d, o = max_diff(ref, got[r, width - n:], tol, tol)
            worst, ok = max(worst, d), ok and o
        return Case(runtime, name, worst, tol, ok)

    return _guard(runtime, name, tol, run)


def greedy(seq, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy ``n`` tokens (ties → lowest id, no stop token) from a Sequence; returns the tokens and the top-2
    logit gap at each step."""
    logits = seq.prefill(prompt)
    tokens, gaps = [], []
    for _ in range(n):
        lg = np.asarray(logits, dtype=np.float64)
        tok = int(np.argmax(lg))
        top2 = np.partition(lg, -2)[-2:] if lg.size > 1 else np.array([lg[0], -np.inf])
        tokens.append(tok)
        gaps.append(float(top2[1] - top2[0]))
        if len(tokens) == n:
            break
        logits = seq.decode(tok)
    return tokens, gaps


def compare_greedy(ref: list[int], gaps: list[float], got: list[int], near_tie: float) -> tuple[bool, int, str]:
    """(ok, tokens compared, detail): identical, or the first mismatch falls on a reference near-tie."""
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            if gaps[i] < near_tie:
                return True, i, f"near-tie at token {i} (top-2 gap {gaps[i]:.1e}); compared up to there"
            return False, i, f"token {i}: reference {a}, got {b} (top-2 gap {gaps[i]:.3g})"
    if len(got) != len(ref):
        return False, min(len(got), len(ref)), f"{len(got)} tokens, reference {len(ref)}"
    return True, len(ref), ""


@dataclass
class GreedyRef:
    """The reference continuations: per prompt (lang, text, prompt ids, tokens, gaps)."""

    items: list[tuple[str, str, list[int], list[int], list[float]]]


def greedy_reference(model: LlamaForCausalLM, tokenizer_path: Path, eot_id: int) -> GreedyRef:
    """Encode the prompts as ``<|endoftext|>`` + prompt (docs/design.md) and continue them greedily in PyTorch."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    ctx = model.config.max_position_embeddings
    items = []
    with torch_threads(1):
        for lang, text in PROMPTS:
            ids = ([eot_id] + tok.encode(text).ids)[:max(1, ctx - 1)]
            n = min(GREEDY_TOKENS, ctx - len(ids))
            tokens, gaps = greedy(TorchSequence(model), ids, n)
            items.append((lang, text, ids, tokens, gaps))
    return GreedyRef(items)


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with ``n`` torch threads, then restore. One-token decode steps are tiny ops: on shared cores
    OpenMP's barriers make two threads 10-50x slower than one (notes/export-facts.md, speed figures)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def greedy_cases(runtime: str, new_sequence: Callable[[], object], ref: GreedyRef, near_tie: float) -> list[Case]:
    """One case per prompt: the runtime's greedy continuation against the reference's."""
    cases = []
    for lang, text, ids, tokens, gaps in ref.items:
        name = f"greedy {len(tokens)} tokens, {lang}: {text[:24]}"

        def run(ids=ids, tokens=tokens, gaps=gaps, name=name) -> Case:
            got, _ = greedy(new_sequence(), ids, len(tokens))
            ok, n, detail = compare_greedy(tokens, gaps, got, near_tie)
            return Case(runtime, name, float(n), None, ok, detail or f"{n}/{len(tokens)} identical")

        cases.append(_guard(runtime, name, None, run))
    return cases


def onnx_cases(bundle: Path, model: LlamaForCausalLM, pad_id: int, greedy_ref: GreedyRef, dtype: str = "float32",
               model_file: str = ONNX, runtime: str = "onnx") -> list[Case]:
    """Every ONNX case (batch-1 logits, padded batch, greedy) through serve's OnnxBackend on ``bundle``;
    ``runtime`` labels the rows."""
    tol = FP32_TOL if dtype == "float32" else FP16_TOL
    near_tie = NEAR_TIE if dtype == "float32" else 2 * FP16_TOL
    try:
        be = OnnxBackend(bundle, model_file=model_file)
    except Exception as e:  # noqa: BLE001 - a graph onnxruntime cannot load fails the gate
        return [Case(runtime, "load", None, None, False, f"{type(e).__name__}: {e}"[:300])]
    ctx = model.config.max_position_embeddings
    ids = probe_ids(model.config.vocab_size, ctx)
    ref = reference_logits(model, ids)
    cases = sequence_logits_cases(runtime, be.new_sequence, ids, ref, tol)
    if ctx >= len(PAD_ROWS) * (max(PAD_ROWS) + PAD_DECODE_STEPS):
        cases.append(padded_batch_case(runtime, be.forward, model, ids, pad_id, tol))
    return cases + greedy_cases(runtime, be.new_sequence, greedy_ref, near_tie)


def safetensors_cases(bundle: Path, ckpt: Path, model: LlamaForCausalLM) -> list[Case]:
    """The bundle's weights equal the checkpoint's bit for bit, store a tied matrix once and reload tied (X5)."""
    def same_bits() -> Case:
        a = safetensors.torch.load_file(str(ckpt / WEIGHTS))
        b = safetensors.torch.load_file(str(bundle / WEIGHTS))
        if set(a) != set(b):
            return Case("safetensors", "weights equal the checkpoint's", None, 0.0, False,
                        f"tensor names differ: {sorted(set(a) ^ set(b))[:4]}")
        bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
        tied_ok = not model.config.tie_word_embeddings or "lm_head.weight" not in b
        detail = f"{len(b)} tensors" + ("" if tied_ok else "; lm_head.weight stored although tied")
        return Case("safetensors", "weights equal the checkpoint's (bit for bit)", float(len(bad)), 0.0,
                    not bad and tied_ok, detail + (f"; differ: {bad[:3]}" if bad else ""))

    def reload() -> Case:
        m = LlamaForCausalLM(model.config)
        load_weights(m, bundle / WEIGHTS)
        m.eval()
        tied = (not model.config.tie_word_embeddings) or m.lm_head.weight is m.model.embed_tokens.weight
        ids = probe_ids(model.config.vocab_size, min(64, model.config.max_position_embeddings), seed=1)
        d, ok = max_diff(reference_logits(model, ids), reference_logits(m, ids), TIED_TOL, 0.0)
        return Case("safetensors", "reload into our model (tied)", d, TIED_TOL, ok and tied,
                    "tied" if tied else "lm_head NOT tied after reload")

    return [_guard("safetensors", "weights equal the checkpoint's (bit for bit)", 0.0, same_bits),
            _guard("safetensors", "reload into our model (tied)", TIED_TOL, reload)]


def transformers_cases(bundle: Path, model: LlamaForCausalLM, tokenizer_path: Path) -> list[Case]:
    """``AutoModelForCausalLM`` and ``AutoTokenizer`` load the bundle unchanged and agree with us."""
    import transformers  # deferred: seconds to import, and only the gate's transformers cases need it

    def lm() -> Case:
        transformers.utils.logging.disable_progress_bar()
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(bundle), dtype=torch.float32)
        finally:
            transformers.utils.logging.enable_progress_bar()
        hf.eval()
        c = model.config
        notes = []
        tied_ok = (not c.tie_word_embeddings) or (
            hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr())
        if not tied_ok:
            notes.append("lm_head not tied")
        theta = (getattr(hf.config, "rope_parameters", None) or {}).get("rope_theta")
        theta_ok = theta is not None and abs(float(theta) - c.rope_theta) <= 1e-6 * c.rope_theta
        if not theta_ok:
            notes.append(f"rope_theta {theta}, expected {c.rope_theta}")
        n = min(128, c.max_position_embeddings)
        ids = probe_ids(c.vocab_size, n, seed=2)
        with torch.no_grad():
            got = hf(torch.tensor([ids])).logits[0].float().numpy()
        d, ok = max_diff(reference_logits(model, ids), got, FP32_TOL, FP32_TOL)
        return Case("transformers", f"AutoModelForCausalLM logits, positions 0..{n - 1}", d, FP32_TOL,
                    ok and tied_ok and theta_ok, "; ".join(notes) or f"tied, rope_theta {theta}")

    def tok() -> Case:
        ours = Tokenizer.from_file(str(tokenizer_path))
        hf = transformers.AutoTokenizer.from_pretrained(str(bundle))
        bad = [t for _, t in PROMPTS if hf(t, add_special_tokens=False)["input_ids"] != ours.encode(t).ids]
        return Case("transformers", f"AutoTokenizer ids equal {TOKENIZER}'s", float(len(bad)), 0.0, not bad,
                    f"differ on {bad[:2]}" if bad else f"{len(PROMPTS)} prompts")

    return [_guard("transformers", "AutoModelForCausalLM logits", FP32_TOL, lm),
            _guard("transformers", "AutoTokenizer ids", 0.0, tok)]


def rust_available() -> bool:
    """``rust_runtime`` importable and exposing ``Model``."""
    try:
        import rust_runtime  # deferred: an optional extension, absent where it was not built
    except ImportError:
        return False
    return hasattr(rust_runtime, "Model")


def rust_cases(bundle: Path, model: LlamaForCausalLM, greedy_ref: GreedyRef) -> list[Case]:
    """The batch-1 logits cases and the greedy prompts through ``rust_runtime.Model`` (fp32)."""
    import rust_runtime  # deferred: optional (rust_available() said it is there)

    try:
        # the gate runs before the manifest is written (last), on the files it has just made: nothing to verify
        rm = rust_runtime.Model.load(str(bundle), threads=None, quantize=None, verify=False)
    except Exception as e:  # noqa: BLE001 - a bundle the Rust runtime cannot load fails the gate
        return [Case("rust", "load", None, None, False, f"{type(e).__name__}: {e}"[:300])]
    ctx = model.config.max_position_embeddings
    ids = probe_ids(model.config.vocab_size, ctx)
    ref = reference_logits(model, ids)
    return (sequence_logits_cases("rust", rm.new_sequence, ids, ref, FP32_TOL)
            + greedy_cases("rust", rm.new_sequence, greedy_ref, NEAR_TIE))


def all_ok(cases: Iterable[Case]) -> bool:
    """True when there is at least one case and every case passed."""
    cases = list(cases)
    return bool(cases) and all(c.ok for c in cases)


def _fmt_value(c: Case) -> str:
    if c.value is None:
        return "—"
    if c.rule is not None:
        return fmt_figure(c.value, c.tol)
    if c.case.startswith("greedy"):
        return f"{int(c.value)} tok"
    return f"{c.value:.2e}" if c.value else "0"


def _fmt_tol(c: Case) -> str:
    if c.tol is None:
        return "—"
    if c.rule is not None:  # a quality-gate threshold, as the rule states it (≥ 0.85, ≤ 0.10)
        return f"{'≤' if c.rule == '<=' else '≥'} {fmt_limit(c.tol)}"
    return f"{c.tol:.0e}" if c.tol else "exact"


def format_table(cases: Iterable[Case | dict], markdown: bool = False) -> str:
    """The parity table as aligned text (or a Markdown table): runtime, case, max |Δlogit| or tokens, tol, ok."""
    rows = [c if isinstance(c, Case) else Case(**c) for c in cases]
    head = ("runtime", "case", "max |Δ| / tokens", "tol", "ok", "detail")
    body = [(c.runtime, c.case, _fmt_value(c), _fmt_tol(c), "ok" if c.ok else "FAIL", c.detail) for c in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r).replace("\n", " ") + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*r).rstrip() for r in [head, *body])
