"""The HTTP server as a real ``uvicorn`` process on a loopback port, driven over sockets by httpx:
client disconnects (H5), a busy model not blocking the event loop (H6), unbuffered streaming, overload
(429 at once) and seeded reproducibility under concurrency (S5). Each server serves a scripted model."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.client_helpers import ServerProcess, free_port, server_process

ROOT = Path(__file__).resolve().parent.parent

SERVER = """
import json, sys
import uvicorn
from serve.http.app import create_app
from tests.scripted import scripted_lm
from serve.http.settings import Settings
cfg = json.loads(sys.argv[1])
lm = scripted_lm(cfg["pieces"], **cfg["lm"])
uvicorn.run(create_app(Settings(**cfg["settings"]), lm), host="127.0.0.1", port=cfg["port"], log_level="info")
"""


def metric(srv: ServerProcess, name: str) -> float:
    """The value of the Prometheus sample ``name`` on the server's /metrics."""
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@contextmanager
def live_server(pieces=("ab",), lm=None, **settings) -> Iterator[ServerProcess]:
    cfg = {"pieces": list(pieces) if pieces is not None else None, "lm": lm or {}, "settings": settings,
           "port": free_port()}
    with server_process(["-c", SERVER, json.dumps(cfg)], cfg["port"], startup_s=60) as srv:
        yield srv


def first_chunk(client: httpx.Client, url: str, body: dict) -> tuple[float, str]:
    """Seconds until the first SSE data line of a streamed completion, and that line."""
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                return time.perf_counter() - t0, line
    raise AssertionError("no data line")


@pytest.mark.parametrize("path, body, chat", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, True)])
def test_h5_disconnect_cancels_generation(path, body, chat):
    with live_server(["ab"], lm={"context": 20_000, "delay_s": 0.01, "chat": chat}, max_concurrency=1) as srv:
        client = httpx.Client(timeout=10)
        with client.stream("POST", f"{srv.url}{path}", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        client.close()  # the response was not read to the end: the connection is closed
        # no pace to keep: the server notices the hang-up whenever a loaded machine lets it, then stops
        wait_for(lambda: metric(srv, "shalik_in_flight") == 0, "the disconnected request leaves the server")
        stopped = metric(srv, "shalik_completion_tokens_total")
        time.sleep(0.4)
        assert metric(srv, "shalik_completion_tokens_total") == stopped  # the counter stopped
        assert stopped < 5_000  # 10 ms/token: had it run on, the 10,000 tokens would take 100 s
        with httpx.Client(timeout=60) as c2:  # the single slot is free: the next request is not queued behind it
            ttft, _ = first_chunk(c2, srv.url, {"prompt": "x", "max_tokens": 3})
        assert ttft < 30, ttft  # behind the 10,000-token request it would wait ~100 s
    assert "Exception in ASGI application" not in srv.log and "Traceback" not in srv.log, srv.log


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout_s`` (a state the test holds with a
    gate, so the deadline is only for a broken server, not a pace the machine must keep)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.01)


def test_h6_busy_model_does_not_block_the_event_loop(tmp_path):
    """Two streams share the model: the first request's prefill is held (the engine inside its step) until the
    second waits in the engine's queue, so both join the next step; then the model spins the CPU in Python
    (holding the GIL between switches) at the decode gate, after A's 2nd and B's 1st token. Every /v1/models
    answer given meanwhile came while the model was busy (a blocked event loop would never answer), both first
    chunks came while the rest were unmade, and both streams then finish."""
    prefill_gate, gate = tmp_path / "prefill", tmp_path / "decode"
    lm = {"context": 256, "delay_s": 0.005, "busy": True, "gate": str(gate), "gate_after": 2,
          "prefill_gate": str(prefill_gate)}
    with live_server(["ab"], lm=lm, max_concurrency=2) as srv:
        chunks: dict[int, list[str]] = {0: [], 1: []}

        def stream(i: int) -> None:
            with httpx.Client(timeout=120) as c, c.stream(
                    "POST", f"{srv.url}/v1/completions",
                    json={"prompt": "x", "max_tokens": 40, "stream": True, "temperature": 0}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks[i].append(json.loads(line[6:])["choices"][0]["text"])

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
        threads[0].start()
        wait_for(lambda: metric(srv, "shalik_engine_running_sequences") == 1, "A's prefill in the engine")
        threads[1].start()
        wait_for(lambda: metric(srv, "shalik_engine_waiting_sequences") == 1, "B in the engine's queue")
        prefill_gate.touch()
        # step 1: A's prefill (token 1); step 2: A's decode (2) and B's prefill (1); step 3 waits at the gate
        wait_for(lambda: len(chunks[0]) == 2 and len(chunks[1]) == 1, "A's 2 and B's first chunk")
        latencies = []
        with httpx.Client(timeout=10) as c:  # typically ~10 ms; a loop blocked by the model: no answer at all
            for _ in range(10):
                s = time.perf_counter()
                assert c.get(f"{srv.url}/v1/models").status_code == 200
                latencies.append(time.perf_counter() - s)
        assert metric(srv, "shalik_engine_running_sequences") == 2 and metric(srv, "shalik_in_flight") == 2
        # the model was held (busy) through every answer, both streams still open
        assert chunks == {0: ["ab"] * 2, 1: ["ab"]} and all(t.is_alive() for t in threads), latencies
        gate.touch()
        for t in threads:
            t.join(timeout=120)
    assert {i: "".join(c) for i, c in chunks.items()} == {0: "ab" * 40, 1: "ab" * 40}, chunks


def test_overload_gets_429_at_once_and_queued_request_completes(tmp_path):
    """One request holds the only slot (its model held by the gate) and one waits in the only queue place:
    three more are refused with 429 and Retry-After while both are still held (at once: not after a slot
    freed), and the queued one completes once the gate opens."""
    gate = tmp_path / "open"
    lm = {"context": 256, "gate": str(gate), "gate_after": 1}
    with live_server(["ab"], lm=lm, max_concurrency=1, max_queue=1) as srv:
        admitted: list[httpx.Response] = []

        def call() -> None:
            admitted.append(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 40},
                                       timeout=120))

        threads = [threading.Thread(target=call, daemon=True) for _ in range(2)]
        threads[0].start()
        wait_for(lambda: metric(srv, "shalik_in_flight") == 1, "the first request in the slot")
        threads[1].start()
        wait_for(lambda: metric(srv, "shalik_queue_depth") == 1, "the second request in the queue")
        refused = [httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 40}, timeout=10)
                   for _ in range(3)]
        assert metric(srv, "shalik_in_flight") == 1 and metric(srv, "shalik_queue_depth") == 1
        assert admitted == [] and all(t.is_alive() for t in threads)  # both still held when each 429 came
        gate.touch()
        for t in threads:
            t.join(timeout=120)
    assert [r.status_code for r in refused] == [429] * 3
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
               for r in refused), [r.text for r in refused]
    assert [r.status_code for r in admitted] == [200, 200], [r.text for r in admitted]
    assert all(r.json()["choices"][0]["text"] == "ab" * 40 for r in admitted)


