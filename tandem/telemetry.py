"""OpenTelemetry tracing for every tandem service: set up, export over OTLP, shut down.

Tracing is off unless an OTLP endpoint is given (`--otlp-endpoint`, default
`$OTEL_EXPORTER_OTLP_ENDPOINT`). While it is off nothing is installed: no gRPC
interceptors, no REST middleware, and every hook on a hot path checks the one
flag `ENABLED` and returns, so a service without an endpoint spends nothing
measurable on tracing (BENCHMARKS.md, "Observability").

The protocol is the standard `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or
`OTEL_EXPORTER_OTLP_PROTOCOL` (`grpc` or `http/protobuf`). Unset, it is
`http/protobuf` when the endpoint says so (port 4318, or a path ending in
`/v1/traces`) and `grpc` otherwise, the OTLP exporter's own default. The
exporter batches spans (`OTEL_BSP_SCHEDULE_DELAY` and the other standard
`OTEL_BSP_*` variables apply); `shutdown_tracing` flushes what is queued.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

from opentelemetry import trace

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
SERVICE_PREFIX = "tandem-"  # service.name is tandem-gateway, tandem-target, tandem-draft

# Set once by setup_tracing, read by every hook; never flipped back while a service runs.
ENABLED = False
_provider = None  # the SDK TracerProvider this process installed, for shutdown
_tracer = trace.get_tracer("tandem")
_NO_SPAN = contextlib.nullcontext()

T = TypeVar("T")


def otlp_protocol(endpoint: str) -> str:
    """The OTLP protocol for `endpoint`: the standard variables first, then what the endpoint says."""
    configured = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                  or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "").strip().lower()
    if configured:
        if configured not in PROTOCOLS:
            raise ValueError(f"OTLP protocol {configured!r} is not supported; use one of {', '.join(PROTOCOLS)}")
        return configured
    url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    if url.port == 4318 or url.path.rstrip("/").endswith("/v1/traces"):
        return "http/protobuf"
    return "grpc"


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP: the base endpoint plus /v1/traces, as the specification builds it."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    url = url.rstrip("/")
    return url if url.endswith("/v1/traces") else f"{url}/v1/traces"


def make_exporter(endpoint: str, protocol: str):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=traces_url(endpoint))


def add_otlp_argument(parser) -> None:
    """--otlp-endpoint, the same on every tandem process (tandem serve passes it on to its children)."""
    parser.add_argument("--otlp-endpoint", metavar="URL", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                        help="export OpenTelemetry traces to this OTLP collector (default: "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT; protocol from $OTEL_EXPORTER_OTLP_PROTOCOL: grpc or "
                        "http/protobuf)")


def setup_tracing(service: str, endpoint: str | None) -> bool:
    """Export this process's spans to `endpoint` as service.name tandem-<service>; False (off) without one."""
    global ENABLED, _provider
    if not endpoint:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = otlp_protocol(endpoint)
    provider = TracerProvider(resource=Resource.create(
        {"service.name": SERVICE_PREFIX + service, "service.namespace": "tandem"}))
    provider.add_span_processor(BatchSpanProcessor(make_exporter(endpoint, protocol)))
    trace.set_tracer_provider(provider)
    _provider = provider
    ENABLED = True
    log.info("tracing: exporting spans to %s over OTLP %s", endpoint, protocol)
    return True


def shutdown_tracing() -> None:
    """Flush queued spans and stop exporting; a no-op when tracing is off. Services call it on SIGTERM."""
    global _provider
    if _provider is not None:
        provider, _provider = _provider, None
        provider.shutdown()


def bind_context(fn: Callable[[], T]) -> Callable[[], T]:
    """`fn`, to run in another thread with this thread's trace context (a queued draft call carries
    the step's span). With tracing off, `fn` itself."""
    if not ENABLED:
        return fn
    ctx = contextvars.copy_context()
    return lambda: ctx.run(fn)


def current_traceparent() -> str:
    """The W3C traceparent of the current span ('' when none or tracing is off): for a message on a
    long-lived stream, where gRPC metadata travels only once; the receiver opens `continued_span`."""
    if not ENABLED:
        return ""
    carrier: dict[str, str] = {}
    from opentelemetry import propagate

    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str):
    """The trace context a traceparent names (the empty context for ''), to parent a span on."""
    from opentelemetry import propagate

    return propagate.extract({"traceparent": traceparent} if traceparent else {})


def continued_span(name: str, traceparent: str):
    """Context manager: a SERVER span continuing `traceparent` (from a stream message), current inside the
    block. Nothing at all when tracing is off or the message carried no traceparent."""
    if not ENABLED or not traceparent:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, context=context_from_traceparent(traceparent),
                                         kind=trace.SpanKind.SERVER)


def stream_call_span(name: str) -> tuple[object | None, str]:
    """A CLIENT span for one call on a long-lived stream, child of the current span, and the
    traceparent that carries it to the receiver: (None, '') with tracing off. The caller ends
    the span when the call's last reply arrives."""
    if not ENABLED:
        return None, ""
    span = _tracer.start_span(name, kind=trace.SpanKind.CLIENT)
    carrier: dict[str, str] = {}
    from opentelemetry import propagate

    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier.get("traceparent", "")
