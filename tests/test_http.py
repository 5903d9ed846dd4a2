"""The HTTP server in-process (Starlette's TestClient): endpoints, error bodies (H1–H4), echo/logprobs for
lm-evaluation-harness, auth, body limits, timeouts, metrics and the OpenAPI schema. Streaming under a real
uvicorn process (disconnects, event-loop responsiveness, overload) is in test_http_live.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from serve.http.app import create_app
from serve.http.settings import Settings, SettingsError
from serve.sampling import log_softmax
from tests.polling import wait_until
from tests.scripted import scripted_lm

PIECES = ["ABC", "DEF", "G", "HI", "J", "KL"]


def client_for(lm=None, **settings) -> TestClient:
    return TestClient(create_app(Settings(**settings), lm if lm is not None else scripted_lm(PIECES, context=64)))


@pytest.fixture
def client():
    with client_for() as c:
        yield c


@pytest.fixture
def random_client():
    """Scripted model with seeded random logits, context 256."""
    with client_for(scripted_lm(None, context=256)) as c:
        yield c


def sse_events(text: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing of every event."""
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-1] == ""
    out = []
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev
        out.append(ev[len("data: "):])
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out


def assert_error(r, status: int, param: str | None = "__any__", kind: str = "invalid_request_error"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == kind
    if param != "__any__":
        assert err["param"] == param
    return err


# ---- basics


def test_health_models_and_index(client):
    h = client.get("/health")
    assert h.status_code == 200
    assert h.json()["status"] == "ok" and h.json()["context_length"] == 64
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["scripted"]
    assert client.get("/").status_code == 200 and "Shalik" in client.get("/").text
    assert_error(client.get("/nope"), 404)


def test_no_model_still_starts_and_health_says_why():
    with TestClient(create_app(Settings(model_problem="no model: nothing here"))) as c:
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "unavailable" and "nothing here" in h.json()["detail"]
        assert_error(c.get("/v1/models"), 503, kind="service_unavailable")
        assert_error(c.post("/v1/completions", json={"prompt": "x"}), 503, kind="service_unavailable")


def test_bad_bundle_reports_load_failure(tmp_path):
    with TestClient(create_app(Settings(model=tmp_path))) as c:
        deadline = time.monotonic() + 60  # for a broken loader only: a bad bundle fails in milliseconds
        while c.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        h = c.get("/health")
        assert h.status_code == 503 and "tokenizer.json" in h.json()["detail"]


def test_settings_from_env(tmp_path):
    (tmp_path / "runs" / "old" / "bundle").mkdir(parents=True)
    time.sleep(0.01)
    (tmp_path / "runs" / "new" / "bundle").mkdir(parents=True)
    s = Settings.from_env({"SHALIK_MAX_QUEUE": "3", "SHALIK_QUANTIZE": "q8_0", "SHALIK_BACKEND": "rust"},
                          runs_dir=tmp_path / "runs")
    assert s.model == tmp_path / "runs" / "new" / "bundle" and s.served_name == "new"
    assert (s.max_queue, s.quantize.name, s.backend, s.max_concurrency, s.default_max_tokens) == (3, "q8_0", "rust", 16, 64)
    empty = Settings.from_env({}, runs_dir=tmp_path / "none")
    assert empty.model is None and "SHALIK_MODEL" in empty.model_problem
    with pytest.raises(SettingsError, match="SHALIK_MAX_CONCURRENCY"):
        Settings.from_env({"SHALIK_MAX_CONCURRENCY": "zero"})
    with pytest.raises(SettingsError, match="SHALIK_BACKEND"):
        Settings.from_env({"SHALIK_BACKEND": "gpu"})
    with pytest.raises(SettingsError, match="SHALIK_THREADS.*an integer from 1 to 1024"):
        Settings.from_env({"SHALIK_THREADS": "100000"})


@pytest.mark.parametrize("key,needle", [(" secret", "leading or trailing whitespace"),
                                        ("secret\n", "leading or trailing whitespace"),
                                        ("   ", "leading or trailing whitespace"),
                                        ("sécret", "U\\+00E9 at character 1"), ("ключ", "U\\+043A at character 0"),
                                        ("se\tcret", "U\\+0009"), ("\udcffkey", "U\\+DCFF")])
def test_an_api_key_no_client_can_send_stops_the_server(key, needle):
    """SHALIK_API_KEY=' secret' (or one outside ASCII) was taken, and every request was then a 401: the middleware
    strips the token and reads the header as latin-1. Now it is refused at start, naming the variable, not the key."""
    with pytest.raises(SettingsError, match=f"SHALIK_API_KEY.*{needle}.*printable ASCII") as e:
        Settings.from_env({"SHALIK_API_KEY": key})
    assert key.strip() not in str(e.value) or not key.strip()


def test_a_printable_api_key_is_taken_as_it_is():
    key = "sk-A1_b2.c3~d4+e5/f6= g7!"
    assert Settings.from_env({"SHALIK_API_KEY": key}).api_key == key
    assert Settings.from_env({"SHALIK_API_KEY": ""}).api_key is None
    with client_for(api_key=key) as c:
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def _rust_available() -> bool:
    try:
        import rust_runtime  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("backend", ["onnx", pytest.param("rust", marks=pytest.mark.skipif(
    not _rust_available(), reason="rust_runtime is not built (pip install -e '.[all]' builds it)"))])
def test_real_bundle_loads_lazily(bundle, backend):
    with TestClient(create_app(Settings(model=bundle, model_name="tiny", backend=backend))) as c:
        deadline = time.monotonic() + 120  # loading a bundle on a loaded 2-core machine: seconds, not a pace
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        h = c.get("/health").json()
        assert h["status"] == "ok" and h["model"] == "tiny" and h["backend"] == backend
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "আমি", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


# ---- H1: prompt forms


def test_h1_every_prompt_form(random_client):
    c = random_client
    lm = c.app.state.shalik.lm
    ids_ami, ids_hello = lm.tokenize("আমি"), lm.tokenize("hello")
    base = {"temperature": 0, "max_tokens": 4}
    single = c.post("/v1/completions", json={**base, "prompt": "আমি"}).json()
    assert [ch["index"] for ch in single["choices"]] == [0]
    by_ids = c.post("/v1/completions", json={**base, "prompt": ids_ami}).json()
    assert by_ids["choices"][0]["text"] == single["choices"][0]["text"]
    two = c.post("/v1/completions", json={**base, "prompt": ["আমি", "hello"]}).json()
    two_ids = c.post("/v1/completions", json={**base, "prompt": [ids_ami, ids_hello]}).json()
    assert [ch["index"] for ch in two["choices"]] == [0, 1]
    assert [ch["text"] for ch in two["choices"]] == [ch["text"] for ch in two_ids["choices"]]
    assert two["choices"][0]["text"] == single["choices"][0]["text"]
    hello = c.post("/v1/completions", json={**base, "prompt": "hello"}).json()
    assert two["choices"][1]["text"] == hello["choices"][0]["text"]
    assert two["usage"]["prompt_tokens"] == len(ids_ami) + len(ids_hello) + 2


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []], [-1], [10**6], [[3, 10**6]]])
def test_h1_empty_or_out_of_vocab_prompts_are_400(client, prompt):
    assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, "prompt")


