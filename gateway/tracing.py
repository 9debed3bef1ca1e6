"""The gateway's spans: one per request, one per step, and the REST edge that continues a caller's trace.

- A request span (`text_completion <model>` or `chat <model>`) carries the
  OpenTelemetry GenAI attributes (`gen_ai.operation.name`,
  `gen_ai.request.model`, `gen_ai.request.max_tokens`,
  `gen_ai.request.temperature`, `gen_ai.usage.input_tokens`,
  `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`, ...) and
  tandem's (`tandem.speculation`, `tandem.spec.draft_tokens`,
  `tandem.spec.accepted_tokens`, ...). It is a child of whatever span is
  current when the API layer submits: the REST server span below, or the gRPC
  server span of tandem.grpc_tracing; both continue the caller's `traceparent`.
- A step span (`tandem.step`) covers one step of the loop; the draft and target
  calls made in it are its children, in the draft and target processes too.
  Steps are batched across requests, so a step links to the span of every
  request it served. A step that served one request is also that request's
  child, so a lone request's trace holds the spans of all three processes; a
  step serving several starts a trace of its own and is found from each
  request through its link.

With tracing off (tandem.telemetry.ENABLED false) every function here returns
at its first line, and the REST middleware is not installed.
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind

from tandem import telemetry

_tracer = trace.get_tracer("tandem.gateway")

# Which GenAI operation the API layer is serving: the REST edge sets "chat" for chat completions.
_OPERATION: ContextVar[str] = ContextVar("tandem_gen_ai_operation", default="text_completion")
_NO_STEP = contextlib.nullcontext()
_OUTSIDE = object()  # no step_scope is open in this thread
_step = threading.local()  # .opened: _OUTSIDE, None (in a step, no span yet), or (span, context token)


# ---------------------------------------------------------------------------- requests

def start_request_span(r, model: str, mode: str) -> trace.Span | None:
    """The span of request `r` (a gateway.request.Request), or None with tracing off."""
    if not telemetry.ENABLED:
        return None
    p = r.params
    operation = _OPERATION.get()
    attributes = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem", "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": p.max_tokens, "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p, "gen_ai.usage.input_tokens": len(r.prompt),
        "tandem.request_id": r.request_id, "tandem.speculation": mode}
    if p.top_k:
        attributes["gen_ai.request.top_k"] = p.top_k
    if p.seed is not None:
        attributes["gen_ai.request.seed"] = p.seed
    return _tracer.start_span(f"{operation} {model}", kind=SpanKind.INTERNAL, attributes=attributes)


def end_request_span(r, delta) -> None:
    """End r's span with its usage, finish reason and speculation counts (delta: its last Delta)."""
    span = r.span
    if span is None:
        return
    r.span = None
    attributes = {"gen_ai.response.id": r.request_id, "gen_ai.response.finish_reasons": [str(delta.finish_reason)],
                  "gen_ai.usage.output_tokens": delta.completion_tokens,
                  **{f"tandem.spec.{k}": v for k, v in delta.spec.as_dict().items()}}
    if r.first_token_at is not None:
        attributes["tandem.time_to_first_token_s"] = r.first_token_at - r.arrival
    span.set_attributes(attributes)
    span.end()


# ---------------------------------------------------------------------------- steps

def step_scope():
    """Wrap one step of the loop: ends the step span that `step_serves` opened in it."""
    return _StepScope() if telemetry.ENABLED else _NO_STEP


class _StepScope:
    def __enter__(self) -> _StepScope:
        _step.opened = None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        opened, _step.opened = _step.opened, _OUTSIDE
        if opened is None:
            return
        span, token = opened
        if exc is not None:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        otel_context.detach(token)
        span.end()


def step_serves(items) -> None:
    """Open the step span, current until the step ends, linked to the requests of `items`
    (the step plan's items: anything with `.request.span`)."""
    if not telemetry.ENABLED or getattr(_step, "opened", _OUTSIDE) is not None:
        return  # off, outside a step_scope, or already opened in this step
    spans = [it.request.span for it in items if it.request.span is not None]
    parent = trace.set_span_in_context(spans[0]) if len(spans) == 1 else otel_context.Context()
    span = _tracer.start_span("tandem.step", context=parent, kind=SpanKind.INTERNAL,
                              links=[Link(s.get_span_context()) for s in spans],
                              attributes={"tandem.step.requests": len(items)})
    _step.opened = (span, otel_context.attach(trace.set_span_in_context(span)))


# ---------------------------------------------------------------------------- the REST edge

class TraceContextMiddleware:
    """ASGI: each /v1/ request is a SERVER span continuing the caller's traceparent; the rest pass through."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        path, method = scope["path"], scope["method"]
        with _tracer.start_as_current_span(
                f"{method} {path}", context=propagate.extract(headers), kind=SpanKind.SERVER,
                attributes={"http.request.method": method, "url.path": path}) as span:

            async def traced_send(message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            token = _OPERATION.set("chat" if path.endswith("/chat/completions") else "text_completion")
            try:
                await self.app(scope, receive, traced_send)
            finally:
                _OPERATION.reset(token)


def instrument_app(app):
    """The REST app with trace context continued; `app` itself with tracing off."""
    return TraceContextMiddleware(app) if telemetry.ENABLED else app


def setup_tracing(endpoint: str | None) -> bool:
    """The gateway's tracer (service.name tandem-gateway); see tandem.telemetry."""
    return telemetry.setup_tracing("gateway", endpoint)
