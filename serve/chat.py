"""Chat on top of completions: a conversation rendered with the one chat format (``contract.chat_format``, ChatML) and
encoded into the prompt ids that ``LM.start_choices`` generates from, ending at ``<|im_end|>``.

Nothing below the prompt changes: the engine (Python or Rust) takes ids as for any prompt; a choice that samples
``<|im_end|>`` (or ``<|im_start|>``: :func:`chat_end_ids`) ends there with finish_reason ``"stop"`` (``serve.generation.ChoiceGroup.end_ids``), as one that
samples ``<|endoftext|>`` does. The ids are ``<|endoftext|>`` + ``encode(render(messages, True))`` — what
``transformers``' ``apply_chat_template`` and llama.cpp (which adds ``<|endoftext|>`` as its BOS) give.
"""

from __future__ import annotations

from typing import Any, Protocol

from contract.chat_format import CHAT_TOKENS, IM_END, TURN_ENDS, ChatFormatError, render
from serve.errors import ContextLengthError, RequestError
from serve.generation import Generation


class ChatLM(Protocol):
    """What chat uses of a model (:class:`serve.lm.LM`, which imports this module)."""

    name: str
    tokenizer: Any
    context_length: int
    chat_model: bool

    def tokenize(self, text: str, param: str = "text") -> list[int]: ...

    def start_choices(self, prompt: Any, n: int = 1, max_new_tokens: int | None = None, *,
                      end_ids: frozenset[int] = frozenset(), **options: Any) -> list[Generation]: ...

NO_CHAT_TOKENS = "chat_template_missing"  # the error code of a model whose tokenizer cannot encode the format
#: options of start_choices a chat reply cannot take → why (HTTP refuses them as fields: serve.http.schemas)
COMPLETION_ONLY = {"echo": "a reply holds the reply alone", "ignore_eos": f"a reply ends at {IM_END}"}


def missing_tokens(tokenizer: Any) -> list[str]:
    """The chat tokens a ``tokenizers.Tokenizer`` lacks (empty when it can encode the format)."""
    return [t for t in CHAT_TOKENS if tokenizer.token_to_id(t) is None]


def chat_end_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that end a chat reply, for a ``tokenizers.Tokenizer`` with the chat tokens (else the empty set):
    ``<|im_end|>``, and ``<|im_start|>`` — a new turn starting ends this one (Ollama's ChatML models stop at both),
    and a reply holding its text could not be sent back in the next request."""
    if missing_tokens(tokenizer):
        return frozenset()
    return frozenset(int(tokenizer.token_to_id(t)) for t in TURN_ENDS)


def why_not_chat(lm: ChatLM) -> str | None:
    """Why ``lm`` cannot chat, and how to get a model that can (None when it can): its tokenizer lacks
    ``<|im_start|>`` / ``<|im_end|>``, or it is a base model — its tokenizer reserves those ids but it was never
    fine-tuned on conversations, so its bundle has no chat template (``lm.chat_model`` false)."""
    missing = missing_tokens(lm.tokenizer)
    if missing:
        return (f"model {lm.name!r} has no chat template: its tokenizer lacks {' and '.join(missing)} (a base "
                f"model). Fine-tune it into a chat model with python -m train.sft (which adds "
                f"{' and '.join(CHAT_TOKENS)}), then export it again")
    if not lm.chat_model:
        return (f"model {lm.name!r} is a base model, not a chat model: it was not fine-tuned on conversations, so "
                f"its bundle has no chat template (its tokenizer only reserves {' and '.join(CHAT_TOKENS)}). "
                "Fine-tune it with python -m train.sft, then export it again")
    return None


def check_chat_capable(lm: ChatLM) -> None:
    """RequestError (400, code :data:`NO_CHAT_TOKENS`, param ``messages``) saying :func:`why_not_chat` when ``lm``
    cannot chat."""
    why = why_not_chat(lm)
    if why:
        raise RequestError(f"{why}; /v1/completions serves it as it is", param="messages", code=NO_CHAT_TOKENS)


def chat_prompt_ids(lm: ChatLM, messages: Any) -> list[int]:
    """The prompt ids of a conversation (without the leading ``<|endoftext|>``, which generation prepends):
    ``encode(render(messages, add_generation_prompt=True))``. RequestError (param ``messages``) for a model
    without the chat tokens, a conversation :func:`contract.chat_format.normalize_messages` refuses (its message
    names ``messages[i].field``) or text that is not valid Unicode."""
    check_chat_capable(lm)
    try:
        text = render(messages, add_generation_prompt=True)
    except ChatFormatError as e:
        raise RequestError(str(e), param="messages") from None
    return lm.tokenize(text, "messages")


def start_chat(lm: ChatLM, messages: Any, n: int = 1, max_new_tokens: int | None = None,
               **options: Any) -> list[Generation]:
    """``n`` lazy :class:`serve.generation.Generation` s of the assistant's reply to ``messages`` (options as
    :meth:`serve.lm.LM.start_choices`), each ending at ``<|im_end|>``. A conversation that leaves no room for a
    reply in the context raises ContextLengthError (param ``messages``); a completion-only option
    (:data:`COMPLETION_ONLY`) set raises RequestError naming it; other RequestErrors as :func:`chat_prompt_ids` and
    ``start_choices``."""
    for name, why in COMPLETION_ONLY.items():
        if options.get(name):
            raise RequestError(f"{name} is an option of completions, not of chat: {why}", param=name)
    ids = chat_prompt_ids(lm, messages)
    if len(ids) + 1 >= lm.context_length:
        raise ContextLengthError(
            f"the conversation is {len(ids) + 1} tokens with the chat template (including the leading "
            f"<|endoftext|>), leaving no room for a reply in the context length {lm.context_length}",
            param="messages")
    return lm.start_choices(ids, n, max_new_tokens, end_ids=chat_end_ids(lm.tokenizer), **options)

