"""The playground page (``GET /``, serve/static) driven in headless Chromium — Debian's ``chromium`` through
Playwright's Python package — against real uvicorn processes on loopback ports: a scripted model that emits
Bangla pieces at 0.1 s a token (for determinism and to watch the stream grow), one with an API key (errors),
and the real tiny ``bundle`` through ``uvicorn serve.app:app``.

Set SHALIK_PLAYGROUND_SCREENSHOT=benchmarks/results/playground.png to keep the screenshot of a Bangla
generation (it is always taken, into the test's tmp folder).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.client_helpers import free_port, server_process

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or next((p for p in ("/usr/bin/chromium",) if Path(p).exists()), None)
STATIC = ROOT / "serve" / "static"

PIECES = ["আমি ", "বাংলায় ", "গান ", "গাই। "]
DELAY_S = 0.1  # per token: a 12-token answer takes at least 1.2 s, so the page must show it grow
PROMPT = "একদিন সকালে"
WAIT_MS = 60_000  # for anything the page does; generous for a loaded 2-core machine
SCRIPTED = """
import json, sys
import uvicorn
from serve.http.app import create_app
from tests.scripted import scripted_lm
from serve.http.settings import Settings
cfg = json.loads(sys.argv[1])
app = create_app(Settings(**cfg["settings"]), scripted_lm(cfg["pieces"], **cfg["lm"]))
uvicorn.run(app, host="127.0.0.1", port=cfg["port"], log_level="warning")
"""


@contextmanager
def uvicorn_server(args: list[str], port: int, env: dict | None = None, health: int = 200) -> Iterator[str]:
    """Run ``python args...`` (a uvicorn server on ``port``) until /health answers ``health``; yield its URL;
    stop it, and fail when its log holds a traceback."""
    with server_process(args, port, env, health) as srv:
        yield srv.url
    assert "Traceback" not in srv.log, srv.log


def scripted_server(context: int, lm: dict | None = None, **settings) -> Iterator[str]:
    """A scripted model served by uvicorn; ``lm`` adds ``scripted_lm`` options (e.g. ``chat``, ``eos_after``)."""
    port = free_port()
    cfg = {"pieces": PIECES, "lm": {"context": context, "delay_s": DELAY_S, **(lm or {})}, "settings": settings,
           "port": port}
    return uvicorn_server(["-c", SCRIPTED, json.dumps(cfg)], port)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium for the browser tests: apt-get install chromium fonts-beng-extra "
                    "(.ci/run installs both)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright's Python package: pip install playwright")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def open_server():
    with scripted_server(4096) as url:
        yield url


@contextmanager
def new_page(browser, url: str, **options):
    """A fresh browser context (own localStorage) showing the playground; fails on any page error."""
    context = browser.new_context(viewport={"width": 1100, "height": 900}, **options)
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.set_default_timeout(WAIT_MS)
    try:
        page.goto(url + "/")
        yield page, problems
    finally:
        context.close()


def text(page, selector: str) -> str:
    return page.locator(selector).text_content() or ""


def fill(page, prompt: str, temperature: str, max_tokens: str, seed: str = "", top_p: str = "") -> None:
    page.fill("#prompt", prompt)
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.fill("#seed", seed)
    page.fill("#top-p", top_p)


def watch_output(page) -> None:
    """Record the completion's text at every DOM change (the page's own clock, so polling latency cannot hide
    progress): ``window.__seen`` is a list of [ms, text]."""
    page.evaluate("""() => {
        window.__seen = [];
        const node = document.getElementById("completion");
        new MutationObserver(() => window.__seen.push([performance.now(), node.textContent]))
            .observe(node, {childList: true, characterData: true, subtree: true});
    }""")


def wait_status(page, prefix: str) -> None:
    page.wait_for_function("p => document.getElementById('status').textContent.startsWith(p)", arg=prefix)


def complete(url: str, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_page_is_self_contained_and_never_stale():
    """Without a browser: every element app.js looks up exists, nothing is fetched from elsewhere (offline),
    and the page and its files are revalidated on every load (Cache-Control: no-cache, then 304)."""
    from fastapi.testclient import TestClient

    from serve.http.app import create_app
    from serve.http.settings import Settings
    from tests.scripted import scripted_lm

    html, js, css = ((STATIC / name).read_text(encoding="utf-8") for name in ("index.html", "app.js", "style.css"))
    ids = set(re.findall(r'\bid="([^"]+)"', html))
    wanted = set(re.findall(r'\$\("([^"]+)"\)', js))
    assert len(wanted) >= 20 and wanted <= ids, wanted - ids
    for name, source in (("index.html", html), ("app.js", js), ("style.css", css)):
        assert not re.search(r"(src|href)=\"(https?:)?//|url\(\s*['\"]?(https?:)?//|@import", source), name
    assert 'src="/static/app.js"' in html and 'href="/static/style.css"' in html
    with TestClient(create_app(Settings(api_key="k"), scripted_lm(PIECES))) as c:
        for path in ("/", "/static/app.js", "/static/style.css"):
            r = c.get(path)  # open paths: no key needed
            assert r.status_code == 200 and r.headers["cache-control"] == "no-cache", (path, r.headers)
            again = c.get(path, headers={"if-none-match": r.headers["etag"]}).status_code
            assert again == 304 if path.startswith("/static") else again in (200, 304)
        assert 'id="completion"' in c.get("/").text


def test_bangla_streams_progressively_and_equals_the_non_streamed_answer(browser, open_server, tmp_path):
    with new_page(browser, open_server) as (page, problems):
        page.wait_for_function("document.getElementById('model').textContent === 'scripted'")
        assert "context 4096 tokens" in text(page, "#context")
        assert page.input_value("#prompt")  # a default (Bangla) prompt is there
        fill(page, PROMPT, "0", "12", seed="7")
        watch_output(page)
        page.click("#generate")
        wait_status(page, "done")
        final = text(page, "#completion")
        seen = [t for _, t in page.evaluate("window.__seen")]
        expected = complete(open_server, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "seed": 7})
        assert final == expected["choices"][0]["text"] == "".join(PIECES) * 3
        assert text(page, "#echo") == PROMPT
        assert all(final.startswith(t) for t in seen), seen  # it only ever grew
        # shown part-way before the end: streamed, not all at once (one state, since a starved browser may paint
        # several chunks at once: under CI beside a training job it painted 4 tokens, then all 12)
        partial = {t for t in seen if t and t != final}
        assert partial, seen
        assert text(page, "#tokens") == "12" == str(expected["usage"]["completion_tokens"])
        assert text(page, "#finish") == "length"
        assert re.fullmatch(r"\d+ ms", text(page, "#ttft")), text(page, "#ttft")
        tps = text(page, "#tps")
        assert re.fullmatch(r"\d+\.\d", tps), tps
        # At 0.1 s a token the server makes at most 10 tokens/s; 100 would need the 1.1 s of decoding to
        # arrive bunched into 0.11 s.
        assert 0 < float(tps) <= 100, tps
        assert page.locator("#error").is_hidden() and page.is_enabled("#generate") and page.is_disabled("#stop")
        shot = tmp_path / "playground.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000
        if os.environ.get("SHALIK_PLAYGROUND_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["SHALIK_PLAYGROUND_SCREENSHOT"])
        assert not problems, problems


def test_stop_aborts_and_the_server_stops_generating(browser, open_server):
    with new_page(browser, open_server) as (page, problems):
        page.wait_for_function("document.getElementById('model').textContent === 'scripted'")
        fill(page, PROMPT, "0", "3000")
        page.click("#generate")
        page.wait_for_function(f"document.getElementById('completion').textContent.length >= {len(''.join(PIECES))}")
        assert page.is_disabled("#generate")
        page.click("#stop")
        wait_status(page, "stopped")
        at_stop = text(page, "#completion")
        assert page.is_enabled("#generate") and page.is_disabled("#stop") and page.locator("#error").is_hidden()
        time.sleep(0.5)  # the server notices the closed connection within ~50 ms and cancels before the next token
        tokens = metric(open_server, "shalik_completion_tokens_total")
        assert metric(open_server, "shalik_in_flight") == 0
        time.sleep(1.0)  # 10 more tokens' worth, had it kept going
        assert metric(open_server, "shalik_completion_tokens_total") == tokens < 3000
        assert text(page, "#completion") == at_stop and "".join(PIECES * 750).startswith(at_stop)
        assert not problems, problems


def test_errors_and_api_key(browser):
    key = "sesame"
    with scripted_server(96, api_key=key, request_timeout_s=3) as url, new_page(browser, url) as (page, problems):
        # no key: /v1/models is refused, and the page says so (status, server message, where to put the key)
        page.wait_for_selector("#error:not([hidden])")
        assert "HTTP 401" in text(page, "#error") and "missing API key" in text(page, "#error")
        assert text(page, "#model") == "unavailable" and page.locator("#auth").get_attribute("open") is not None

        page.fill("#api-key", "wrong")
        page.dispatch_event("#api-key", "change")
        fill(page, PROMPT, "0", "4")
        with page.expect_response("**/v1/completions") as response:
            page.click("#generate")
        assert response.value.status == 401
        wait_status(page, "error")
        wrong = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401
        assert f"HTTP 401 Unauthorized: {wrong.json()['error']['message']}" in text(page, "#error")

        page.fill("#api-key", key)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.getElementById('model').textContent === 'scripted'")
        assert page.locator("#error").is_hidden()

        # max tokens beyond the context: the server's own message, shown in the error area
        auth = {"Authorization": f"Bearer {key}"}
        fill(page, PROMPT, "0", "1000")
        with page.expect_response("**/v1/completions") as response:
            page.click("#generate")
        assert response.value.status == 400
        wait_status(page, "error")
        over = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000}, headers=auth)
        assert over.status_code == 400 and "context length 96" in over.json()["error"]["message"]
        assert text(page, "#error").strip() == f"HTTP 400 Bad Request: {over.json()['error']['message']}"
        assert text(page, "#completion") == ""

        # a number that is not one is caught before any request
        page.fill("#temperature", "")
        page.click("#generate")
        assert "Temperature is required" in text(page, "#error")

        # an error event in the middle of the stream (SHALIK_REQUEST_TIMEOUT_S=3; 60 tokens take 6 s)
        fill(page, PROMPT, "0", "60")
        with page.expect_response("**/v1/completions") as response:
            page.click("#generate")
        assert response.value.status == 200  # the status line went out before the timeout
        wait_status(page, "error")
        assert "Error during generation: the request took longer than 3 s" in text(page, "#error")
        assert "".join(PIECES * 15).startswith(text(page, "#completion")) and text(page, "#completion")

        # Ctrl+Enter generates (4 tokens: 0.4 s, far within the timeout); the error area clears
        fill(page, PROMPT, "0", "4")
        page.press("#prompt", "Control+Enter")
        wait_status(page, "done")
        assert page.locator("#error").is_hidden()
        expected = complete(url, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}, auth)["choices"][0]["text"]
        assert text(page, "#completion") == expected == "".join(PIECES)

        # the key is remembered by this browser
        page.reload()
        page.wait_for_function("document.getElementById('model').textContent === 'scripted'")
        assert page.input_value("#api-key") == key
        # 401s from the page's own requests are logged by Chromium as console errors: only those are expected
        assert all("401" in p or "400" in p for p in problems), problems


def test_real_bundle_in_the_browser(browser, bundle):
    port = free_port()
    env = {"SHALIK_MODEL": str(bundle), "SHALIK_THREADS": "2"}
    args = ["-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with uvicorn_server(args, port, env) as url, new_page(browser, url) as (page, problems):
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        page.wait_for_function("id => document.getElementById('model').textContent === id", arg=model["id"])
        assert f"context {model['max_model_len']} tokens" in text(page, "#context")
        prompt = "আমার সোনার বাংলা"
        fill(page, prompt, "0", "24", seed="1")
        page.click("#generate")
        wait_status(page, "done")
        expected = complete(url, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "seed": 1})
        assert text(page, "#completion") == expected["choices"][0]["text"]
        assert text(page, "#tokens") == str(expected["usage"]["completion_tokens"])
        assert text(page, "#finish") == expected["choices"][0]["finish_reason"]
        assert page.locator("#error").is_hidden()
        assert not problems, problems


def test_missing_model_is_reported(browser, tmp_path):
    port = free_port()
    env = {"SHALIK_MODEL": str(tmp_path / "missing")}
    args = ["-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with uvicorn_server(args, port, env, health=503) as url, new_page(browser, url) as (page, problems):
        page.wait_for_selector("#error:not([hidden])")
        detail = httpx.get(f"{url}/health", timeout=10).json()["detail"]
        assert "is not a directory" in detail
        assert text(page, "#error").strip() == f"HTTP 503: {detail}" and text(page, "#model") == "unavailable"
        assert all("503" in p for p in problems), problems  # Chromium logs the refused /v1/models itself


def chat(url: str, messages: list[dict], **body) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_view_takes_turns_and_equals_the_api(browser):
    """The chat view: a system message and two turns, each streamed into its own bubble and equal to
    /v1/chat/completions with the same conversation (the second turn carries the first); a new chat forgets it."""
    with scripted_server(4096, lm={"chat": True, "eos_after": 3}) as url, new_page(browser, url) as (page, problems):
        page.wait_for_function("document.getElementById('model').textContent === 'scripted'")
        assert page.locator("#chat-log").is_hidden() and page.locator("#chat-setup").is_hidden()
        page.check("#mode-chat")
        assert page.locator("#output").is_hidden() and page.is_visible("#chat-setup") and page.is_visible("#new-chat")
        assert text(page, "#generate") == "Send"
        page.fill("#system", "তুমি একজন সহায়ক।")
        fill(page, "বাংলা ভাষা সম্পর্কে কিছু বলো।", "0", "16")
        page.click("#generate")
        wait_status(page, "done")
        system = {"role": "system", "content": "তুমি একজন সহায়ক।"}
        first = [system, {"role": "user", "content": "বাংলা ভাষা সম্পর্কে কিছু বলো।"}]
        reply = chat(url, first, max_tokens=16, temperature=0)["choices"][0]
        assert reply["finish_reason"] == "stop" and reply["message"]["content"] == "".join(PIECES[:3])
        bubbles = page.locator("#chat-log li")
        assert bubbles.count() == 2 and bubbles.nth(1).text_content() == reply["message"]["content"]
        assert page.input_value("#prompt") == "" and text(page, "#finish") == "stop" and text(page, "#tokens") == "3"

        page.fill("#prompt", "আরও বলো")
        page.click("#generate")
        wait_status(page, "done")
        second = [*first, {"role": "assistant", "content": reply["message"]["content"]},
                  {"role": "user", "content": "আরও বলো"}]
        again = chat(url, second, max_tokens=16, temperature=0)
        assert again["usage"]["prompt_tokens"] > chat(url, first, max_tokens=16)["usage"]["prompt_tokens"]
        assert [b.get_attribute("class") for b in bubbles.all()] == ["user", "assistant", "user", "assistant"]
        assert bubbles.nth(3).text_content() == again["choices"][0]["message"]["content"]

        page.click("#new-chat")
        assert bubbles.count() == 0
        page.check("#mode-completion")
        assert page.is_visible("#output") and page.locator("#chat-log").is_hidden()
        assert text(page, "#generate") == "Generate"
        assert not problems, problems


def test_chat_view_says_when_the_model_has_no_chat_template(browser, open_server):
    """A base model (no chat tokens): the server's 400 with what is missing and how to get it, in the error area;
    nothing joins the conversation and the message stays in the box."""
    with new_page(browser, open_server) as (page, problems):
        page.wait_for_function("document.getElementById('model').textContent === 'scripted'")
        page.check("#mode-chat")
        fill(page, "hello", "0", "4")
        with page.expect_response("**/v1/chat/completions") as response:
            page.click("#generate")
        assert response.value.status == 400
        wait_status(page, "error")
        assert "has no chat template" in text(page, "#error") and "train.sft" in text(page, "#error")
        assert page.locator("#chat-log li").count() == 0 and page.input_value("#prompt") == "hello"
        assert all("400" in p for p in problems), problems
