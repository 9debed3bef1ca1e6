"""Errors of the REST API in OpenAI's shape, and the one mapping to them.

Every error the REST app returns, from a handler, a middleware or the
framework, has the body `{"error": {"message", "type", "param", "code"}}`;
429 and 503 carry `Retry-After`. No 5xx ever names internals.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.streams import RETRY_AFTER_S
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable

log = logging.getLogger("tandem.gateway.api")


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error_for(exc: BaseException) -> APIError:
    """The one mapping from service errors to HTTP (the gRPC edge uses grpc_host.status_for)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidArgument):
        return APIError(400, str(exc), "invalid_request_error", param=getattr(exc, "param", None),
                        code="invalid_argument")
    if isinstance(exc, ResourceExhausted):
        return APIError(429, str(exc) or "the server is at capacity, retry later", "rate_limit_error",
                        code="queue_full")
    if isinstance(exc, Unavailable):
        return APIError(503, str(exc) or "the server is not ready", "server_error",
                        code="service_unavailable")
    return APIError(500, "internal server error", "server_error", code="internal_error")


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                    code="invalid_value")


REQUEST_ID_HEADER = "x-request-id"


def request_id_for(headers: Mapping[str, str] | None) -> str:
    """The caller's X-Request-Id, or a fresh id: what a rejection is logged and answered under."""
    given = (headers or {}).get(REQUEST_ID_HEADER)
    return given if given and len(given) <= 128 and given.isprintable() else f"req-{uuid.uuid4().hex}"


def rejected(err: APIError, method: str, path: str, headers: Mapping[str, str] | None) -> JSONResponse:
    """The error response for a request the server refused, logged once at warning level with
    its status, param and request id (sent back as X-Request-Id)."""
    request_id = request_id_for(headers)
    log.warning("rejected %s %s (request %s): %d %s, param=%s: %s", method, path, request_id, err.status,
                err.code or err.type, err.param, err.message)
    response = err.response()
    response.headers["X-Request-Id"] = request_id
    return response


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    return rejected(api_error_for(exc), request.method, request.url.path, request.headers)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # OpenAI says 400 where FastAPI says 422.
    return rejected(validation_error(exc), request.method, request.url.path, request.headers)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return rejected(APIError(exc.status_code, str(exc.detail), type_), request.method, request.url.path,
                    request.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    # Never a stack trace to the client.
    return rejected(api_error_for(exc), request.method, request.url.path, request.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    # The service errors a route lets through (a bad prompt, a full queue, an engine not ready)
    # are refusals like an APIError, answered through the same mapping; not unexpected errors.
    for service_error in (InvalidArgument, ResourceExhausted, Unavailable):
        app.add_exception_handler(service_error, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