def test_s5_seeded_request_reproducible_beside_others():
    body = {"prompt": "p", "max_tokens": 16, "temperature": 0.8, "seed": 42}
    with live_server(None, lm={"context": 256, "delay_s": 0.005}, max_concurrency=3) as srv:
        url = f"{srv.url}/v1/completions"
        alone = [httpx.post(url, json=body, timeout=30).json()["choices"][0]["text"] for _ in range(3)]
        together: dict[str, str] = {}

        def call(key: str, extra: dict) -> None:
            together[key] = httpx.post(url, json={**body, **extra}, timeout=30).json()["choices"][0]["text"]

        threads = [threading.Thread(target=call, args=(k, e)) for k, e in
                   [("A", {}), ("B", {"seed": None}), ("C", {"seed": 7})]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        streamed = ""
        with httpx.Client(timeout=30) as c, c.stream("POST", url, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
    assert len(set(alone)) == 1 and together["A"] == alone[0] and together["C"] != alone[0]
    assert streamed == alone[0]


def test_openai_client_and_api_key_over_the_wire():
    openai = pytest.importorskip("openai")
    with live_server(["ab", "cd"], api_key="k") as srv:
        assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
        r = httpx.get(f"{srv.url}/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["scripted"]
        done = client.completions.create(model="scripted", prompt="x", max_tokens=4, logprobs=1)
        assert done.choices[0].text == "abcdabcd" and done.usage.completion_tokens == 4
        assert done.choices[0].logprobs.tokens == ["ab", "cd", "ab", "cd"]
        chunks = list(client.completions.create(model="scripted", prompt=["x", "y"], max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}))
        texts = {0: "", 1: ""}
        for ch in chunks[:-1]:
            texts[ch.choices[0].index] += ch.choices[0].text
        assert texts == {0: "abcdab", 1: "abcdab"} and chunks[-1].usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="scripted", prompt="x", max_tokens=10_000)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()


# ---- start-up and transport faults a real uvicorn shows


def test_body_shorter_than_its_content_length_is_answered_408_not_held():
    """A client that announces 100 bytes and sends 10 gets 408 once SHALIK_BODY_TIMEOUT_S passes without more
    (raw socket on 127.0.0.1; without the timeout the connection stays open with no answer)."""
    import socket

    with live_server(body_timeout_s=1.0) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":")
            s.settimeout(8)
            answer = b""
            try:
                while b"\r\n\r\n" not in answer:
                    piece = s.recv(4096)
                    if not piece:
                        break
                    answer += piece
            except TimeoutError:
                pass
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200  # the server is fine


def test_broken_bundle_cause_is_logged_at_start_up(tmp_path):
    port = free_port()
    argv = ["-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port", str(port)]
    with server_process(argv, port, {"SHALIK_MODEL": str(tmp_path)}, health=503) as srv:
        for _ in range(100):
            if httpx.get(f"{srv.url}/health", timeout=5).json()["status"] == "unavailable":
                break
            time.sleep(0.1)
    assert "tokenizer.json is missing" in srv.log and "Application startup complete" in srv.log


def test_bad_setting_prints_its_message_alone_and_exits_non_zero():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "uvicorn", "serve.app:app", "--port", str(free_port())],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SHALIK_MAX_CONCURRENCY": "abc"})
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr
    assert "SHALIK_MAX_CONCURRENCY='abc': expected a positive integer" in out.stderr


def test_an_api_key_no_client_can_send_stops_the_server_with_one_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "uvicorn", "serve.app:app", "--port", str(free_port())],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SHALIK_API_KEY": " secret"})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: SHALIK_API_KEY has leading or trailing whitespace") and "secret" not in out.stderr


def test_body_timeout_does_not_cut_a_stream_that_outlasts_it():
    with live_server(("ab",), lm={"delay_s": 0.05}, body_timeout_s=0.5) as srv:
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{srv.url}/v1/completions", json={
                "prompt": "x", "max_tokens": 30, "stream": True, "temperature": 0}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "error" not in "".join(events)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == "ab" * 30
