"""The one API-key check, shared by the REST middleware and the gRPC interceptor.

A key travels as `Authorization: Bearer KEY` (an HTTP header, or gRPC metadata
`authorization`). It is compared with hmac.compare_digest so that the time a
refusal takes says nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac

BEARER = "bearer"
UNAUTHORIZED_MESSAGE = "Incorrect or missing API key: send 'Authorization: Bearer <key>'."


def bearer_token(header: str | bytes | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` value, or None when it is not one."""
    if header is None:
        return None
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        return None
    return token.strip()


def key_matches(header: str | bytes | None, api_key: str) -> bool:
    """Whether an Authorization value carries `api_key`, compared in constant time."""
    token = bearer_token(header)
    # compare_digest on bytes: it refuses non-ASCII str, and a client may send any bytes.
    return token is not None and hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                                                     api_key.encode("utf-8"))
