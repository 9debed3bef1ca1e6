"""OpenTelemetry tracing: a span per request when an OTLP endpoint is configured."""

from __future__ import annotations

import logging

log = logging.getLogger("tandem.gateway")


def setup_tracing(endpoint: str | None) -> None:
    """Install a tracer provider exporting to `endpoint` (OTLP/HTTP); a no-op without one."""
    if not endpoint:
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("--otlp-endpoint given but opentelemetry-exporter-otlp-proto-http is not installed; "
                    "tracing is off")
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "tandem-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")))
    trace.set_tracer_provider(provider)
    log.info("exporting traces to %s", endpoint)
