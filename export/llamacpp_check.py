"""Checks through llama.cpp itself (llama-cpp-python, the ``bench`` extra) that a GGUF tokenizes and generates as
the bundle does: the benchmark ``benchmarks/llamacpp_parity.py`` and the slow tests call these.

* :func:`token_agreement` — llama.cpp's token ids (``llama_tokenize``, ``parse_special`` as llama-server and
  Ollama tokenize prompts, no BOS) against the bundle's ``tokenizer.json`` on texts, NFC-normalised first or raw;
* :func:`greedy_text_agreement` — text in, text out: llama.cpp's own completion (it tokenizes the prompt, adds the
  GGUF's BOS ``<|endoftext|>``, samples greedily, stops at end-of-text, detokenizes) against
  ``serve.load(bundle).complete(prompt, temperature=0)``; a difference is a near-tie when the bundle's top-2
  log-probs at the first differing token are closer than ``near_tie`` nats.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["GREEDY_PROMPTS", "TokenAgreement", "GreedyResult", "token_agreement", "greedy_text_agreement"]

# Ten prompts per language for the text-in/text-out check: prose, digits, quotes, a joiner, a nukta;
# NFC, as llama.cpp must be given.
GREEDY_PROMPTS: list[tuple[str, str]] = [("bn", unicodedata.normalize("NFC", t)) for t in (
    "আমি বাংলায় গান গাই",
    "বাংলাদেশের রাজধানী ঢাকা একটি",
    "একদা এক রাজা ছিলেন, তাঁর",
    "রবীন্দ্রনাথ ঠাকুর ১৮৬১ সালে",
    "নদীর ধারে একটি ছোট গ্রাম",
    "সে বলল, \"আমি কাল আসব।\"",
    "বর্ষাকালে আকাশ মেঘে ঢাকা থাকে এবং",
    "র\u200d্যাব বাহিনী গঠিত হয়",
    "পড়াশোনা শেষ করে সে",
    "১৯৭১ সালের ২৬শে মার্চ",
)] + [("en", t) for t in (
    "The history of the river",
    "Once upon a time, there was",
    "It was a dark and stormy night",
    "In 1861, the city of",
    "She opened the letter and read",
    "The old man said, \"I will come tomorrow.\"",
    "During the rainy season the sky",
    "The capital of Bangladesh is",
    "He walked along the road until",
    "Chapter 1. The",
)]


@dataclass
class TokenAgreement:
    """``equal`` of ``total`` texts got the same ids; ``tokens`` / ``tokens_llama_cpp``: summed lengths;
    ``differences``: up to 5 ``(text[:80], first differing index)``."""

    equal: int
    total: int
    tokens: int
    tokens_llama_cpp: int
    differences: list[tuple[str, int]]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GreedyResult:
    """One prompt: ``ours`` / ``theirs`` texts and ``equal``; when they differ, ``near_tie`` is the bundle's
    top-2 log-prob gap (nats) at the first differing token if it is below the threshold (an acceptable
    difference), else None."""

    lang: str
    prompt: str
    ours: str
    theirs: str
    equal: bool
    near_tie: float | None = None

    @property
    def ok(self) -> bool:
        return self.equal or self.near_tie is not None


def _vocab_only(gguf_path: str | Path):
    import llama_cpp  # deferred: the optional bench extra

    return llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)


def token_agreement(gguf_path: str | Path, tokenizer_json: str | Path, texts: list[str],
                    nfc: bool = True) -> TokenAgreement:
    """Compare llama.cpp's ids (the GGUF's vocabulary; ``vocab_only`` load) with ``tokenizer_json``'s on ``texts``
    (str), NFC-normalised first when ``nfc`` (``tokenizers`` applies its own normalizer either way). Raises
    ImportError without llama-cpp-python."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(tokenizer_json))
    lc = _vocab_only(gguf_path)
    try:
        out = TokenAgreement(0, 0, 0, 0, [])
        for t in texts:
            t = unicodedata.normalize("NFC", t) if nfc else t
            theirs = lc.tokenize(t.encode("utf-8"), add_bos=False, special=True)
            mine = ours.encode(t, add_special_tokens=False).ids
            out.total += 1
            out.tokens += len(mine)
            out.tokens_llama_cpp += len(theirs)
            if theirs == mine:
                out.equal += 1
            elif len(out.differences) < 5:
                first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                out.differences.append((t[:80], first))
        return out
    finally:
        lc.close()


def greedy_text_agreement(gguf_path: str | Path, bundle: str | Path, prompts: list[tuple[str, str]],
                          max_new_tokens: int = 32, near_tie: float = 1e-3) -> list[GreedyResult]:
    """Greedy text-in/text-out for ``prompts`` (``(lang, text)``) through llama.cpp (f32 KV cache, one thread)
    and through ``serve.load(bundle)`` (onnx, fp32). Raises ImportError without llama-cpp-python."""
    from serve import load
    from serve.backends.llamacpp import LlamaCppBackend

    lm = load(bundle, backend="onnx", threads=1)
    lc = LlamaCppBackend(gguf_path, threads=1)
    results = []
    try:
        for lang, prompt in prompts:
            c = lm.complete(prompt, max_new_tokens=max_new_tokens, temperature=0, top_logprobs=2)
            theirs = lc.llm.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.0)["choices"][0]["text"]
            # llama-cpp-python drops an incomplete UTF-8 tail that our text ends with as U+FFFD
            res = GreedyResult(lang, prompt, c.text, theirs, c.text.rstrip("\ufffd") == theirs.rstrip("\ufffd"))
            if not res.equal and c.top_logprobs:
                common = len(os.path.commonprefix([c.text, theirs]))
                at = max((i for i, off in enumerate(c.text_offset) if off <= common), default=0)
                top = sorted(c.top_logprobs[at].values(), reverse=True)
                res.near_tie = top[0] - top[1] if len(top) > 1 and top[0] - top[1] < near_tie else None
            results.append(res)
    finally:
        lc.close()
        lm.close()
    return results
