"""An OTLP trace receiver of the tests' own, over gRPC or HTTP/protobuf: what a collector would get."""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # '' for a root
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    attributes: dict[str, object] = field(hash=False)
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)


class _Store:
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=str(service), name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links)))
        with self._lock:
            self._spans.extend(got)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """opentelemetry.proto.collector.trace.v1.TraceService on a free port; endpoint http://127.0.0.1:PORT."""

    def __init__(self) -> None:
        self.store = _Store()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 (gRPC's naming)
        self.store.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        return self.store.spans()

    def stop(self) -> None:
        self.server.stop(0)


class HttpReceiver:
    """POST /v1/traces with protobuf bodies, on a free port; endpoint http://127.0.0.1:PORT."""

    def __init__(self) -> None:
        store = self.store = _Store()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                store.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[ReceivedSpan]:
        return self.store.spans()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
