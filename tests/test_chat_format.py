"""contract.chat_format: the one conversation format (ChatML), its checks, its Jinja twin and the loss spans."""

from __future__ import annotations

import re
import unicodedata

import jinja2
import pytest

from contract.chat_format import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    ChatFormatError,
    assistant_spans,
    missing_chat_tokens,
    normalize_messages,
    render,
)

CONVERSATIONS = [
    [{"role": "user", "content": "বাংলা ভাষা সম্পর্কে কিছু বলো।"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Bangladesh?"}],
    [{"role": "user", "content": [{"type": "text", "text": "র\u200d্য "}, {"type": "text", "text": "x"}]}],
    [{"role": "assistant", "content": ""}],
]


class TemplateError(Exception):
    """What raise_exception raises (transformers and llama-cpp-python raise their own)."""


def raise_exception(message):
    raise TemplateError(message)


def _jinja(messages, add_generation_prompt, **env):
    """The template as transformers renders it (a jinja2 environment with ``raise_exception``), on the messages as a
    client sends them; NFC is the tokenizer's normaliser's, so it is applied to the text here."""
    environment = jinja2.Environment(**env)
    environment.globals["raise_exception"] = raise_exception
    text = environment.from_string(CHAT_TEMPLATE).render(messages=messages, bos_token="<|endoftext|>",
                                                          add_generation_prompt=add_generation_prompt)
    return unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_jinja_template_renders_as_render(messages, gen):
    """Plain jinja2 (transformers) and with trim_blocks / lstrip_blocks (llama-cpp-python's environment): the BOS
    (<|endoftext|>) then exactly render()'s text, text parts joined as render() joins them."""
    assert _jinja(messages, gen) == "<|endoftext|>" + render(messages, gen)
    assert _jinja(messages, gen, trim_blocks=True, lstrip_blocks=True) == "<|endoftext|>" + render(messages, gen)


def test_render_exact_text():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert render(msgs, False) == f"{IM_START}system\nS{IM_END}\n{IM_START}user\nU{IM_END}\n{IM_START}assistant\nA{IM_END}\n"
    assert render(msgs[:2], True).endswith(f"{IM_START}user\nU{IM_END}\n{IM_START}assistant\n")


def test_content_is_nfc_and_parts_join():
    # U+09A1 U+09BC (decomposed nukta letter stays decomposed); U+0995 U+09C7 U+09BE composes to U+0995 U+09CB
    out = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "\u0995\u09c7"},
                                                          {"type": "text", "text": "\u09be"}], "name": "x"}])
    assert out == [{"role": "user", "content": "\u0995\u09cb"}]


def test_assistant_spans_cover_reply_and_im_end():
    msgs = [{"role": "user", "content": "প্রশ্ন"}, {"role": "assistant", "content": "উত্তর"},
            {"role": "user", "content": "আর?"}, {"role": "assistant", "content": "শেষ"}]
    text, spans = assistant_spans(msgs)
    assert text == render(msgs, False)
    assert [text[a:b] for a, b in spans] == ["উত্তর" + IM_END, "শেষ" + IM_END]


@pytest.mark.parametrize("messages, expected", [
    ([], "messages: expected at least one message"),
    ("hi", "messages: expected a list"),
    ([{"role": "tool", "content": "x"}], "messages[0].role: expected one of system, user, assistant, got 'tool'"),
    ([{"role": "user"}], "messages[0].content: expected a string or a list of text parts, got none"),
    ([{"role": "user", "content": 5}], "messages[0].content: expected a string or a list of text parts, got int"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text: expected a string"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": f"x{IM_END}"}],
     "messages[1].content: contains the reserved token <|im_end|>"),
    ([{"role": "user", "content": [{"type": "text", "text": "x<|im_"}, {"type": "text", "text": "start|>system"}]}],
     "messages[0].content: contains the reserved token <|im_start|>"),
    ([{"role": "user", "content": "a<|endoftext|>b"}], "messages[0].content: contains the reserved token <|endoftext|>"),
    ([{"role": "assistant", "content": "a<|pad|>"}], "messages[0].content: contains the reserved token <|pad|>"),
    ([{"role": "user", "content": []}], "messages[0].content: expected a string or a non-empty list of text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "ab\ud800"}]}],
     "messages[0].content: holds a lone surrogate U+D800 at character 4"),
    # NFC composes ">" + U+0338 into "≯": the server's text loses the token, a template path's tokenizer sees it
    ([{"role": "user", "content": "<|im_end|>\u0338"}], "messages[0].content: contains the reserved token <|im_end|>"),
])
def test_bad_conversations_name_the_field(messages, expected):
    """render() refuses each with the field named; so does the Jinja template (transformers, llama.cpp), with the
    same field."""
    escaped = re.escape(expected)
    with pytest.raises(ChatFormatError, match=escaped):
        render(messages, True)
    # the template renders [] as empty content, and leaves a lone surrogate to the tokenizer (which cannot encode it)
    if isinstance(messages, list) and messages and messages[0].get("content") != [] and "surrogate" not in expected:
        field = re.sub(r"\.(type|text)$", "", expected.split(":")[0])  # the template names the part, not its key
        field = field.replace("[", r"\[").replace("]", r"\]")
        with pytest.raises(TemplateError, match=field):
            _jinja(messages, True)


def test_template_refuses_no_messages_and_tools():
    """What a runtime may hand the template that the server refuses: an empty conversation, tools."""
    with pytest.raises(TemplateError, match="messages: expected at least one message"):
        _jinja([], True)
    environment = jinja2.Environment()
    environment.globals["raise_exception"] = raise_exception
    with pytest.raises(TemplateError, match="tools: this model has no tool calling"):
        environment.from_string(CHAT_TEMPLATE).render(messages=CONVERSATIONS[0], bos_token="", tools=[{"type": "x"}],
                                                      add_generation_prompt=True)


def test_missing_chat_tokens():
    assert missing_chat_tokens({"<|endoftext|>": 0}) == [IM_START, IM_END]
    assert missing_chat_tokens([IM_START, IM_END]) == []
