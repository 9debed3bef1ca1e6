"""ASGI middleware guarding the REST app: the API key, and a bound on request body size.

Both answer with errors in OpenAI's shape (gateway/openai_errors.py) before a
handler runs where they can: a request without the key never has its body read,
and a body whose Content-Length is over the bound is refused unread. A chunked
body is counted as it arrives and refused (413) the moment it passes the bound.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.openai_errors import APIError, rejected
from tandem.api_key import UNAUTHORIZED_MESSAGE, key_matches

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def unauthorized() -> APIError:
    return APIError(401, UNAUTHORIZED_MESSAGE, "invalid_request_error", code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes)",
                    "invalid_request_error", code="request_too_large")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


async def _refuse(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = rejected(err, scope.get("method", ""), scope.get("path", ""), Headers(scope=scope))
    await response(scope, receive, send)


class ApiKeyMiddleware:
    """401 for a request to a protected path without `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str, protected: Callable[[str], bool]):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app, self.api_key, self.protected = app, api_key, protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protected(scope["path"]) and \
                not key_matches(_header(scope, b"authorization"), self.api_key):
            await _refuse(unauthorized(), scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _refuse(body_too_large(self.max_bytes), scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise body_too_large(self.max_bytes)  # the app's error handlers answer it
            return message

        await self.app(scope, counted, send)