# ---- H2: SSE framing


@pytest.mark.parametrize("include_usage", [True, False])
def test_h2_sse_framing_and_usage(client, include_usage):
    body = {"prompt": "x", "max_tokens": 5, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    r = client.post("/v1/completions", json={**body, "stream": True, **options})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r.text)[:-1]]
    text = "".join(ch["text"] for e in events for ch in e["choices"])
    assert text == plain["choices"][0]["text"] == "ABCDEFGHIJ"
    finals = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    assert finals == ["length"]
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
        assert all(e["usage"] is None for e in events[:-1])
    else:
        assert all(e["choices"] and e.get("usage") is None for e in events)


def test_stream_equals_non_stream_with_seed_and_n(random_client):
    body = {"prompt": "ab", "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3}
    plain = random_client.post("/v1/completions", json=body).json()
    again = random_client.post("/v1/completions", json=body).json()
    texts = [ch["text"] for ch in plain["choices"]]
    assert texts == [ch["text"] for ch in again["choices"]]
    assert len(set(texts)) > 1  # each choice has its own random stream (S5)
    r = random_client.post("/v1/completions", json={**body, "stream": True})
    streamed = {i: "" for i in range(3)}
    for e in sse_events(r.text)[:-1]:
        for ch in json.loads(e)["choices"]:
            streamed[ch["index"]] += ch["text"]
    assert [streamed[i] for i in range(3)] == texts


def test_s7_stop_over_http(client):
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stop": ["DEFGHIJ"],
                                                 "stream": stream})
        if stream:
            chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
            pieces = [ch["text"] for e in chunks for ch in e["choices"]]
            assert "".join(pieces) == "ABC" and not any(set(p) & set("DEFGHIJ") for p in pieces)
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            ch = r.json()["choices"][0]
            assert (ch["text"], ch["finish_reason"]) == ("ABC", "stop")


