"""The OpenAPI schema as this server serves it: FastAPI's, without its unused 422 responses, with the bearer
scheme when an API key is set, and — once the model is loaded — token ids bounded by its vocabulary and
``max_tokens`` by its context (so a schema-driven client or fuzzer knows the limits)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

#: One server-sent event (OpenAPI 3.1: the text/event-stream schema describes each event)
SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                            "description": "a CompletionResponse chunk (`usage` null, or `choices` empty and "
                                           "`usage` set for the usage chunk), an error body, or `[DONE]`"},
                   "event": {"type": "string"}, "id": {"type": "string"}}}


def limit_ids(node: Any, vocab_size: int) -> None:
    """Give every ``{"type": "integer", "minimum": 0}`` under ``node`` the vocabulary's last id as maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = vocab_size - 1
        for v in node.values():
            limit_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            limit_ids(v, vocab_size)


def install_openapi(app: FastAPI, api_key: str | None, is_open: Callable[[str], bool],
                    limits: Callable[[], tuple[int, int] | None]) -> None:
    """Replace ``app.openapi``. ``limits()`` gives (vocab_size, context_length) once the model is loaded, else
    None (the schema is then rebuilt on the next call instead of cached)."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, ops in schema.get("paths", {}).items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if api_key and not is_open(path):
                    op["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        known = limits()
        if known is None:
            return schema  # not cached: the model's limits are added once it is loaded
        vocab_size, context_length = known
        models = components.get("schemas", {})
        for model, field in (("CompletionRequest", "prompt"), ("ScoreRequest", "text"), ("DetokenizeRequest", "tokens")):
            limit_ids(models.get(model, {}).get("properties", {}).get(field), vocab_size)
        # chat's max_tokens is not bounded: max_completion_tokens, when given, wins over it
        for model, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens")):
            for option in models.get(model, {}).get("properties", {}).get(field, {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = context_length - 1
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
