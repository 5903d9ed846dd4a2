"""The HTTP server: ``uvicorn serve.app:app`` (OpenAI-style completions over a Shalik bundle, no torch).

Configured by ``SHALIK_*`` environment variables (:mod:`serve.settings`). ``create_app(settings, lm)`` builds
an app (tests inject a scripted :class:`serve.lm.LM`); the module-level ``app`` loads its model in a
background thread at startup, and ``/health`` answers 503 until it is loaded — or says why it cannot be.

Endpoints: ``GET /`` (the playground page from ``serve/static/index.html`` when present), ``/static/*``,
``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/score``, ``GET /metrics``, and
vLLM's ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``.

Generation runs in a thread per request (at most ``SHALIK_MAX_CONCURRENCY`` at once, at most
``SHALIK_MAX_QUEUE`` waiting, else 429); streamed events are sent as they are made; a client that goes
away cancels its generation before the next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from serve.backends.base import BackendError
from serve.errors import ModelOutputError, RequestError
from serve.http_errors import HTTPError, error_body, error_response
from serve.lm import EOT, LM, Chunk, Generation, load
from serve.metrics import CONTENT_TYPE, Metrics
from serve.middleware import GuardMiddleware, MetricsMiddleware
from serve.runner import Admission, Overloaded, ThreadedRun
from serve.schemas import (
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from serve.settings import Settings

log = logging.getLogger("shalik.serve")
STATIC_DIR = Path(__file__).resolve().parent / "static"
VERSION = "0.1.0"
DISCONNECT_POLL_S = 0.05
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: The playground page and its files: browsers revalidate (ETag / Last-Modified) on every load, never stale
NO_CACHE = {"Cache-Control": "no-cache"}
#: One server-sent event (OpenAPI 3.1: the text/event-stream schema describes each event)
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                            "description": "a CompletionResponse chunk (`usage` null, or `choices` empty and "
                                           "`usage` set for the usage chunk), an error body, or `[DONE]`"},
                   "event": {"type": "string"}, "id": {"type": "string"}}}
PLACEHOLDER_PAGE = """<!doctype html><html lang="bn"><meta charset="utf-8"><title>Shalik</title>
<h1>শালিক · Shalik</h1><p>A small Bangla-first language model. API: <a href="/docs">/docs</a>,
<code>POST /v1/completions</code>, <code>POST /v1/score</code>, <a href="/health">/health</a>.</p></html>"""


class OptionalStaticFiles(StaticFiles):
    """StaticFiles that answers 404 (not 500) while its folder does not exist yet (git keeps no empty
    folders), and sends ``Cache-Control: no-cache`` (the playground's files are revalidated, never stale)."""

    async def check_config(self) -> None:
        if self.directory is not None and Path(self.directory).is_dir():
            await super().check_config()

    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(NO_CACHE)
        return response


def is_open_path(path: str) -> bool:
    """Paths served without the API key: ``/``, ``/health`` and ``/static/*``."""
    return path in ("/", "/health") or path == "/static" or path.startswith("/static/")


class ServerState:
    """The app's model (loaded lazily), settings, metrics and admission control."""

    def __init__(self, settings: Settings, lm: LM | None):
        self.settings = settings
        self.lm = lm
        self.metrics = Metrics()
        self.problem: str | None = None if lm is not None else settings.model_problem
        if lm is None and settings.model is None and self.problem is None:
            self.problem = "no model configured (set SHALIK_MODEL to a bundle folder)"
        self.loading = False
        self._admission: Admission | None = None
        self.created = int(time.time())
        if settings.model_name:
            self.name = settings.model_name
        elif lm is not None and settings.model is None:
            self.name = lm.name
        else:
            self.name = settings.served_name

    @property
    def admission(self) -> Admission:
        """Admission control, created on first use inside the running event loop."""
        if self._admission is None:
            s = self.settings
            self._admission = Admission(s.max_concurrency, s.max_queue, self.metrics)
        return self._admission

    def startup(self) -> None:
        """At server start (inside its loop): fresh admission control, and start loading the model."""
        s = self.settings
        self._admission = Admission(s.max_concurrency, s.max_queue, self.metrics)
        self.start_loading()

    def start_loading(self) -> None:
        """Load the bundle in a background thread (no-op when a model is present or cannot be found)."""
        if self.lm is not None or self.problem is not None or self.loading:
            return
        self.loading = True
        threading.Thread(target=self._load, name="shalik-load", daemon=True).start()

    def _load(self) -> None:
        s = self.settings
        try:
            self.lm = load(s.model, backend=s.backend, quantize=s.quantize, threads=s.threads, name=self.name)
        except Exception as e:  # reported by /health; the server keeps answering
            self.problem = f"loading {s.model} with the {s.backend} backend failed: {type(e).__name__}: {e}"
        finally:
            self.loading = False

    def require_lm(self) -> LM:
        """The model, or HTTPError 503 (loading / unavailable, with the reason)."""
        if self.lm is not None:
            return self.lm
        self.start_loading()  # in case the app runs without its lifespan
        if self.problem is not None:
            raise HTTPError(503, f"no model is available: {self.problem}", code="model_not_loaded")
        raise HTTPError(503, "the model is still loading; retry shortly", code="model_loading",
                        headers={"Retry-After": "1"})

    def check_model(self, model: str | None) -> None:
        """HTTPError 404 unless ``model`` is None or the served id."""
        if model is not None and model != self.name:
            raise HTTPError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                            param="model", code="model_not_found")

    def health(self) -> tuple[int, Health]:
        if self.lm is not None:
            lm = self.lm
            return 200, Health(status="ok", model=self.name, backend=getattr(lm.backend, "name", None),
                               quantize=getattr(lm.backend, "quantize", None) or "none",
                               vocab_size=lm.vocab_size, context_length=lm.context_length)
        if self.problem is not None:
            return 503, Health(status="unavailable", model=self.name, detail=self.problem)
        return 503, Health(status="loading", model=self.name, detail=f"loading {self.settings.model}")