# ---- H3: bad input


BAD = [
    ({"temperature": -1}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1000}, "max_tokens"), ({"temperature": "hot"}, "temperature"), ({"n": 1.5}, "n"),
    ({"stop": [""]}, "stop"), ({"logprobs": 100}, "logprobs"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stream": "yes"}, "stream"), ({"seed": "1"}, "seed"), ({"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("patch,param", BAD)
def test_h3_bad_parameters_are_400_before_any_stream(client, patch, param, stream):
    body = {"prompt": "x", "max_tokens": 4, "stream": stream, **patch}
    r = client.post("/v1/completions", json=body)
    assert r.headers["content-type"].startswith("application/json")
    err = assert_error(r, 400, param)
    if patch.get("max_tokens") == 1000:
        assert "1000" in err["message"] and "64" in err["message"] and err["code"] == "context_length_exceeded"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_h3_unknown_model_404_malformed_json_400(client, stream):
    err = assert_error(client.post("/v1/completions", json={"prompt": "x", "model": "gpt-5", "stream": stream}),
                       404, "model")
    assert err["code"] == "model_not_found"
    r = client.post("/v1/completions", content=b'{"prompt": "x", "stream": true',
                    headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error(client.post("/v1/completions", content=b"prompt=x",
                             headers={"content-type": "application/x-www-form-urlencoded"}), 400)


def test_h3_greedy_controls_are_valid(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "top_p": 0, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ABCDEFG"


# ---- H4: max_tokens null and finish_reason


def test_h4_max_tokens_null_default_capped_by_context():
    lm = scripted_lm(["ab"], context=64)
    prompt = "ab" * 9  # 9 tokens + the leading <|endoftext|> = 10 prompt tokens
    with client_for(lm, default_max_tokens=1000) as c:
        for body in ({"prompt": prompt, "max_tokens": None}, {"prompt": prompt}):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"] == {"prompt_tokens": 10, "completion_tokens": 54, "total_tokens": 64}
            assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (5, "length")
    with client_for(scripted_lm(["ab"], context=64, eos_after=3)) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20}).json()
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("ababab", "stop")
        assert r["usage"]["completion_tokens"] == 3
        # vLLM's ignore_eos: past end-of-text to max_tokens (its text appears), for fixed-length benchmarks
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (6, "length")
        assert r["choices"][0]["text"].startswith("ababab") and r["choices"][0]["text"] != "ababab"
        assert c.post("/v1/completions", json={"prompt": prompt, "ignore_eos": "yes"}).status_code == 400


def test_default_max_tokens_setting():
    with client_for(scripted_lm(["ab"], context=64), default_max_tokens=7) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).json()["usage"]["completion_tokens"] == 7


# ---- echo + logprobs (lm-evaluation-harness)


