"""W3C trace context across gRPC: a server interceptor for ServiceHost, a client interceptor for channels.

Installed only when tracing is on (tandem.telemetry.ENABLED), so that every RPC
a service serves or makes, including ones added later, is traced without
touching its servicer or client:

- server: each call continues the caller's `traceparent` from its metadata in a
  SERVER span named after the method (`tandem.v1.TargetService/Step`); a
  streaming call gets one span for the whole stream (a message on a long-lived
  stream carries its own context: tandem.telemetry.current_traceparent);
- client: each unary call is a CLIENT span whose context goes out in the
  metadata; a streaming call sends the context current when it opens.

Health checks and reflection are left alone: they are polled, not served.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tandem import telemetry

UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

_tracer = trace.get_tracer("tandem.grpc")


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


# ---------------------------------------------------------------------------- server

def _parent_context(metadata) -> object:
    return propagate.extract({m.key: m.value for m in metadata or () if isinstance(m.value, str)})


def _fail(span: trace.Span, context: grpc.ServicerContext, exc: BaseException) -> None:
    """Mark the span failed, with the status code a servicer's context.abort set (its exception says nothing)."""
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        details = context.details() if hasattr(context, "details") else None
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))
    else:
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class TracingServerInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNTRACED_PREFIXES):
            return handler
        name = method.lstrip("/")
        attributes = _rpc_attributes(method)
        metadata = handler_call_details.invocation_metadata

        def start() -> trace.Span:
            return _tracer.start_span(name, context=_parent_context(metadata), kind=SpanKind.SERVER,
                                      attributes=attributes)

        def unary_response(behavior: Callable) -> Callable:
            def traced(request, context):
                span = start()
                with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
                    try:
                        return behavior(request, context)
                    except BaseException as exc:
                        _fail(span, context, exc)
                        raise
            return traced

        def stream_response(behavior: Callable) -> Callable:
            def traced(request, context) -> Iterator:
                span = start()
                with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
                    try:
                        yield from behavior(request, context)
                    except GeneratorExit:
                        raise  # the client went away: not a failure of ours
                    except BaseException as exc:
                        _fail(span, context, exc)
                        raise
            return traced

        serde = {"request_deserializer": handler.request_deserializer,
                 "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(unary_response(handler.unary_unary), **serde)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary), **serde)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(stream_response(handler.unary_stream), **serde)
        return grpc.stream_stream_rpc_method_handler(stream_response(handler.stream_stream), **serde)


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """What ServiceHost installs: nothing while tracing is off."""
    return [TracingServerInterceptor()] if telemetry.ENABLED else []


# ---------------------------------------------------------------------------- client

class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


def _with_context(details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), *carrier.items()],
                        details.credentials, getattr(details, "wait_for_ready", None),
                        getattr(details, "compression", None))


def _end_client_span(span: trace.Span, call) -> None:
    code = call.code() if hasattr(call, "code") else None
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


class TracingClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                               grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        if method.startswith(UNTRACED_PREFIXES):
            return continuation(client_call_details, request)
        span = _tracer.start_span(method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method))
        with trace.use_span(span, end_on_exit=False):
            call = continuation(_with_context(client_call_details), request)
        # A blocking call is done here and runs the callback at once; a future ends the span when it completes.
        call.add_done_callback(lambda c: _end_client_span(span, c))
        return call

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(_with_context(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(_with_context(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(_with_context(client_call_details), request_iterator)


def instrument_channel(channel: grpc.Channel) -> grpc.Channel:
    """`channel` with trace context on every call; the channel itself while tracing is off."""
    if not telemetry.ENABLED:
        return channel
    return grpc.intercept_channel(channel, TracingClientInterceptor())