# ---- request → generations


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms → a list of prompts (text or token ids). RequestError for empty lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if isinstance(prompt[0], list) and any(not p for p in prompt):
        raise RequestError("prompt holds an empty list of token ids", param="prompt")
    return list(prompt)


MAX_CHOICES = 128  # prompts × n in one request: they all run in one concurrency slot


def start_generations(lm: LM, req: CompletionRequest, default_max_tokens: int) -> list[Generation]:
    """One :class:`Generation` per (prompt, choice), prompt-major (OpenAI's choice order). Choice j of every
    prompt uses random stream j of the seed. Raises RequestError before anything runs."""
    options = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed, stop=req.stop, top_logprobs=req.logprobs,
        echo=req.echo and req.logprobs is not None, default_max_new_tokens=default_max_tokens)
    prompts = split_prompts(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise RequestError(f"{len(prompts)} prompts × n = {req.n} asks for {len(prompts) * req.n} completions in one "
                           f"request; at most {MAX_CHOICES} are allowed (they share one concurrency slot)", param="n",
                           code="too_many_completions")
    return [lm.start(p, req.max_tokens, index=j, **options) for p in prompts for j in range(req.n)]


def prompt_usage(gens: Sequence[Generation], n: int) -> int:
    """Prompt tokens of a request: each prompt once, whatever ``n``."""
    return sum(g.prompt_tokens for g in gens[::n])


def echo_part(lm: LM, gen: Generation, with_logprobs: bool) -> tuple[str, dict[str, list] | None]:
    """The echoed prompt: its text, and (with logprobs) its tokens' OpenAI logprobs lists."""
    if gen.prompt is None:
        return lm.detokenize(gen.prompt_ids), ({"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                 "text_offset": []} if with_logprobs else None)
    p = gen.prompt
    lists = {"tokens": p.tokens, "token_logprobs": p.logprobs, "top_logprobs": p.top_logprobs or [{} for _ in p.tokens],
             "text_offset": p.text_offset} if with_logprobs else None
    return p.text, lists


def logprob_lists(lm: LM, chunk: Chunk, offset: int) -> dict[str, list]:
    """OpenAI logprobs lists for a chunk's tokens; ``text_offset`` shifted by ``offset`` characters."""
    return {"tokens": lm.token_strings(chunk.token_ids), "token_logprobs": chunk.logprobs,
            "top_logprobs": chunk.top_logprobs or [{} for _ in chunk.token_ids],
            "text_offset": [o + offset for o in chunk.text_offset]}


def end_of_text_lists(gen: Generation, offset: int) -> dict[str, list] | None:
    """The end-of-text a choice stopped at, as one more logprobs entry (no text; at character ``offset``), as
    vLLM reports it: lm-evaluation-harness reads ``token_logprobs[ctxlen:-1]`` of an echo with ``max_tokens: 1``
    and so needs the generated step even when it is the end of the text. None when it did not stop there."""
    if gen.end_of_text is None:
        return None
    logprob, top = gen.end_of_text
    return {"tokens": [EOT], "token_logprobs": [logprob], "top_logprobs": [top or {}], "text_offset": [offset]}


def merge_lists(parts: Iterable[dict[str, list] | None]) -> dict[str, list] | None:
    out: dict[str, list] | None = None
    for p in parts:
        if p is None:
            continue
        out = out or {k: [] for k in p}
        for k, v in p.items():
            out[k].extend(v)
    return out


def choice_dict(index: int, text: str, logprobs: dict[str, list] | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason if finish_reason in ("stop", "length") else None}


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (UTF-8, no ASCII escaping)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n".encode()


# ---- the app


def create_app(settings: Settings | None = None, lm: LM | None = None) -> FastAPI:
    """Build the server. ``settings`` default to the environment; ``lm`` (an :class:`LM`, e.g. scripted)
    replaces loading the bundle named by the settings."""
    settings = Settings.from_env() if settings is None else settings
    state = ServerState(settings, lm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.startup()
        yield

    app = FastAPI(title="Shalik", version=VERSION, lifespan=lifespan,
                  description="A small Bangla-first language model served on CPU (OpenAI-style completions).")
    app.state.shalik = state
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       is_open=is_open_path)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics, paths=lambda: [r.path for r in app.routes])
    _install_error_handlers(app)
    _install_openapi(app, settings, state)
    app.mount("/static", OptionalStaticFiles(directory=STATIC_DIR, check_dir=False), name="static")

    def err(*codes: int) -> dict:
        auth = (401,) if settings.api_key else ()
        return {c: {"model": ErrorResponse} for c in (*auth, *codes)}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> Response:
        page = STATIC_DIR / "index.html"
        return FileResponse(page, headers=NO_CACHE) if page.is_file() else HTMLResponse(PLACEHOLDER_PAGE)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        """200 with model information once the model is loaded; 503 while loading or when unavailable."""
        status, body = state.health()
        return JSONResponse(body.model_dump(), status_code=status)

    @app.get("/v1/models", response_model=ModelList, responses=err(503))
    async def models() -> ModelList:
        lm = state.require_lm()
        return ModelList(data=[ModelCard(id=state.name, created=state.created, max_model_len=lm.context_length)])

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}, **err()})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=err(503))
    async def tokenizer_info() -> TokenizerInfo:
        lm = state.require_lm()
        return TokenizerInfo(eos_token=EOT, pad_token="<|pad|>", model_max_length=lm.context_length,
                             vocab_size=lm.vocab_size)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=err(400, 404, 413, 503))
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: ids of the text (no special token added; ``<|endoftext|>`` is prepended only
        internally when generating)."""
        lm = state.require_lm()
        state.check_model(req.model)
        ids = await run_in_threadpool(lm.tokenize, req.prompt)
        return TokenizeResponse(count=len(ids), max_model_len=lm.context_length, tokens=ids,
                                token_strs=lm.token_strings(ids))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=err(400, 404, 413, 503))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        lm = state.require_lm()
        state.check_model(req.model)
        return DetokenizeResponse(prompt=lm.detokenize(req.tokens))

    @app.post("/v1/score", response_model=ScoreResponse, responses=err(400, 404, 413, 429, 503, 504))
    async def score(req: ScoreRequest, request: Request) -> ScoreResponse:
        """Per-token negative log-likelihood (nats) and bits per NFC character of a text."""
        arrived = time.perf_counter()
        lm = state.require_lm()
        state.check_model(req.model)
        deadline = arrived + settings.request_timeout_s
        _refuse_early(state)
        await _admit(state, deadline)
        s = await _wait(_in_slot_thread(state, lm.score, req.text), request, deadline, on_abandon=lambda: None)
        state.metrics.prompt_tokens.inc(len(s.token_ids))
        return ScoreResponse(model=state.name, text=s.text, token_ids=s.token_ids, tokens=lm.token_strings(s.token_ids),
                             token_nll=s.token_nll, nll_sum=s.nll_sum, nll_mean=s.nll_mean, chars=s.chars,
                             bits_per_char=s.bits_per_char)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                               "description": "JSON, or with `stream: true` server-sent events of "
                                              "CompletionResponse chunks ending with `data: [DONE]`."},
                         **err(400, 404, 413, 429, 503, 504)})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        """OpenAI's completions. All validation happens before a stream starts."""
        arrived = time.perf_counter()
        lm = state.require_lm()
        state.check_model(req.model)
        _refuse_early(state)
        gens = await run_in_threadpool(start_generations, lm, req, settings.default_max_tokens)
        deadline = arrived + settings.request_timeout_s
        await _admit(state, deadline)
        state.metrics.prompt_tokens.inc(prompt_usage(gens, req.n))
        try:
            run = ThreadedRun(gens, on_end=state.admission.release, metrics=state.metrics, arrived_at=arrived)
            run.start()
        except BaseException:
            state.admission.release()
            raise
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": state.name}
        if req.stream:
            return StreamingResponse(_stream(lm, req, gens, run, meta, deadline, settings),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await _complete(lm, req, gens, run, meta, request, deadline))

    return app


