"""Shalik's one conversation format: ChatML, its special tokens, checks, rendering and the Jinja template.

Every runtime renders a conversation from this module (the server and ``serve.load``'s ``LM.chat``, the bundle's
``tokenizer_config.json`` ``chat_template`` for ``transformers``, the GGUF's ``tokenizer.chat_template`` for
llama.cpp, the Ollama ``Modelfile``'s ``TEMPLATE``) and fine-tuning computes its loss mask from it.

Why ChatML (``<|im_start|>role\\n…<|im_end|>\\n``): llama.cpp picks a built-in template by looking at the
template string (``llm_chat_detect_template`` in ``src/llama-chat.cpp``: a template containing ``<|im_start|>`` is
``LLM_CHAT_TEMPLATE_CHATML``), so ``llama-cli``/``llama-server`` render it without ``--jinja``; Ollama, LM Studio
and ``transformers`` take the same template as Jinja. It needs no extra BOS/EOS conventions per turn.

Token ids of a conversation are ``[id of <|endoftext|>]`` + ``encode(render(messages, ...))``: the same leading
``<|endoftext|>`` that began every training document and that the server puts before every prompt
(``serve.lm``: "every prompt is encoded as ``<|endoftext|>`` + prompt"). :data:`CHAT_TEMPLATE` starts with
``{{ bos_token }}`` (``<|endoftext|>`` in tokenizer_config.json), so ``transformers``' ``apply_chat_template``
gives these ids exactly, as llama-cpp-python's Jinja2 formatter does; llama.cpp's built-in ChatML renders
:func:`render`'s text and adds ``<|endoftext|>`` as BOS itself (the GGUF's ``add_bos_token`` is true), and its
Jinja path (``common/chat.cpp``, llama-server's default) cuts a rendered leading BOS before adding its own. The tokenizer keeps ``<|im_start|>`` and
``<|im_end|>`` whole (special added tokens), so encoding the rendered text as one string gives the same ids as
the other runtimes; never encode pieces separately.

Generation ends at ``<|endoftext|>``, and a chat reply at ``<|im_end|>`` or at ``<|im_start|>`` (another turn
starting): :data:`END_OF_GENERATION`, :data:`TURN_ENDS`.

Part of ``contract/`` (the standard library and ``contract/`` only) so that every stage may import it. NFC is
``contract.text.nfc``, the tokenizer's own normalisation.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.byte_level import EOT, SPECIAL_TOKENS
from contract.text import lone_surrogate, nfc

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)  # in id order; a tokenizer keeps them as its last two ids (train.tokenizer)
TURN_ENDS = (IM_END, IM_START)  # what ends a chat reply: its turn's end, or another turn starting (as Ollama stops)
END_OF_GENERATION = (EOT, *TURN_ENDS)  # generation_config.json's eos_token_id list, in this order
ROLES = ("system", "user", "assistant")
# what message content may not hold: the turn tokens (a forged turn) and the tokenizer's special tokens (a document
# boundary or padding in the middle of a prompt, or a reply trained to emit them); the tokenizer would encode each
# of them as its special id, never as the characters
RESERVED_TOKENS = (*SPECIAL_TOKENS, *CHAT_TOKENS)

# transformers' apply_chat_template form (messages, bos_token, add_generation_prompt); rendered by jinja2 it is
# bos_token + render(): the tokenizer's bos_token is <|endoftext|>, so transformers' apply_chat_template(tokenize=True)
# and llama-cpp-python's Jinja2 formatter (which then adds no BOS of its own) give exactly the server's ids.
# llama.cpp's built-in ChatML (no --jinja) renders render() and prepends the BOS itself: the same ids again.
# It takes what normalize_messages takes (content a string or text parts, joined) and refuses, through the
# template's raise_exception (transformers, llama-cpp-python and llama.cpp's Jinja engine define it), what it refuses:
# no message, another role, another part type, content holding a RESERVED_TOKENS text (as sent; normalize_messages
# checks it as sent and after NFC), and tools (this model has no tool calling). An empty part list renders as empty
# content (normalize_messages refuses it): llama.cpp probes the template with one, and a template that fails the
# probe is taken for string-only, whose text parts llama.cpp then joins with newlines. NFC is the tokenizer's own
# normaliser's.
_ROLE_LIST = "[" + ", ".join(f"'{r}'" for r in ROLES) + "]"
_RESERVED_LIST = "[" + ", ".join(f"'{t}'" for t in RESERVED_TOKENS) + "]"
CHAT_TEMPLATE = (
    "{% if tools %}{{ raise_exception('tools: this model has no tool calling') }}{% endif %}"
    "{% if messages | length == 0 %}{{ raise_exception('messages: expected at least one message') }}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set where = 'messages[' ~ loop.index0 ~ ']' %}"
    f"{{% if message['role'] not in {_ROLE_LIST} %}}"
    f"{{{{ raise_exception(where ~ '.role: expected one of {', '.join(ROLES)}') }}}}"
    "{% endif %}"
    "{% set ns = namespace(text='') %}"
    "{% if message['content'] is string %}"
    "{% set ns.text = message['content'] %}"
    "{% elif message['content'] is defined and message['content'] is iterable and message['content'] is not mapping %}"
    "{% for part in message['content'] %}"
    "{% if part is not mapping or part['type'] != 'text' or part['text'] is not string %}"
    "{{ raise_exception(where ~ '.content[' ~ loop.index0 ~ ']: expected a text part {\"type\": \"text\", "
    "\"text\": string} (only text content is supported)') }}"
    "{% endif %}"
    "{% set ns.text = ns.text + part['text'] %}"
    "{% endfor %}"
    "{% else %}"
    "{{ raise_exception(where ~ '.content: expected a string or a list of text parts') }}"
    "{% endif %}"
    f"{{% for token in {_RESERVED_LIST} %}}"
    "{% if token in ns.text %}{{ raise_exception(where ~ '.content: contains the reserved token ' ~ token) }}{% endif %}"
    "{% endfor %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + ns.text + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Ollama's Go template: the same text from .Messages (https://github.com/ollama/ollama/blob/main/docs/template.md).
OLLAMA_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end -}}"
    "<|im_start|>assistant\n"
)


class ChatFormatError(ValueError):
    """A conversation that cannot be rendered; the message names the message index and field and what was
    expected (e.g. ``messages[2].role: expected one of system, user, assistant, got 'tool'``)."""


def _content_text(content, where: str) -> str:
    """A message's content as one string: a string, or the concatenation of OpenAI text parts
    (``[{"type": "text", "text": "..."}]``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        if not content:
            raise ChatFormatError(f"{where}: expected a string or a non-empty list of text parts, got an empty list")
        texts = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise ChatFormatError(f"{at}: expected a text part {{\"type\": \"text\", \"text\": ...}}, "
                                      f"got {type(part).__name__}")
            if part.get("type") != "text":
                raise ChatFormatError(f"{at}.type: expected 'text' (only text content is supported), "
                                      f"got {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{at}.text: expected a string, got {type(part.get('text')).__name__}")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatFormatError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages) -> list[dict]:
    """Check an OpenAI / Hugging Face ``messages`` list and return ``[{"role": str, "content": str}, ...]`` with
    NFC content (other keys dropped).

    ``messages``: a non-empty list of dicts with ``role`` in :data:`ROLES` and ``content`` a string or a list of
    ``{"type": "text", "text": str}`` parts (joined without a separator, as OpenAI does for text parts). A
    content that contains one of :data:`RESERVED_TOKENS` is refused: ``<|im_start|>`` or ``<|im_end|>`` would
    forge a turn, ``<|endoftext|>`` or ``<|pad|>`` would become a control id in the prompt (or, in fine-tuning
    data, a reply trained to emit one); the tokenizer never encodes them as their characters. Raises
    :class:`ChatFormatError` naming ``messages[i].field`` and what was expected.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatFormatError(f"messages: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatFormatError("messages: expected at least one message, got an empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where}: expected an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
        if "content" not in m or m["content"] is None:
            raise ChatFormatError(f"{where}.content: expected a string or a list of text parts, got none")
        raw = _content_text(m["content"], f"{where}.content")
        bad = lone_surrogate(raw)
        if bad is not None:
            raise ChatFormatError(f"{where}.content: holds a lone surrogate U+{ord(raw[bad]):04X} at character {bad} "
                                  "(not valid Unicode text)")
        text = nfc(raw)
        # as sent (what a template path hands the tokenizer, which matches special tokens before normalising) and
        # after NFC (what the server encodes)
        tok = reserved_token(raw) or reserved_token(text)
        if tok is not None:
            raise ChatFormatError(f"{where}.content: contains the reserved token {tok} (the model's control "
                                  "tokens cannot be sent as text)")
        out.append({"role": role, "content": text})
    return out


def reserved_token(text: str) -> str | None:
    """The first of :data:`RESERVED_TOKENS` whose text ``text`` holds, or None."""
    return next((t for t in RESERVED_TOKENS if t in text), None)


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def render(messages, add_generation_prompt: bool) -> str:
    """The ChatML text of ``messages`` (checked and NFC-normalised by :func:`normalize_messages`):
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n`` when
    ``add_generation_prompt`` (the prompt a reply is generated after). Raises :class:`ChatFormatError`."""
    text = "".join(_turn(m["role"], m["content"]) for m in normalize_messages(messages))
    return text + f"{IM_START}assistant\n" if add_generation_prompt else text


def assistant_spans(messages) -> tuple[str, list[tuple[int, int]]]:
    """``(render(messages, False), spans)``: ``spans`` are the ``[start, end)`` character offsets in that text of
    every assistant message's content together with the ``<|im_end|>`` that closes it (the part that carries the
    fine-tuning loss; the ``\\n`` after ``<|im_end|>`` and the ``<|im_start|>assistant\\n`` header do not).
    Offsets count Python characters (code points) of the NFC text. Raises :class:`ChatFormatError`."""
    parts, spans, at = [], [], 0
    for m in normalize_messages(messages):
        turn = _turn(m["role"], m["content"])
        if m["role"] == "assistant":
            start = at + len(IM_START) + len(m["role"]) + 1
            spans.append((start, start + len(m["content"]) + len(IM_END)))
        parts.append(turn)
        at += len(turn)
    return "".join(parts), spans


def missing_chat_tokens(vocab: Sequence[str] | dict) -> list[str]:
    """The :data:`CHAT_TOKENS` absent from ``vocab`` (token strings, or a token → id dict); empty when the
    tokenizer can render this format."""
    return [t for t in CHAT_TOKENS if t not in vocab]
