"""Errors over HTTP: OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``, the exception →
status mapping (RequestError and BackendError 400, ModelOutputError 500, anything else a 500 that names only the
exception type), and the translation of request-validation errors into one message that names the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from serve.backends.base import BackendError
from serve.errors import ModelOutputError, RequestError

#: HTTP status → OpenAI error ``type``
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
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


def timeout_error(request_timeout_s: float) -> HTTPError:
    """504 naming the setting (SHALIK_REQUEST_TIMEOUT_S)."""
    return HTTPError(504, f"the request took longer than {request_timeout_s:g} s (SHALIK_REQUEST_TIMEOUT_S)",
                     code="timeout")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body for an error (``type`` from :data:`ERROR_TYPES`, ``invalid_request_error`` for 4xx)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    # a message that quotes a lone surrogate from the request would make the body unencodable: escape it
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying :func:`error_body`."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=dict(headers or {}))


def stream_error(exc: BaseException) -> dict:
    """The error body sent as a server-sent event when ``exc`` ends a stream whose status line is already out."""
    if isinstance(exc, RequestError | BackendError):
        return error_body(400, str(exc), getattr(exc, "param", None), getattr(exc, "code", None))
    if isinstance(exc, ModelOutputError):
        return error_body(500, str(exc), code="model_output")
    return error_body(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def body_error(cause: BaseException) -> str:
    """What is wrong with a body that FastAPI could not parse (it says only "There was an error parsing the
    body"; the cause is the exception ``json.loads`` raised)."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at offset {cause.start} "
                "(JSON bodies must be UTF-8)")
    if isinstance(cause, RecursionError):
        return "the JSON body is nested too deeply to parse (arrays/objects inside each other)"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"a number in the JSON body has too many digits to parse ({cause})".replace(
            "; use sys.set_int_max_str_digits() to increase the limit", "")
    return f"malformed JSON body: {type(cause).__name__}: {cause}"


#: union fields whose every branch pydantic reports: one message that says what the field may be
UNION_FIELDS = {
    "prompt": "prompt must be a string, a non-empty list of strings, a non-empty list of token ids (ints >= 0)"
              " or a non-empty list of such lists",
    "text": "text must be a string or a non-empty list of token ids (ints >= 0)",
    "stop": "stop must be a non-empty string or a list of non-empty strings",
}


def field_path(loc) -> str:
    """A pydantic location as the field's path in the body, the way the chat format's messages name it
    (``("body", "messages", 0, "content")`` → ``messages[0].content``)."""
    parts = [x for x in loc if x != "body"]
    out = ""
    for x in parts:
        out += f"[{x}]" if isinstance(x, int) or str(x).isdigit() else (f".{x}" if out else str(x))
    return out


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, lower case, without parameters ("" for none)."""
    return (content_type or "").split(";")[0].strip().lower()


def is_json_media(media: str) -> bool:
    """Whether a media type (:func:`media_type`) is JSON: ``application/json`` or ``application/*+json``."""
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def validation_error(exc: RequestValidationError, content_type: str | None = None, empty: bool = False
                     ) -> JSONResponse:
    """A request that does not fit the schema → 400 naming the first offending field. ``content_type``: the
    request's Content-Type header, ``empty``: it came without a body (a body that is not a JSON object is explained
    by them)."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = [x for x in first.get("loc", ()) if x != "body"]
    ctx = first.get("ctx") or {}
    param = ctx.get("param") or (str(loc[0]) if loc else None)
    if not loc and ctx.get("param") is None:  # the body itself is not an object
        if empty:
            return error_response(400, "the body is empty: expected a JSON object", code="invalid_type")
        media = media_type(content_type)
        if not is_json_media(media):
            return error_response(400, "the body must be a JSON object sent with Content-Type: application/json, "
                                       + (f"got Content-Type: {media}" if media else "sent without a Content-Type"),
                                  code="invalid_content_type")
        return error_response(400, f"the body must be a JSON object, got {json_kind(first.get('input'))}",
                              code="invalid_type")
    unicode = next((e for e in errors if e.get("type") == "string_unicode"), None)
    if unicode is not None:  # a lone surrogate ("\ud800"): JSON can spell it, UTF-8 cannot
        param = next((str(x) for x in unicode.get("loc", ()) if x != "body"), param)
        return error_response(400, f"{param} holds a lone surrogate (such as \\ud800): not valid Unicode text",
                              param=param, code="invalid_unicode")
    wide = next((e for e in errors if e.get("type") == "int64"), None)
    if wide is not None:  # an integer past 64 bits (serve.http.schemas.integer), also inside a union's branch
        param = next((str(x) for x in wide.get("loc", ()) if x != "body"), param)
        return error_response(400, wide["ctx"]["message"], param=param, code="int64")
    if "message" in ctx:  # serve.http.schemas' own errors (PydanticCustomError with a whole message)
        return error_response(400, ctx["message"], param=param, code=first["type"])
    if param in UNION_FIELDS and len(loc) > 1:  # a union: pydantic reports every branch
        got = first.get("input")
        return error_response(400, f"{UNION_FIELDS[param]}; got {json_repr(got)}", param=param, code="invalid_type")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return error_response(400, f"{field_path(loc) or 'body'}: {msg}", param=param,
                          code=str(first.get("type")) or None)


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words (an array, a string, ...)."""
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
             bytes: "a body that is not JSON"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def json_repr(value) -> str:
    """A short JSON rendering of an offending value for a message (at most 40 characters; Python's repr for what
    JSON cannot spell)."""
    try:
        text = json.dumps(value, ensure_ascii=False)  # a lone surrogate in it is escaped by error_body
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception a route raises with OpenAI's error body (see the module doc for the statuses)."""

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None and not isinstance(exc, HTTPError):
            return error_response(400, body_error(exc.__cause__), code="invalid_json")
        if isinstance(exc, HTTPError):
            return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.headers)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        empty = request.headers.get("content-length") == "0" and "transfer-encoding" not in request.headers
        return validation_error(exc, request.headers.get("content-type"), empty)

    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, exc.code)

    async def backend_error(request: Request, exc: BackendError) -> JSONResponse:
        return error_response(400, str(exc))

    async def model_error(request: Request, exc: ModelOutputError) -> JSONResponse:
        return error_response(500, str(exc), code="model_output")

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(BackendError, backend_error)
    app.add_exception_handler(ModelOutputError, model_error)
    app.add_exception_handler(Exception, internal_error)
