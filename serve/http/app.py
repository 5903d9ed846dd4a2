"""The HTTP server, assembled: ``create_app(settings, lm)`` builds the FastAPI app (OpenAI-style completions over a
Shalik bundle, no torch); ``uvicorn serve.app:app`` serves the one that :mod:`serve.app` builds from the
environment.

Configured by ``SHALIK_*`` environment variables (:mod:`serve.http.settings`); tests inject a scripted
:class:`serve.lm.LM`. The app loads its model in a background thread at startup, and ``/health`` answers 503
until it is loaded — or says why it cannot be.

Endpoints: ``GET /`` (the playground page from ``serve/static/index.html`` when present), ``/static/*``,
``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (a model whose tokenizer
has the chat tokens), ``POST /v1/score``, ``GET /metrics``, and
vLLM's ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``.

Generation runs in a thread per request (at most ``SHALIK_MAX_CONCURRENCY`` at once, at most
``SHALIK_MAX_QUEUE`` waiting, else 429); streamed events are sent as they are made; a client that goes
away cancels its generation before the next token.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from serve.http.errors import install_error_handlers
from serve.http.lifecycle import ServerState
from serve.http.middleware import GuardMiddleware, MetricsMiddleware
from serve.http.openapi import install_openapi
from serve.http.routes import is_open_path, register_routes
from serve.http.settings import Settings
from serve.http.translate import MAX_CHOICES
from serve.lm import LM

__all__ = ["MAX_CHOICES", "VERSION", "ServerState", "create_app"]
VERSION = "0.1.0"


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
                       is_open=is_open_path, body_timeout_s=settings.body_timeout_s)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics, paths=lambda: [r.path for r in app.routes])
    install_error_handlers(app)
    install_openapi(app, settings.api_key, is_open_path, state.limits)
    register_routes(app, state)
    return app

