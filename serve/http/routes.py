"""The transport: each endpoint parses its request (pydantic, :mod:`serve.http.schemas`), asks the model lifecycle
for the model, takes a generation slot (:mod:`serve.http.admission`) and hands the work to :mod:`serve.http.runs`;
bodies are built by :mod:`serve.http.translate`. Also the playground page and its static files."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from contract.bundle import EOT, PAD
from serve.http import admission, runs
from serve.http.chat import ChatFormat, start_chat_generations
from serve.http.lifecycle import ServerState
from serve.http.metrics import CONTENT_TYPE
from serve.http.openapi import SSE_EVENT_SCHEMA
from serve.http.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
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
from serve.http.translate import CompletionFormat, prompt_usage, score_body, start_generations

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: The playground page and its files: browsers revalidate (ETag / Last-Modified) on every load, never stale
NO_CACHE = {"Cache-Control": "no-cache"}
PLACEHOLDER_PAGE = """<!doctype html><html lang="bn"><meta charset="utf-8"><title>Shalik</title>
<h1>শালিক · Shalik</h1><p>A small Bangla-first language model. API: <a href="/docs">/docs</a>,
<code>POST /v1/completions</code>, <code>POST /v1/chat/completions</code>, <code>POST /v1/score</code>, <a href="/health">/health</a>.</p></html>"""


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


def register_routes(app: FastAPI, state: ServerState) -> None:
    """Add every endpoint (see :mod:`serve.http.app`'s module doc) and the static files to ``app``."""
    settings = state.settings
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
        return TokenizerInfo(eos_token=EOT, pad_token=PAD, model_max_length=lm.context_length,
                             vocab_size=lm.vocab_size)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=err(400, 404, 413, 503))
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: ids of the text (no special token added; ``<|endoftext|>`` is prepended only
        internally when generating)."""
        lm = state.require_lm()
        state.check_model(req.model)
        ids = await run_in_threadpool(lm.tokenize, req.prompt, "prompt")
        return TokenizeResponse(count=len(ids), max_model_len=lm.context_length, tokens=ids,
                                token_strs=lm.token_strings(ids))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=err(400, 404, 413, 503))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        lm = state.require_lm()
        state.check_model(req.model)
        return DetokenizeResponse(prompt=lm.detokenize(req.tokens))

    @app.post("/v1/score", response_model=ScoreResponse, responses=err(400, 404, 413, 429, 503, 504))
    async def score(req: ScoreRequest, request: Request) -> ScoreResponse:
        """Per-token negative log-likelihood (nats) and bits per NFC character of a text. A request abandoned (504
        past the deadline, or the client gone) stops scoring before its next block, giving its slot back."""
        arrived = time.perf_counter()
        lm = state.require_lm()
        state.check_model(req.model)
        deadline = arrived + settings.request_timeout_s
        admission.refuse_early(state.admission)
        await admission.admit(state.admission, deadline, settings.request_timeout_s)
        cancel = threading.Event()
        s = await runs.wait(admission.in_slot_thread(state.admission, lm.score, req.text, None, cancel), request,
                            deadline, on_abandon=cancel.set)
        state.metrics.prompt_tokens.inc(len(s.token_ids))
        return score_body(lm, state.name, s)

    async def generate(req, request: Request, start, make_format, meta: dict) -> Response:
        """The shared path of completions and chat: all validation (``start(lm)`` builds the generations)
        happens before a slot is taken or a stream starts."""
        arrived = time.perf_counter()
        lm = state.require_lm()
        state.check_model(req.model)
        admission.refuse_early(state.admission)
        gens = await run_in_threadpool(start, lm)
        deadline = arrived + settings.request_timeout_s
        await admission.admit(state.admission, deadline, settings.request_timeout_s)
        state.metrics.prompt_tokens.inc(prompt_usage(gens, req.n))
        try:
            run = runs.ThreadedRun(gens, on_end=state.admission.release, metrics=state.metrics, arrived_at=arrived)
            run.start()
        except BaseException:
            state.admission.release()
            raise
        fmt = make_format(lm, gens, {**meta, "created": int(time.time()), "model": state.name})
        if req.stream:
            return StreamingResponse(runs.stream(fmt, run, deadline, settings.request_timeout_s),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await runs.complete(fmt, run, request, deadline))

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                               "description": "JSON, or with `stream: true` server-sent events of "
                                              "CompletionResponse chunks ending with `data: [DONE]`."},
                         **err(400, 404, 413, 429, 503, 504)})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        """OpenAI's completions. All validation happens before a stream starts."""
        return await generate(req, request, lambda lm: start_generations(lm, req, settings.default_max_tokens),
                              lambda lm, gens, meta: CompletionFormat(lm, req, gens, meta),
                              {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"})

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                               "description": "JSON, or with `stream: true` server-sent events of "
                                              "`chat.completion.chunk` objects ending with `data: [DONE]`."},
                         **err(400, 404, 413, 429, 503, 504)})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: the conversation is rendered with the model's chat template (ChatML) and
        the reply ends at `<|im_end|>`. A model without a chat template (a base model) answers 400
        `chat_template_missing`. All validation happens before a stream starts."""
        return await generate(req, request,
                              lambda lm: start_chat_generations(lm, req, settings.default_max_tokens),
                              lambda lm, gens, meta: ChatFormat(lm, req, gens, meta),
                              {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"})