def _overloaded(e: Overloaded) -> HTTPError:
    return HTTPError(429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)})


def _refuse_early(state: ServerState) -> None:
    """429 before any work (tokenizing, validating ids) when the server is already full."""
    try:
        state.admission.check()
    except Overloaded as e:
        raise _overloaded(e) from None


async def _admit(state: ServerState, deadline: float) -> None:
    """Take a generation slot: 429 when slots and queue are full, 504 when the wait outlasts the deadline."""
    try:
        await state.admission.acquire(deadline - time.perf_counter())
    except Overloaded as e:
        raise _overloaded(e) from None
    except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
        raise _timeout(state.settings) from None


def _in_slot_thread(state: ServerState, fn, *args) -> asyncio.Future:
    """Run ``fn(*args)`` in a worker thread that holds the caller's generation slot and gives it back when
    ``fn`` returns — even if the caller stopped waiting (timeout, disconnect)."""
    def work():
        try:
            return fn(*args)
        finally:
            state.admission.release()

    try:
        return asyncio.get_running_loop().run_in_executor(None, work)
    except BaseException:
        state.admission.release()
        raise


def _timeout(settings: Settings) -> HTTPError:
    return HTTPError(504, f"the request took longer than {settings.request_timeout_s:g} s "
                          "(SHALIK_REQUEST_TIMEOUT_S)", code="timeout")


