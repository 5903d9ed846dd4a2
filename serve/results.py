"""What the Python API returns: :class:`Completion` (a finished generation), :class:`Chunk` (a piece of a running
one), :class:`Score` (a text's negative log-likelihood) and :class:`TokenLogprobs` (tokens with their log-probs, e.g.
an echoed prompt). Plain dataclasses, built by :mod:`serve.generation` and :class:`serve.lm.LM`; the HTTP server
turns them into OpenAI's bodies (:mod:`serve.http.translate`). Conventions: docs/design.md "Serving".
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Tokens with their log-probs (nats), e.g. an echoed prompt.

    ``top_logprobs[i]`` maps display strings of the N most likely tokens at position i to their log-probs
    (None when no alternatives were asked for); ``text_offset[i]`` is the character offset of token i in
    ``text``.
    """

    text: str
    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


@dataclass
class Completion:
    """One generated continuation.

    text: the output (stop string and end-of-text excluded); token_ids / tokens (display strings) /
    logprobs (nats, raw distribution) / text_offset (char offset in ``text``): one entry per output token;
    top_logprobs: per token a dict of the N most likely alternatives, or None; prompt_tokens: positions
    used by the prompt incl. the leading ``<|endoftext|>``; completion_tokens: ``len(token_ids)``;
    finish_reason: ``"stop"`` (end-of-text or stop string) or ``"length"`` (``"cancelled"`` only after
    :meth:`Generation.cancel`); prompt: the prompt's own
    :class:`TokenLogprobs` when ``echo=True`` was asked (else None).
    """

    text: str
    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text_offset: list[int] = field(default_factory=list)
    prompt: TokenLogprobs | None = None


@dataclass
class Score:
    """Negative log-likelihood of a text under the model.

    token_nll: nats, one per token of ``token_ids`` (the first predicted from ``<|endoftext|>``);
    nll_sum / nll_mean: their sum / mean (nats); chars: NFC code points of the text; bits_per_char:
    ``nll_sum / ln 2 / chars``.
    """

    text: str
    token_ids: list[int]
    token_nll: list[float]
    nll_sum: float
    nll_mean: float
    chars: int
    bits_per_char: float


@dataclass
class Chunk:
    """A piece of a running generation: newly released text and the output tokens released with it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]
