"""API-key authentication for gRPC servers: a server interceptor.

Calls to the guarded services must carry metadata `authorization: Bearer KEY`
(the same key and check as REST, tandem/api_key.py); others get UNAUTHENTICATED
before the servicer runs. Services not named (health, reflection) stay open,
so probes need no key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc

from tandem.api_key import UNAUTHORIZED_MESSAGE, key_matches


def _authorization(metadata: Iterable[Any] | None) -> str | bytes | None:
    for item in metadata or ():
        if item[0].lower() == "authorization":
            return item[1]
    return None


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails every call with UNAUTHENTICATED."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED_MESSAGE)

    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    # No deserializer: the refused request is never parsed.
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED for a call to one of `services` without `authorization: Bearer <api_key>`."""

    def __init__(self, api_key: str, services: Iterable[str]):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.api_key = api_key
        self.prefixes = tuple(f"/{name}/" for name in services)
        if not self.prefixes:
            raise ValueError("name at least one service to guard")

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
                          ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        if key_matches(_authorization(handler_call_details.invocation_metadata), self.api_key):
            return handler
        return _refusing(handler)