async def _wait(task: asyncio.Future, request: Request, deadline: float, on_abandon) -> Any:
    """Await ``task`` until ``deadline``; call ``on_abandon`` and raise 504 on timeout, or 499 when the
    client disconnects first."""
    try:
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                on_abandon()
                raise _timeout(request.app.state.shalik.settings)
            done, _ = await asyncio.wait({task}, timeout=min(DISCONNECT_POLL_S, remaining))
            if task in done:
                return task.result()
            if await request.is_disconnected():
                on_abandon()
                raise HTTPError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


async def _complete(lm: LM, req: CompletionRequest, gens: list[Generation], run: ThreadedRun, meta: dict,
                    request: Request, deadline: float) -> dict:
    """Collect a whole run into OpenAI's response body."""
    chunks: dict[int, list[Chunk]] = defaultdict(list)

    async def consume() -> None:
        async for ev in run.events():
            if ev.kind == "chunk":
                chunks[ev.index].append(ev.chunk)

    try:
        await _wait(asyncio.ensure_future(consume()), request, deadline, on_abandon=run.cancel)
    finally:
        run.cancel()
    with_lp = req.logprobs is not None
    choices, completion_tokens = [], 0
    for i, gen in enumerate(gens):
        comp = LM.collect(gen, chunks[i])
        completion_tokens += comp.completion_tokens
        text, lists = echo_part(lm, gen, with_lp) if req.echo else ("", None)
        own = merge_lists(logprob_lists(lm, c, len(text)) for c in chunks[i]) if with_lp else None
        if with_lp and own is None:
            own = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        end = end_of_text_lists(gen, len(text) + len(comp.text)) if with_lp else None
        choices.append(choice_dict(i, text + comp.text, merge_lists([lists, own, end]), comp.finish_reason))
    return {**meta, "choices": choices, "usage": usage_dict(prompt_usage(gens, req.n), completion_tokens)}


