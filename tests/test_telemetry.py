"""Tracing and logging building blocks in-process: off means nothing installed; on, what the spans say."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags

from gateway import tracing
from gateway.types import GenerationParams
from tandem import grpc_tracing, logging_setup, telemetry
from tandem.grpc_host import ServiceHost
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.server import SERVICE_NAME, TargetServicer


@pytest.fixture()
def spans(monkeypatch) -> InMemorySpanExporter:
    """Tracing on, into memory, for this test only (no global provider is touched)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "ENABLED", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(grpc_tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    return exporter


def fake_request(request_id: str, span=None):
    return SimpleNamespace(request_id=request_id, prompt=[1, 2, 3], params=GenerationParams(max_tokens=8),
                           span=span, first_token_at=None, arrival=0.0)


def test_with_tracing_off_nothing_is_installed_and_the_hooks_return_at_once():
    assert telemetry.ENABLED is False  # no test process sets an endpoint
    channel = grpc.insecure_channel("127.0.0.1:1")
    app = object()
    fn = lambda: None  # noqa: E731
    assert grpc_tracing.server_interceptors() == []
    assert grpc_tracing.instrument_channel(channel) is channel
    assert tracing.instrument_app(app) is app
    assert telemetry.bind_context(fn) is fn
    assert tracing.start_request_span(fake_request("r"), "m", "auto") is None
    assert tracing.step_scope() is tracing.step_scope()  # one shared null context, nothing allocated
    with tracing.step_scope():
        tracing.step_serves([SimpleNamespace(request=fake_request("r"))])
    assert telemetry.current_traceparent() == ""
    with telemetry.continued_span("m", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") as span:
        assert span is None  # the shared null context
    assert telemetry.setup_tracing("gateway", None) is False and telemetry.ENABLED is False
    channel.close()


@pytest.mark.parametrize("env, endpoint, protocol", [
    ({}, "http://collector:4317", "grpc"),
    ({}, "http://collector:4318", "http/protobuf"),
    ({}, "https://collector.example/v1/traces", "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://collector:4317", "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
     "http://collector:4318", "grpc"),
])
def test_the_otlp_protocol_follows_the_standard_variables_then_the_endpoint(monkeypatch, env, endpoint, protocol):
    for key in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert telemetry.otlp_protocol(endpoint) == protocol
    assert telemetry.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert telemetry.traces_url("c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_an_unknown_otlp_protocol_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        telemetry.otlp_protocol("http://c:4318")


def test_a_step_serving_one_request_is_its_child_and_a_batched_step_links_to_each(spans):
    reqs = [fake_request(f"r{i}") for i in range(3)]
    for r in reqs:
        r.span = tracing.start_request_span(r, "model", "auto")
    with tracing.step_scope():
        tracing.step_serves([SimpleNamespace(request=reqs[0])])
        inner = trace.get_current_span()  # what the step's RPCs are parented on
    with tracing.step_scope():
        tracing.step_serves([SimpleNamespace(request=r) for r in reqs])
    tracing.step_serves([SimpleNamespace(request=reqs[0])])  # outside a step: ignored
    assert not trace.get_current_span().get_span_context().is_valid
    for r in reqs:
        tracing.end_request_span(r, SimpleNamespace(finish_reason="length", completion_tokens=8,
                                                    spec=SimpleNamespace(as_dict=lambda: {"draft_tokens": 5})))
    done = spans.get_finished_spans()
    single, batched = [s for s in done if s.name == "tandem.step"]
    requests = {s.attributes["tandem.request_id"]: s for s in done if s.name == "text_completion model"}
    r0 = requests["r0"]
    assert inner.get_span_context().span_id == single.context.span_id
    assert single.parent.span_id == r0.context.span_id and single.context.trace_id == r0.context.trace_id
    assert [link.context.span_id for link in single.links] == [r0.context.span_id]
    assert batched.parent is None  # a trace of its own ...
    assert [link.context.span_id for link in batched.links] == [requests[f"r{i}"].context.span_id
                                                                for i in range(3)]  # ... found from each request
    assert r0.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert r0.attributes["gen_ai.usage.output_tokens"] == 8 and r0.attributes["tandem.spec.draft_tokens"] == 5
    assert all(r.span is None for r in reqs)


def test_grpc_calls_carry_the_trace_and_a_failed_call_is_marked_on_both_sides(spans):
    host = ServiceHost("127.0.0.1", 0, [SERVICE_NAME])  # with tracing on: the server interceptor is in
    host.add(target_pb2_grpc.add_TargetServiceServicer_to_server, TargetServicer(Path(".")))  # no engine yet
    host.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    stub = target_pb2_grpc.TargetServiceStub(grpc_tracing.instrument_channel(channel))
    try:
        with tracing._tracer.start_as_current_span("caller") as caller:
            with pytest.raises(grpc.RpcError) as err:
                stub.GetInfo(target_pb2.GetInfoRequest(), timeout=10)
            traceparent = telemetry.current_traceparent()
    finally:
        channel.close()
        host.stop(0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert traceparent.split("-")[1] == format(caller.get_span_context().trace_id, "032x")
    by_kind = {s.kind: s for s in spans.get_finished_spans() if s.name == "tandem.v1.TargetService/GetInfo"}
    client, server = by_kind[SpanKind.CLIENT], by_kind[SpanKind.SERVER]
    assert client.parent.span_id == caller.get_span_context().span_id
    assert server.parent.span_id == client.context.span_id  # continued from the metadata
    assert server.context.trace_id == caller.get_span_context().trace_id
    for s in (client, server):
        assert s.status.status_code == StatusCode.ERROR
        assert s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert telemetry.context_from_traceparent(traceparent) is not None


def test_a_stream_message_carries_its_step_into_the_receivers_span(spans):
    with tracing._tracer.start_as_current_span("step") as step:
        traceparent = telemetry.current_traceparent()  # what the sender puts in the message
    with telemetry.continued_span("tandem.v1.TargetService/Stream message", traceparent):
        pass
    with telemetry.continued_span("no context", ""):
        assert not trace.get_current_span().get_span_context().is_valid
    (received,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert received.parent.span_id == step.get_span_context().span_id
    assert received.context.trace_id == step.get_span_context().trace_id


# ---------------------------------------------------------------------------- logging

@pytest.fixture()
def root_logging():
    """setup_logging replaces the root handlers (pytest's too): put them back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _configure(monkeypatch, **env: str) -> io.StringIO:
    for key in (logging_setup.LEVEL_ENV, logging_setup.FORMAT_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    logging_setup.setup_logging("target")
    return out


def test_json_log_lines_carry_the_current_trace_and_honour_the_level(monkeypatch, root_logging):
    out = _configure(monkeypatch, TANDEM_LOG_LEVEL="warning", TANDEM_LOG_FORMAT="json")
    log = logging.getLogger("tandem.test")
    ctx = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331, is_remote=False,
                      trace_flags=TraceFlags(1))
    log.info("not at warning level")
    log.warning("no request here")
    with trace.use_span(trace.NonRecordingSpan(ctx)):
        log.warning("about request %s", "r1")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["no request here", "about request r1"]
    assert "trace_id" not in lines[0]
    assert (lines[1]["trace_id"], lines[1]["span_id"]) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    assert (lines[1]["service"], lines[1]["logger"], lines[1]["level"]) == ("target", "tandem.test", "WARNING")


def test_text_logs_by_default_and_a_bad_setting_falls_back_with_a_warning(monkeypatch, root_logging):
    out = _configure(monkeypatch, TANDEM_LOG_LEVEL="loud", TANDEM_LOG_FORMAT="yaml")
    logging.getLogger("tandem.test").info("hello")
    text = out.getvalue()
    assert "TANDEM_LOG_LEVEL='LOUD' is not a level" in text and "TANDEM_LOG_FORMAT='yaml'" in text
    assert " target INFO hello" in text and not text.lstrip().startswith("{")
