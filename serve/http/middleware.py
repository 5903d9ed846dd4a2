"""Pure ASGI middlewares (no response buffering, so streamed events go out as they are made).

* :class:`GuardMiddleware`: the API key (401) and the body size limit (413, from Content-Length before
  reading, and counted while the body streams in) — both before any endpoint reads the body;
* :class:`MetricsMiddleware`: counts every answered request by endpoint (route template) and status.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.http.errors import HTTPError, error_response
from serve.http.metrics import Metrics


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class GuardMiddleware:
    """Require ``Authorization: Bearer <api_key>`` (unless ``api_key`` is None) on every path but the open
    ones, refuse bodies over ``max_body_bytes``, and answer 408 (and close the connection) when the next piece of
    a body takes longer than ``body_timeout_s`` seconds to arrive (a Content-Length larger than what is sent would
    otherwise hold the connection with no answer; nginx's client_body_timeout)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 is_open: Callable[[str], bool], body_timeout_s: float = 30.0):
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.is_open = is_open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and not self.is_open(scope["path"]):
            auth = _header(scope, b"authorization") or ""
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                msg = "missing API key" if not auth else "invalid API key"
                resp = error_response(401, f"{msg}: send 'Authorization: Bearer <SHALIK_API_KEY>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        length = _header(scope, b"content-length")
        limit = self.max_body_bytes
        if length is not None:
            if not length.strip().isdigit():
                await error_response(400, f"malformed Content-Length {length!r}")(scope, receive, send)
                return
            if int(length) > limit:
                await self._too_large(int(length))(scope, receive, send)
                return
        seen = 0
        body_done = False

        async def counting_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body: only http.disconnect can come, and waiting for it is no fault
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=self.body_timeout_s)
            except asyncio.TimeoutError:  # (an alias of TimeoutError from Python 3.11)
                raise HTTPError(408, f"the request body stopped arriving: nothing for {self.body_timeout_s:g} s "
                                     f"after {seen} bytes (SHALIK_BODY_TIMEOUT_S; is Content-Length right?)",
                                code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPError(413, self._too_large_message(seen, more=True), code="request_too_large")
            return message

        await self.app(scope, counting_receive, send)

    def _too_large_message(self, size: int, more: bool = False) -> str:
        return (f"request body is {'over ' if more else ''}{size} bytes, more than the limit of "
                f"{self.max_body_bytes} bytes (SHALIK_MAX_BODY_BYTES)")

    def _too_large(self, size: int):
        return error_response(413, self._too_large_message(size), code="request_too_large",
                              headers={"Connection": "close"})


class MetricsMiddleware:
    """Count each answered request in ``metrics.requests`` by endpoint template and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: Callable[[], Iterable[str]]):
        self.app = app
        self.metrics = metrics
        self.paths = paths
        self._known: frozenset[str] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(self._endpoint(scope), str(status)).inc()

    def _endpoint(self, scope: Scope) -> str:
        """The route template (bounded label values): a known path, ``/static``, or ``other``."""
        route = scope.get("route")
        path = getattr(route, "path", None) or scope["path"]
        if path == "/static" or path.startswith("/static/"):
            return "/static"
        if self._known is None:
            self._known = frozenset(self.paths())
        return path if path in self._known else "other"