async def _stream(lm: LM, req: CompletionRequest, gens: list[Generation], run: ThreadedRun, meta: dict,
                  deadline: float, settings: Settings) -> AsyncIterator[bytes]:
    """Server-sent events of a run: ``data: <chunk json>`` per piece, a final chunk per choice with its
    finish_reason, the usage chunk when asked, then ``data: [DONE]``. Cancels the run when the client
    goes away (this generator is then cancelled) or the deadline passes."""
    with_lp = req.logprobs is not None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage_field = {"usage": None} if include_usage else {}
    offsets: dict[int, int] = {}  # choice → length of its echoed prompt text
    released: dict[int, int] = defaultdict(int)  # choice → characters of completion text sent

    def event(index: int, text: str, lists: dict | None, finish: str | None = None) -> bytes:
        return sse({**meta, "choices": [choice_dict(index, text, lists, finish)], **usage_field})

    events = run.events()
    try:
        while True:
            remaining = deadline - time.perf_counter()
            try:
                ev = await asyncio.wait_for(anext(events), timeout=max(remaining, 0.0))
            except StopAsyncIteration:
                break
            i, gen = ev.index, gens[ev.index]
            if i not in offsets:
                offsets[i] = 0
                if req.echo:
                    text, lists = echo_part(lm, gen, with_lp)
                    offsets[i] = len(text)
                    yield event(i, text, lists)
            if ev.kind == "chunk":  # chunk offsets count from the start of the completion text
                released[i] += len(ev.chunk.text)
                yield event(i, ev.chunk.text, logprob_lists(lm, ev.chunk, offsets[i]) if with_lp else None)
            else:
                end = end_of_text_lists(gen, offsets[i] + released[i]) if with_lp else None
                yield event(i, "", end, gen.finish_reason)
        if include_usage:
            completion = sum(g.completion_tokens for g in gens)
            yield sse({**meta, "choices": [], "usage": usage_dict(prompt_usage(gens, req.n), completion)})
        yield sse("[DONE]")
    except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
        yield sse(error_body(504, _timeout(settings).message, code="timeout"))
        yield sse("[DONE]")
    except (RequestError, BackendError) as e:
        yield sse(error_body(400, str(e), getattr(e, "param", None), getattr(e, "code", None)))
        yield sse("[DONE]")
    except ModelOutputError as e:
        yield sse(error_body(500, str(e), code="model_output"))
        yield sse("[DONE]")
    except Exception as e:  # a bug: the status line is sent already, so report it in the stream
        log.exception("generation failed mid-stream")
        yield sse(error_body(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))
        yield sse("[DONE]")
    finally:
        run.cancel()


# ---- errors and schema


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """A request that does not fit the schema → 400 naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    if param in ("prompt", "text") and len(loc) > 1:  # a union: pydantic reports every branch
        msg = (f"{param} must be a string, a non-empty list of strings, a non-empty list of token ids (ints >= 0)"
               " or a non-empty list of such lists" if param == "prompt"
               else "text must be a string or a non-empty list of token ids (ints >= 0)")
        return error_response(400, msg, param=param, code="invalid_type")
    where = ".".join(loc) or "body"
    return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", param=param,
                          code=str(first.get("type")) or None)


def _install_error_handlers(app: FastAPI) -> None:
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if isinstance(exc, HTTPError):
            return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.headers)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, exc.code)

    async def backend_error(request: Request, exc: BackendError) -> JSONResponse:
        return error_response(400, str(exc))

    async def model_error(request: Request, exc: ModelOutputError) -> JSONResponse:
        return error_response(500, str(exc), code="model_output")

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(BackendError, backend_error)
    app.add_exception_handler(ModelOutputError, model_error)
    app.add_exception_handler(Exception, internal_error)


def _limit_ids(node: Any, vocab_size: int) -> None:
    """Give every ``{"type": "integer", "minimum": 0}`` under ``node`` the vocabulary's last id as maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _limit_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _limit_ids(v, vocab_size)


def _install_openapi(app: FastAPI, settings: Settings, state: ServerState) -> None:
    """The schema without FastAPI's unused 422 responses, with the bearer scheme when a key is set, and —
    once the model is loaded — token ids bounded by its vocabulary and max_tokens by its context."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, ops in schema.get("paths", {}).items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if settings.api_key and not is_open_path(path):
                    op["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if settings.api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        if state.lm is None:
            return schema  # not cached: the model's limits are added once it is loaded
        models = components.get("schemas", {})
        for model, field in (("CompletionRequest", "prompt"), ("ScoreRequest", "text"), ("DetokenizeRequest", "tokens")):
            _limit_ids(models.get(model, {}).get("properties", {}).get(field), state.lm.vocab_size)
        for option in models.get("CompletionRequest", {}).get("properties", {}).get("max_tokens", {}).get("anyOf", []):
            if option.get("type") == "integer":
                option["maximum"] = state.lm.context_length - 1
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


app = create_app()