def test_echo_logprobs_for_lm_eval(random_client):
    lm = random_client.app.state.shalik.lm
    ctx, cont = lm.tokenize("the river"), lm.tokenize(" flows")
    ids = ctx + cont
    body = {"prompt": [ids, ids[:3]], "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0, "seed": 1234}
    out = random_client.post("/v1/completions", json=body).json()
    ch = out["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["tokens"][:len(ids)] == lm.token_strings(ids)  # exactly the prompt as sent, then the new token
    rows = log_softmax(lm.backend.new_sequence().prefill([lm.eot_id, *ids], all_logits=True))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI and vLLM
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], [rows[i, t] for i, t in enumerate(ids)][1:])
    assert lp["token_logprobs"][-1] == pytest.approx(float(rows[len(ids)].max()))  # greedy new token
    assert all(len(d) == 1 for d in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert ch["text"].startswith("the river flows")
    api = pytest.importorskip("lm_eval.models.openai_completions").LocalCompletionsAPI
    (ll, greedy), = api.parse_logprobs({"choices": [ch]}, ctxlens=[len(ctx)])
    assert ll == pytest.approx(float(sum(rows[i, t] for i, t in enumerate(ids) if i >= len(ctx))))
    assert greedy == all(rows[i].argmax() == t for i, t in enumerate(ids) if i >= len(ctx))
    assert out["choices"][1]["logprobs"]["tokens"][:3] == lm.token_strings(ids[:3])


def test_echo_max_tokens_zero_scores_without_generating(random_client):
    lm = random_client.app.state.shalik.lm
    r = random_client.post("/v1/completions", json={"prompt": "hello", "echo": True, "max_tokens": 0,
                                                    "logprobs": 0}).json()
    ch = r["choices"][0]
    assert ch["text"] == "hello" and r["usage"]["completion_tokens"] == 0
    score = lm.score("hello")
    assert ch["logprobs"]["token_logprobs"][0] is None
    assert ch["logprobs"]["token_logprobs"][1:] == pytest.approx([-x for x in score.token_nll[1:]])
    assert ch["logprobs"]["top_logprobs"] == [None] + [{} for _ in score.token_ids[1:]]
    plain = random_client.post("/v1/completions", json={"prompt": "hello", "echo": True, "max_tokens": 0}).json()
    assert plain["choices"][0]["text"] == "hello" and plain["choices"][0]["logprobs"] is None


def test_echo_streaming_sends_prompt_first(random_client):
    r = random_client.post("/v1/completions", json={"prompt": "hey", "echo": True, "logprobs": 2, "max_tokens": 3,
                                                    "temperature": 0, "stream": True})
    events = [json.loads(e) for e in sse_events(r.text)[:-1]]
    first = events[0]["choices"][0]
    assert first["text"] == "hey" and first["logprobs"]["text_offset"] == [0, 1, 2]
    plain = random_client.post("/v1/completions", json={"prompt": "hey", "echo": True, "logprobs": 2,
                                                        "max_tokens": 3, "temperature": 0}).json()
    lp = plain["choices"][0]["logprobs"]
    streamed = {k: [x for e in events for ch in e["choices"] if ch["logprobs"] for x in ch["logprobs"][k]]
                for k in lp}
    assert streamed == lp


def test_score_endpoint(random_client):
    lm = random_client.app.state.shalik.lm
    r = random_client.post("/v1/score", json={"text": "hello there"})
    assert r.status_code == 200
    body, s = r.json(), lm.score("hello there")
    assert body["token_ids"] == s.token_ids and body["nll_sum"] == pytest.approx(s.nll_sum)
    assert body["bits_per_char"] == pytest.approx(s.bits_per_char) and body["chars"] == 11
    assert_error(random_client.post("/v1/score", json={"text": ""}), 400, "text")
    long = random_client.post("/v1/score", json={"text": "x" * 600}).json()  # beyond the context of 256
    assert len(long["token_nll"]) == len(lm.tokenize("x" * 600))
    assert_error(random_client.post("/v1/score", json={"text": "x", "model": "other"}), 404, "model")


def test_tokenizer_endpoints(random_client):
    lm = random_client.app.state.shalik.lm
    info = random_client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 256
    t = random_client.post("/tokenize", json={"prompt": "আমি", "add_special_tokens": False}).json()
    assert t["tokens"] == lm.tokenize("আমি") and t["count"] == len(t["tokens"])
    assert random_client.post("/tokenize", json={"prompt": "<|endoftext|>"}).json()["tokens"] == [0]
    d = random_client.post("/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "আমি"
    assert_error(random_client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")


# ---- auth, body size, timeouts


def test_api_key_required_except_open_paths():
    with client_for(api_key="s3cret") as c:
        for path in ("/v1/models", "/metrics", "/tokenizer_info", "/openapi.json"):
            err = assert_error(c.get(path), 401)
            assert err["code"] == "invalid_api_key"
        assert_error(c.post("/v1/completions", json={"prompt": "x"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200
        assert c.get("/static/missing.js").status_code == 404  # open path: not a 401
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200


def test_body_limit_by_content_length_and_by_streamed_body():
    with client_for(max_body_bytes=200) as c:
        err = assert_error(c.post("/v1/completions", json={"prompt": "x" * 500}), 413)
        assert "200" in err["message"]

        def chunks():
            for _ in range(10):
                yield b" " * 50

        assert_error(c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_timeout_is_504_and_ends_streams_with_an_error_event():
    lm = scripted_lm(["ab"], context=1000, delay_s=0.02)
    with client_for(lm, request_timeout_s=0.3) as c:
        t0 = time.perf_counter()
        err = assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 500}), 504,
                           kind="timeout_error")
        assert "SHALIK_REQUEST_TIMEOUT_S" in err["message"] and time.perf_counter() - t0 < 2.0
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True})
        events = sse_events(r.text)
        assert json.loads(events[-2])["error"]["type"] == "timeout_error"
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_abandoned_score_stops_and_frees_its_slot():
    """/v1/score past its deadline (504) stopped neither the scoring nor its hold on the only slot: every request for
    the rest of the scoring was a 429. Now the scoring stops before its next block and the slot is free at once."""
    lm = scripted_lm(["ab"], context=64, delay_s=0.05)  # 0.05 s a block: ~60 windows take 3 s
    with client_for(lm, request_timeout_s=0.4, max_concurrency=1, max_queue=0) as c:
        t0 = time.perf_counter()
        assert_error(c.post("/v1/score", json={"text": [5] * 2000}), 504, kind="timeout_error")
        assert time.perf_counter() - t0 < 2.0
        assert wait_until(lambda: c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200,
                          limit_s=1.0)
        assert c.post("/v1/score", json={"text": [5] * 40}).status_code == 200


def test_score_cancel_stops_between_blocks():
    import threading

    from serve.errors import Cancelled

    lm = scripted_lm(["ab"], context=64)
    cancel = threading.Event()
    assert len(lm.score([5] * 300, cancel=cancel).token_nll) == 300
    cancel.set()
    with pytest.raises(Cancelled):
        lm.score([5] * 300, cancel=cancel)


HUGE = "9" * 4300  # as many digits as Python's JSON parser takes (sys.get_int_max_str_digits())


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a", "max_tokens": %s}', "max_tokens"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 1e300}', "max_tokens"),
    ("/v1/completions", '{"prompt": "a", "top_k": %s}', "top_k"),
    ("/v1/completions", '{"prompt": "a", "n": -%s}', "n"),
    ("/v1/completions", '{"prompt": "a", "logprobs": %s}', "logprobs"),
    ("/v1/completions", '{"prompt": "a", "best_of": %s}', "best_of"),
    ("/v1/completions", '{"prompt": [1, %s]}', "prompt"),
    ("/v1/completions", '{"prompt": [[1], [%s]]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": %s}',
     "max_completion_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "max_tokens": %s}', "max_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "logprobs": true, '
                             '"top_logprobs": %s}', "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "n": %s}', "n"),
    ("/v1/score", '{"text": [%s]}', "text"),
    ("/detokenize", '{"tokens": [%s]}', "tokens"),
])
def test_a_huge_integer_is_a_400_naming_the_field(client, path, body, param):
    """A 4300-digit max_tokens was a 500 (formatting prompt + max_tokens exceeded Python's digit limit) and a reset
    connection; every integer of a request is a 64-bit signed int, checked first, the number quoted by its digits."""
    r = client.post(path, content=(body % HUGE if "%s" in body else body).encode(),
                    headers={"content-type": "application/json"})
    err = assert_error(r, 400, param)
    assert "64-bit signed integer" in err["message"] and len(err["message"]) < 200 and err["code"] == "int64"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_max_tokens_up_to_64_bits_is_the_context_error(client):
    err = assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2**63 - 1}), 400,
                       "max_tokens")
    assert err["code"] == "context_length_exceeded" and str(2**63 - 1) in err["message"]
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2**63}), 400, "max_tokens")


