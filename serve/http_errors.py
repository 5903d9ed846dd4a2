"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

#: HTTP status → OpenAI error ``type``
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class HTTPError(HTTPException):
    """Raise inside a request (or from a wrapped ``receive``) to answer ``status`` with OpenAI's error body.

    A Starlette ``HTTPException``, so FastAPI passes it through even while it parses the body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(status_code=status, detail=message, headers=dict(headers or {}) or None)
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body for an error (``type`` from :data:`ERROR_TYPES`, ``invalid_request_error`` for 4xx)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying :func:`error_body`."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=dict(headers or {}))
