"""The OpenAPI schema is accurate: schemathesis (4.x) generates schema-valid and schema-invalid requests for
every operation of the app (a scripted model with seeded random logits, context 32) and checks every answer:
no 5xx, status codes, content types, headers and bodies as the schema declares them, invalid data rejected
(400), valid data accepted, and — with SHALIK_API_KEY set — requests without the key refused.

One declared exception: a schema-valid prompt (or chat conversation, rendered with the chat template) whose
tokens, with ``max_tokens``, overflow the context is a 400 ``context_length_exceeded`` (a JSON schema cannot count
tokens). Only that answer, and only when the prompt really overflows, is excused from schemathesis' "valid data is accepted" check; every other check still
runs on it. ``max_tokens`` itself is bounded by the schema (``maximum`` = context − 1). Likewise a request whose
prompts × ``n`` exceed ``serve.http.app.MAX_CHOICES`` (400 ``too_many_completions``): each bound is in the schema, their
product cannot be.
"""

from __future__ import annotations

import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis", minversion="4")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

from contract.chat_format import render  # noqa: E402
from serve.http.app import create_app  # noqa: E402
from serve.http.settings import Settings  # noqa: E402
from tests.scripted import scripted_lm  # noqa: E402

CONTEXT = 32  # small: schema-valid requests (up to 64 choices of many prompts) stay cheap
TIMEOUT_S = 60  # per request: generous for a loaded 2-core machine (schemathesis' default is 10 s)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Sequential requests never fill 8 slots; the generous queue keeps 429 out of the picture anyway.
SETTINGS = dict(max_concurrency=8, max_queue=1000)
# SHALIK_SCHEMATHESIS_EXAMPLES=500 for a deeper search (about a minute per 100 examples per operation)
EXAMPLES = settings(max_examples=int(os.environ.get("SHALIK_SCHEMATHESIS_EXAMPLES", "25")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

open_app = create_app(Settings(**SETTINGS), scripted_lm(None, context=CONTEXT, chat=True))
keyed_app = create_app(Settings(api_key=KEY, **SETTINGS), scripted_lm(None, context=CONTEXT, chat=True))
open_schema = schemathesis.openapi.from_asgi("/openapi.json", open_app)
keyed_schema = schemathesis.openapi.from_asgi("/openapi.json", keyed_app, headers=AUTH)
POSITIVE_DATA_ACCEPTANCE, = CHECKS.get_by_names(["positive_data_acceptance"])


def overflows_chat(lm, body) -> bool:
    """Whether a chat body's conversation, rendered with the chat template (contract.chat_format, encoded by the
    tokenizer itself), + the leading <|endoftext|> leaves no room for a reply, or with max_completion_tokens
    (else max_tokens) exceeds the context."""
    messages = [{"role": m["role"], "content": m["content"]} for m in body["messages"]]
    prompt = len(lm.tokenizer.encode(render(messages, True)).ids) + 1
    max_new = body.get("max_completion_tokens")
    max_new = body.get("max_tokens") if max_new is None else max_new
    return prompt >= lm.context_length or (max_new is not None and prompt + int(max_new) > lm.context_length)


def overflows_context(lm, body) -> bool:
    """Whether a completions body asks for more tokens than the context holds, counted independently of the
    server: the longest prompt's tokens + the leading <|endoftext|> + max_tokens (none when null/absent,
    since the default is capped by the context). Chat bodies: :func:`overflows_chat`."""
    if isinstance(body, dict) and "messages" in body:
        return overflows_chat(lm, body)
    if not isinstance(body, dict) or "prompt" not in body:
        return False
    prompt = body["prompt"]
    single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int | float))  # 0.0 is a JSON integer
    prompts = [prompt] if single else prompt
    longest = max(len(p) if isinstance(p, list) else len(lm.tokenize(p)) for p in prompts)
    max_tokens = body.get("max_tokens")
    return longest + 1 + (int(max_tokens) if max_tokens is not None else 0) > lm.context_length


def check(case, app, headers=None) -> None:
    response = case.call(headers=headers, timeout=TIMEOUT_S)
    assert response.status_code < 500, response.text
    excluded = []
    if response.status_code == 400:
        error = json.loads(response.text)["error"]
        if error["code"] == "context_length_exceeded":  # the one declared exception (module doc)
            assert case.operation.label in ("POST /v1/completions", "POST /v1/chat/completions"), response.text
            assert overflows_context(app.state.shalik.lm, case.body), (case.body, response.text)
            assert f"context length {CONTEXT}" in error["message"]
            excluded = [POSITIVE_DATA_ACCEPTANCE]
        if error["code"] == "too_many_completions":  # prompts × n > MAX_CHOICES: a product no schema can bound
            from serve.http.app import MAX_CHOICES

            prompt = case.body["prompt"]
            single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int | float))  # 0.0 is a JSON integer
            assert (1 if single else len(prompt)) * case.body.get("n", 1) > MAX_CHOICES, case.body
            excluded = [POSITIVE_DATA_ACCEPTANCE]
    case.validate_response(response, headers=headers, excluded_checks=excluded)


@open_schema.parametrize()
@EXAMPLES
def test_schema_without_api_key(case):
    check(case, open_app)


@keyed_schema.parametrize()
@EXAMPLES
def test_schema_with_api_key(case):
    check(case, keyed_app, AUTH)


def test_schema_bounds_and_the_declared_exception():
    """What the schema can say it says (max_tokens ≤ context − 1, token ids < vocab); what it cannot (prompt
    tokens + max_tokens ≤ context) is a 400 naming both numbers."""
    lm = open_app.state.shalik.lm
    with TestClient(open_app) as c:
        schema = c.get("/openapi.json").json()
        props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        int_options = [o for o in props["max_tokens"]["anyOf"] if o.get("type") == "integer"]
        assert int_options == [{"type": "integer", "format": "int64", "minimum": 0, "maximum": CONTEXT - 1}]
        assert f'"maximum": {lm.vocab_size - 1}' in json.dumps(props["prompt"])
        prompt = "abc" * 5
        n = len(lm.tokenize(prompt)) + 1
        assert n + CONTEXT - 1 > CONTEXT  # schema-valid, yet too long together
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": CONTEXT - 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert f"{n + CONTEXT - 1} tokens exceed the context length {CONTEXT}" in r.json()["error"]["message"]
        assert overflows_context(lm, {"prompt": prompt, "max_tokens": CONTEXT - 1})
        assert not overflows_context(lm, {"prompt": prompt, "max_tokens": CONTEXT - n})
        assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": CONTEXT - n}).status_code == 200
