"""POST /v1/chat/completions in-process (Starlette's TestClient) over a scripted chat model, and ``LM.chat``: the
template applied on the server, the reply ending at <|im_end|>, streaming (role delta, content deltas, final
chunk, usage, [DONE]), n, seed, stop, logprobs in the chat form, and the 400s (OpenAI error body) for bad input
and for a model without a chat template. The same against a real trained bundle is in test_chat_clients.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from contract.chat_format import IM_END, render
from serve.chat import chat_prompt_ids
from serve.errors import RequestError
from serve.sampling import log_softmax
from tests.scripted import scripted_lm
from tests.test_http import assert_error, client_for, sse_events

PIECES = ["নমস্কার", "!", " Hello", "."]
USER = [{"role": "user", "content": "বাংলা ভাষা সম্পর্কে কিছু বলো।"}]


@pytest.fixture
def chat_client():
    """A scripted chat model: the pieces in turn, <|im_end|> after 3 tokens."""
    with client_for(scripted_lm(PIECES, context=128, eos_after=3, chat=True)) as c:
        yield c


@pytest.fixture
def random_chat_client():
    """A chat model with seeded random logits (never forced to end), context 256."""
    with client_for(scripted_lm(None, context=256, chat=True)) as c:
        yield c


def test_reply_ends_at_im_end_with_usage(chat_client):
    r = chat_client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice, = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "নমস্কার! Hello", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    lm = chat_client.app.state.shalik.lm
    prompt = len(lm.tokenize(render(USER, True))) + 1  # + the leading <|endoftext|>
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}


def test_template_is_applied_on_the_server_nfc():
    lm = scripted_lm(PIECES, chat=True)
    decomposed = [{"role": "system", "content": "\u0995\u09c7\u09be"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    ids = chat_prompt_ids(lm, decomposed)
    text = "<|im_start|>system\n\u0995\u09cb<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert ids == lm.tokenize(text)
    assert ids.count(lm.tokenizer.token_to_id(IM_END)) == 2


def test_max_tokens_and_max_completion_tokens(chat_client):
    for key in ("max_tokens", "max_completion_tokens"):
        r = chat_client.post("/v1/chat/completions", json={"messages": USER, key: 2})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 2
    r = chat_client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "max_completion_tokens": 2})
    assert r.json()["usage"]["completion_tokens"] == 2  # the newer name wins


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_role_first_deltas_finish_usage_done(chat_client, include_usage):
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": include_usage}}
    r = chat_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["নমস্কার", "!", " Hello"]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    if include_usage:
        assert all(c["usage"] is None for c in chunks)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    else:
        assert all("usage" not in e for e in events)


def test_stream_concatenates_to_plain_reply_with_seed_and_n(random_chat_client):
    base = {"messages": USER, "max_tokens": 12, "seed": 7, "n": 2, "temperature": 1.0}
    plain = random_chat_client.post("/v1/chat/completions", json=base).json()
    streamed = random_chat_client.post("/v1/chat/completions", json={**base, "stream": True})
    texts = {0: "", 1: ""}
    for e in sse_events(streamed.text)[:-1]:
        for c in json.loads(e)["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
    assert [c["message"]["content"] for c in plain["choices"]] == [texts[0], texts[1]]
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert texts[0] != texts[1]  # each choice draws its own stream
    again = random_chat_client.post("/v1/chat/completions", json=base).json()
    assert again["choices"] == plain["choices"]


def test_stop_string(chat_client):
    r = chat_client.post("/v1/chat/completions", json={"messages": USER, "stop": ["!"]})
    c = r.json()["choices"][0]
    assert c["message"]["content"] == "নমস্কার" and c["finish_reason"] == "stop"


def test_logprobs_in_chat_form(random_chat_client):
    lm = random_chat_client.app.state.shalik.lm
    r = random_chat_client.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == 4
    ids = [lm.eot_id, *chat_prompt_ids(lm, USER)]
    logits = lm.backend.new_sequence().prefill(ids)
    lp = log_softmax(np.asarray(logits, dtype=np.float32))
    first = content[0]
    assert first["logprob"] == pytest.approx(float(lp.max()), abs=1e-4)  # greedy: the most likely token
    assert [t["logprob"] for t in first["top_logprobs"]] == pytest.approx(sorted(lp)[::-1][:3], abs=1e-4)
    assert first["top_logprobs"][0]["token"] == first["token"]
    assert bytes(first["bytes"]) == lm.table.token_bytes(int(np.argmax(lp)))
    r = random_chat_client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "logprobs": True})
    assert all(t["top_logprobs"] == [] for t in r.json()["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": []}, "messages", "messages: expected at least one message"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     "messages[0].content[0].text: expected a string, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url",
                                                                              "image_url": {"url": "x"}}]}]},
     "messages", "messages[0].content[1].type: expected 'text' (only text content is supported), got 'image_url'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content: expected a string or a list"),
    ({"messages": [{"role": "user", "content": []}]}, "messages", "messages[0].content: expected a string or a "
                                                                  "non-empty list of text parts, got an empty list"),
    ({"messages": USER, "n": 0}, "n", "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": f"a{IM_END}b"}]}, "messages", "reserved token <|im_end|>"),
    ({"messages": [{"role": "user", "content": "a<|endoftext|>b"}]}, "messages", "reserved token <|endoftext|>"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": USER, "max_completion_tokens": 1000, "max_tokens": 4}, "max_completion_tokens",
     "max_new_tokens (max_completion_tokens over HTTP) asks for 1000 more"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "top_logprobs is only allowed with logprobs: true"),
    ({"messages": USER, "seed": 2**64}, "seed", "seed must be a 64-bit signed integer"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", "tool calling"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions", "function calling"),
    ({"messages": USER, "function_call": "auto"}, "function_call", "function calling"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format", "no JSON mode"),
    ({"messages": USER, "modalities": ["text", "audio"]}, "modalities", 'only ["text"]'),
    ({"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output is not supported"),
    ({"messages": USER, "ignore_eos": True}, "ignore_eos", "an option of /v1/completions, not of chat"),
    ({"messages": USER, "echo": True}, "echo", "an option of /v1/completions, not of chat"),
    ({"messages": USER, "reasoning_effort": "high"}, "reasoning_effort", "not a reasoning model"),
    ({"messages": USER, "web_search_options": {}}, "web_search_options", "web search is not supported"),
    ({"messages": USER, "stop": {"\ud800": 1}}, "stop", "stop must be a non-empty string or a list"),
    ({"messages": [{"role": "user", "content": "ab\ud800"}]}, "messages",
     "messages[0].content: holds a lone surrogate U+D800 at character 2"),
    ({"messages": [{"role": "user", "content": "ক" * 300}]}, "messages", "context length 128"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_400_before_any_stream(chat_client, body, param, needle, stream):
    # sent as JSON text (ASCII, lone surrogates as \\ud800 escapes: what a client may send and httpx cannot encode)
    r = chat_client.post("/v1/chat/completions", content=json.dumps({**body, "stream": stream}),
                         headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, param)
    assert needle in err["message"], err


def test_stream_options_need_stream_on_both_endpoints(chat_client):
    """As vLLM: stream_options without stream: true is a 400 naming it (chat and completions)."""
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        err = assert_error(chat_client.post(path, json={**body, "stream_options": {"include_usage": True}}), 400,
                           "stream_options")
        assert err["message"] == "stream_options is only allowed with stream: true" and err["code"] == "invalid_value"


def test_accepted_openai_fields_that_ask_for_no_feature(chat_client):
    """The values that ask for none of a missing feature (what SDKs send by default) are served as usual."""
    body = {"messages": USER, "max_tokens": 2, "tools": [], "tool_choice": "none", "functions": [],
            "function_call": "none", "response_format": {"type": "text"}, "modalities": ["text"],
            "parallel_tool_calls": False, "logit_bias": {}, "seed": -(2**63)}
    r = chat_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_a_body_that_is_not_a_json_object_says_what_it_must_be(chat_client):
    r = chat_client.post("/v1/chat/completions", content=json.dumps({"messages": USER}),
                         headers={"Content-Type": "text/plain"})
    err = assert_error(r, 400, None)
    assert err["message"] == ("the body must be a JSON object sent with Content-Type: application/json, got "
                              "Content-Type: text/plain") and err["code"] == "invalid_content_type"
    err = assert_error(chat_client.post("/v1/chat/completions", json=[1, 2]), 400, None)
    assert err["message"] == "the body must be a JSON object, got an array"
    err = assert_error(chat_client.post("/v1/chat/completions", content=json.dumps({"messages": USER})), 400, None)
    assert err["message"] == ("the body must be a JSON object sent with Content-Type: application/json, sent without "
                              "a Content-Type")
    err = assert_error(chat_client.post("/v1/chat/completions", content=b"",
                                        headers={"Content-Type": "application/json"}), 400, None)
    assert err["message"] == "the body is empty: expected a JSON object"
    r = chat_client.post("/v1/chat/completions", content=json.dumps({"messages": USER, "max_tokens": 2}),
                         headers={"Content-Type": "application/vnd.api+json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_model_without_chat_template_is_400_saying_how_to_get_one():
    with client_for(scripted_lm(PIECES)) as c:
        err = assert_error(c.post("/v1/chat/completions", json={"messages": USER}), 400, "messages")
    assert err["code"] == "chat_template_missing"
    assert "<|im_start|>" in err["message"] and "python -m train.sft" in err["message"]


def test_a_base_model_whose_tokenizer_reserves_the_chat_tokens_is_no_chat_model(bundle):
    """The main job's kind of bundle: its tokenizer has <|im_start|>/<|im_end|> (reserved for fine-tuning,
    untrained), its bundle no chat template: chat is a 400 saying how to get a chat model, in Python too."""
    from contract.bundle import has_chat_template
    from serve import load
    from serve.chat import missing_tokens

    lm = load(bundle, threads=1)
    assert missing_tokens(lm.tokenizer) == [] and not has_chat_template(bundle) and lm.chat_model is False
    with pytest.raises(RequestError) as e:
        lm.chat(USER)
    assert (e.value.code, e.value.param) == ("chat_template_missing", "messages")
    assert "is a base model, not a chat model: it was not fine-tuned on conversations" in str(e.value)
    with client_for(lm) as c:
        err = assert_error(c.post("/v1/chat/completions", json={"messages": USER}), 400, "messages")
        assert err["code"] == "chat_template_missing" and "python -m train.sft" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "আমি", "max_tokens": 2}).status_code == 200


def test_a_reply_ends_at_the_end_of_its_turn_or_the_start_of_another():
    """<|im_start|> ends a reply too: a reply holding its text could not be sent back in the next request."""
    from serve.chat import chat_end_ids

    tok = scripted_lm(PIECES, chat=True).tokenizer
    assert chat_end_ids(tok) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")}
    assert chat_end_ids(scripted_lm(PIECES).tokenizer) == frozenset()


def test_lm_chat_and_stream():
    lm = scripted_lm(PIECES, eos_after=3, chat=True)
    c = lm.chat(USER)
    assert (c.text, c.finish_reason, c.completion_tokens) == ("নমস্কার! Hello", "stop", 3)
    assert list(lm.chat_stream(USER)) == ["নমস্কার", "!", " Hello"]
    gens = lm.start_chat(USER, n=2, max_new_tokens=2)
    assert [lm.collect(g).text for g in gens] == ["নমস্কার!", "নমস্কার!"]
    with pytest.raises(RequestError, match="n is 2"):
        lm.chat(USER, n=2)
    with pytest.raises(RequestError, match=r"messages\[0\]\.role"):
        lm.chat([{"role": "bot", "content": "x"}])


def test_lm_chat_refuses_what_a_chat_reply_cannot_take():
    """Completion-only options, a non-int n, an empty part list; the budget and log-prob errors name the Python
    argument."""
    lm = scripted_lm(PIECES, eos_after=3, chat=True)
    for name in ("ignore_eos", "echo"):
        with pytest.raises(RequestError, match=f"{name} is an option of completions, not of chat") as e:
            lm.chat(USER, 4, **{name: True})
        assert e.value.param == name
    assert lm.chat(USER, 4, echo=False, ignore_eos=False).text == "নমস্কার! Hello"
    with pytest.raises(RequestError, match=r"n is 1\.0, but chat\(\) makes one reply"):
        lm.chat(USER, n=1.0)
    with pytest.raises(RequestError, match=r"n is 1\.0, but chat_stream\(\) streams one reply"):
        list(lm.chat_stream(USER, n=1.0))
    with pytest.raises(RequestError, match=r"messages\[0\]\.content: expected a string or a non-empty list"):
        lm.chat([{"role": "user", "content": []}])
    with pytest.raises(RequestError, match=r"max_new_tokens \(max_tokens over HTTP\) asks for 1000000000 more"):
        lm.chat(USER, 10**9)
    with pytest.raises(RequestError, match=r"top_logprobs \(logprobs in /v1/completions\) must be an integer"):
        lm.chat(USER, 4, top_logprobs=-1)
