"""The OpenAI Python SDK, unchanged, against a real ``uvicorn serve.app:app`` process serving the tiny trained
bundle: completions plain, streamed, n=2 with a seed, stop strings, logprobs and echo (each compared with
``serve.load(bundle)`` directly), the model list, and errors surfacing as the SDK's own exception types."""

from __future__ import annotations

import pytest

from tests.client_helpers import uvicorn_server

openai = pytest.importorskip("openai")

NAME = "shalik-tiny"
KEY = "sk-shalik-test"
PROMPT = "আমি বাংলায় গান গাই।"


@pytest.fixture(scope="module")
def server(bundle):
    with uvicorn_server(bundle, SHALIK_API_KEY=KEY, SHALIK_MODEL_NAME=NAME) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def lm(bundle):
    from serve import load

    return load(bundle, threads=1)


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].object == "model"


def test_plain_completion_equals_direct_greedy(client, lm):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    ours = lm.complete(PROMPT, 12, temperature=0)
    assert r.object == "text_completion" and r.model == NAME and len(r.choices) == 1
    assert r.choices[0].text == ours.text and r.choices[0].finish_reason == ours.finish_reason
    assert r.usage.completion_tokens == ours.completion_tokens
    assert r.usage.prompt_tokens == ours.prompt_tokens == len(lm.tokenize(PROMPT)) + 1  # + <|endoftext|>


def test_streamed_completion_concatenates_to_the_plain_one(client, lm):
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    ours = lm.complete(PROMPT, 12, temperature=0)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(chunks) > 2 and text == ours.text and finishes == [ours.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ours.completion_tokens


def test_n2_with_seed_differs_between_choices_and_reproduces(client, lm):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234, n=2)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts[0] != texts[1]
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert texts == [c.text for c in lm.complete_batch([PROMPT], 16, n=2, temperature=1.0, seed=1234)]


def test_stop_string_cuts_the_output(client, lm):
    full = lm.complete(PROMPT, 24, temperature=0).text
    assert len(full) >= 6, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_logprobs_match_the_direct_ones(client, lm):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    ours = lm.complete(PROMPT, 8, temperature=0, top_logprobs=3)
    lp = r.choices[0].logprobs
    end = ["<|endoftext|>"] if ours.finish_reason == "stop" else []  # the end of the text is reported, as vLLM does
    assert lp.tokens == ours.tokens + end and len(ours.tokens) == r.usage.completion_tokens
    assert lp.token_logprobs[:len(ours.tokens)] == pytest.approx(ours.logprobs, abs=1e-5)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the top token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_scores_the_prompt(client, lm):
    ids = lm.tokenize(PROMPT)
    nll = lm.score(PROMPT).token_nll
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and lp.tokens == lm.token_strings(ids)
    assert lp.token_logprobs[0] is None  # as OpenAI and vLLM: nothing precedes the first prompt token
    assert lp.token_logprobs[1:] == pytest.approx([-x for x in nll[1:]], abs=1e-4)
    # lm-evaluation-harness's form: token ids, echo, one generated token after the echoed prompt
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:-1] == pytest.approx([-x for x in nll[1:]], abs=1e-4)
    assert r.choices[0].text == PROMPT + lm.complete(PROMPT, 1, temperature=0).text


def test_errors_surface_as_sdk_exceptions(server, client):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).completions.create(
            model=NAME, prompt=PROMPT, max_tokens=1)
    assert e.value.status_code == 401
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:  # refused, not silently ignored
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logit_bias={"5": 100})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