# ---- metrics and schema


def test_metrics(client):
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    ok = ("shalik_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    bad = ("shalik_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))
    assert samples[ok] == 1 and samples[bad] == 1
    assert samples[("shalik_completion_tokens_total", ())] == 3
    assert samples[("shalik_prompt_tokens_total", ())] == 2
    assert samples[("shalik_time_to_first_token_seconds_count", ())] == 1
    assert samples[("shalik_decode_tokens_per_second_count", ())] == 1
    assert samples[("shalik_in_flight", ())] == 0 and samples[("shalik_queue_depth", ())] == 0
    # the engine's counters: one request of 1 + 1 prompt positions and 3 tokens (the last is never fed back)
    assert samples[("shalik_engine_admitted_total", ())] == 1
    assert samples[("shalik_engine_prefill_tokens_total", ())] == 2
    assert samples[("shalik_engine_decode_tokens_total", ())] == 2
    assert samples[("shalik_engine_steps_total", ())] == 3
    assert samples[("shalik_engine_running_sequences", ())] == 0
    assert samples[("shalik_engine_waiting_sequences", ())] == 0
    assert samples[("shalik_engine_queue_wait_seconds_total", ())] >= 0


def test_openapi_declares_errors_and_no_422():
    with client_for(api_key="k") as c:
        schema = c.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    comp = schema["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "401", "404", "413", "429", "503", "504"} <= set(comp["responses"])
    assert "text/event-stream" in comp["responses"]["200"]["content"]
    assert comp["security"] == [{"bearer": []}] and "security" not in schema["paths"]["/health"]["get"]
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "top_k", "repetition_penalty", "stream_options", "echo", "logprobs"} <= set(props)


