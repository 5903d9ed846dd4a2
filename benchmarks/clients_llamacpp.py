"""llama.cpp as a client of the bundle: the GGUF that ``python -m export.gguf BUNDLE`` writes, loaded in
llama-cpp-python, continues our token ids greedily with llama.cpp's own sampler, and the continuation must equal
``serve.load(BUNDLE).complete(..., temperature=0)``'s token for token.

llama.cpp gets ``<|endoftext|>`` + our token ids (its pre-tokenizer differs from ours, see export/gguf.py, so no
text goes through its tokenizer) and generates with ``top_k=1, temp=0`` and no repetition penalty; both sides
make exactly ``--new-tokens`` tokens, going on past ``<|endoftext|>`` (``ignore_eos`` on our side), so every step
is compared. Beside it, the teacher-forced log-probs of the prompt's own tokens are compared (max |Δ|, nats):
greedy text from a weak model can be degenerate, the prompt's log-probs are not. A mismatch is allowed only at a near-tie — the reference's (our bundle's)
top-2 logit gap below 1e-3 at that step (docs/design.md) — where the comparison stops and says so. The model is
opened through ``serve.backends.llamacpp.LlamaCppBackend`` only for its machine-specific load settings (float32 KV cache, no
extra buffer types); generation is llama-cpp-python's ``Llama.generate``.

Prints one line per prompt and exits 0 when all agree (up to near-ties), 1 on a real mismatch, 2 when
llama-cpp-python or the GGUF exporter is missing. Benchmark-side: not part of the test suite.

    python benchmarks/clients_llamacpp.py [BUNDLE] [--type f32|f16|q8_0] [--gguf FILE] [--new-tokens 32]
                                          [--prompt TEXT ...] [--threads N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NEAR_TIE = 1e-3
PROMPTS = ["বাংলা ভাষা দক্ষিণ এশিয়ার একটি ইন্দো-আর্য ভাষা।", "আমি বাংলায় গান গাই।",
           "The river runs through the old town, and the boats come in at dusk."]


def ensure_gguf(bundle: Path, kind: str, gguf: Path | None) -> Path:
    """The GGUF to load: ``gguf`` when given, else ``BUNDLE/model-<kind>.gguf``, written by ``python -m export.gguf``
    when absent."""
    path = gguf or bundle / f"model-{kind}.gguf"
    if not path.is_file():
        subprocess.run([sys.executable, "-m", "export.gguf", str(bundle), "--type", kind, "--out", str(path), "--approximate-pretokenizer"],
                       cwd=ROOT, check=True)
    return path


def llama_greedy(llm, ids: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of ``ids``: ``new_tokens`` tokens, going on past ``<|endoftext|>``."""
    llm.reset()
    out: list[int] = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) == new_tokens:
            break
    return out


def llama_prompt_logprobs(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's log-probs of ``ids[1:]``, each predicted from the ids before it (needs ``logits_all``)."""
    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
    logp = scores - scores.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def first_divergence(reference: list[int], other: list[int], gaps: list[float]) -> tuple[int | None, bool]:
    """(first differing step or None, whether it is a near-tie of the reference)."""
    for step in range(max(len(reference), len(other))):
        a = reference[step] if step < len(reference) else None
        b = other[step] if step < len(other) else None
        if a != b:
            return step, step < len(gaps) and gaps[step] < NEAR_TIE
    return None, False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bundle", nargs="?", default=str(ROOT / "runs" / "small" / "bundle"))
    p.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0"], help="GGUF weight type")
    p.add_argument("--gguf", default=None, help="use this GGUF file instead of BUNDLE/model-<type>.gguf")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt", nargs="+", default=PROMPTS)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401

        from serve.backends.llamacpp import LlamaCppBackend
    except ImportError as e:
        print(f"cannot run: {e} (pip install llama-cpp-python; the GGUF exporter is export/gguf.py)", file=sys.stderr)
        return 2
    from serve import load

    bundle = Path(a.bundle)
    lm = load(bundle, threads=a.threads)
    path = ensure_gguf(bundle, a.type, Path(a.gguf) if a.gguf else None)
    llm = LlamaCppBackend(path, threads=a.threads, n_ctx=lm.context_length, logits_all=True).llm
    print(f"llama-cpp-python {llama_cpp.__version__} on {path} ({a.type}) vs serve (onnx) on {bundle}; "
          f"{a.new_tokens} greedy tokens")
    failed = 0
    for prompt in a.prompt:
        ids = lm.tokenize(prompt)
        ours = lm.complete(ids, a.new_tokens, temperature=0, top_logprobs=2, ignore_eos=True)
        gaps = [v[0] - v[1] if len(v) > 1 else float("inf")
                for v in (sorted(t.values(), reverse=True) for t in ours.top_logprobs)]
        theirs = llama_greedy(llm, [lm.eot_id, *ids], a.new_tokens)
        step, tie = first_divergence(ours.token_ids, theirs, gaps)
        ours_lp = -np.asarray(lm.score(ids).token_nll)
        delta = float(np.abs(llama_prompt_logprobs(llm, [lm.eot_id, *ids]) - ours_lp).max())
        if step is None:
            verdict = f"identical ({len(theirs)} tokens)"
        elif tie:
            verdict = f"agree for {step} tokens, then part at a near-tie (our top-2 gap {gaps[step]:.1e} < {NEAR_TIE})"
        else:
            failed += 1
            verdict = (f"MISMATCH at step {step}: ours {ours.token_ids[step:step + 3]}, llama.cpp {theirs[step:step + 3]}"
                       f" (our top-2 gap {gaps[step] if step < len(gaps) else float('nan'):.2e})")
        print(f"  {prompt[:40]!r}: {verdict}; prompt log-probs max |Δ| {delta:.1e}\n    ours:      {ours.text!r}\n    llama.cpp: {lm.detokenize(theirs)!r}")
    print("result: " + ("all agree" if not failed else f"{failed} of {len(a.prompt)} prompts differ"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