def test_unsampleable_logits_are_a_clear_server_error_not_a_hang():
    lm = scripted_lm(["ab"], context=64)
    lm.backend.step_logits = lambda step, position: np.full(lm.vocab_size, np.nan, dtype=np.float32)
    with client_for(lm) as c:
        err = assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}), 500, kind="server_error")
        assert "NaN" in err["message"] and err["code"] == "model_output"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and json.loads(sse_events(r.text)[-2])["error"]["code"] == "model_output"
        assert c.get("/health").status_code == 200


def test_too_many_choices_in_one_request_is_a_400():
    from fastapi.testclient import TestClient

    from serve.http.app import MAX_CHOICES, create_app
    from tests.scripted import scripted_lm

    with TestClient(create_app(lm=scripted_lm())) as c:
        r = c.post("/v1/completions", json={"prompt": ["a"] * 3, "n": MAX_CHOICES // 2, "max_tokens": 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "n" and f"at most {MAX_CHOICES}" in err["message"]


# ---- bad bodies: a 400 that says what is wrong and names the field


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "ab\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 1}', "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/score", b'{"text": "\\ud800"}', "text"),
])
def test_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    err = assert_error(client.post(path, content=body, headers=JSON), 400, param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("body,needle", [
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'[' * 200_000 + b']' * 200_000, "nested"),
    (b'{"prompt": "x", "max_tokens": ' + b'1' * 5000 + b'}', "digits"),
])
def test_unparseable_bodies_say_why(client, body, needle):
    err = assert_error(client.post("/v1/completions", content=body, headers=JSON), 400)
    assert needle in err["message"] and "error parsing the body" not in err["message"]


@pytest.mark.parametrize("stop", ["", ["a", ""], 5, ["a", 5]])
def test_bad_stop_says_what_a_stop_is(client, stop):
    err = assert_error(client.post("/v1/completions", json={"prompt": "x", "stop": stop}), 400, "stop")
    assert "constrained-str" not in err["message"]
    assert "stop must be a non-empty string or a list of non-empty strings" in err["message"]


def test_echo_first_prompt_token_has_null_logprob_as_in_openai(random_client):
    """OpenAI and vLLM give the first echoed token no log-prob (nothing precedes it in the request): null, and
    clients index on that. /v1/score and LM.score keep the first token scored after <|endoftext|>."""
    lm = random_client.app.state.shalik.lm
    for stream in (False, True):
        r = random_client.post("/v1/completions", json={"prompt": "hello", "echo": True, "max_tokens": 1,
                                                        "logprobs": 2, "temperature": 0, "stream": stream})
        if stream:
            lp = [json.loads(e) for e in sse_events(r.text)[:-1]][0]["choices"][0]["logprobs"]
        else:
            lp = r.json()["choices"][0]["logprobs"]
        score = lm.score("hello")
        n = len(score.token_ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:n] == pytest.approx([-x for x in score.token_nll[1:]])
        assert all(len(d) == 2 for d in lp["top_logprobs"][1:])
    s = random_client.post("/v1/score", json={"text": "hello"}).json()
    assert s["token_nll"] == pytest.approx(lm.score("hello").token_nll) and s["token_nll"][0] > 0


def test_corrupt_bundle_is_503_naming_the_file_and_verify_can_be_turned_off(bundle, tmp_path):
    import shutil

    shutil.copytree(bundle, tmp_path / "b")
    data = bytearray((tmp_path / "b" / "model.onnx.data").read_bytes())
    data[100] ^= 1
    (tmp_path / "b" / "model.onnx.data").write_bytes(bytes(data))
    for env, status in (({}, 503), ({"SHALIK_VERIFY": "0"}, 200)):
        settings = Settings.from_env({"SHALIK_MODEL": str(tmp_path / "b"), **env})
        with TestClient(create_app(settings)) as c:
            deadline = time.monotonic() + 60  # the sha256 check of a small bundle: well under a second quiet
            while c.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
                time.sleep(0.05)
            h = c.get("/health")
            assert h.status_code == status, h.text
            if status == 503:
                assert "model.onnx.data is corrupt" in h.json()["detail"]
    with pytest.raises(SettingsError, match="SHALIK_VERIFY"):
        Settings.from_env({"SHALIK_VERIFY": "maybe"})
