"""Clients and probes for the fault tests: streams over REST and gRPC that record how they ended,
and the services' own KV reports.

A stream runs in a thread and records its text, how it ended and, for the tests that kill
a service mid-stream, how many chunks had arrived; `cancel_after` makes the client go away
after that many chunks (0: as soon as the call is open)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tests.services import Service

TARGET_GAUGE = 'tandem_kv_cache_usage_ratio{service="target"}'
DRAFT_GAUGE = 'tandem_kv_cache_usage_ratio{service="draft"}'


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0, poll: float = 0.05) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


@dataclass(eq=False)
class StreamResult:
    """How one client call went. `outcome`: "running", "completed" (a finish reason arrived and the
    call ended cleanly), "cancelled" (the client left on purpose), or "error"."""

    api: str  # "rest", "rest-full" (not streamed) or "grpc"
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    outcome: str = "running"
    error: str = ""  # the gRPC status code name, or the REST status / error event's code
    message: str = ""
    ended_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def finish_or_fail(self) -> None:
        """The call ended cleanly: completed if a finish reason came, else an error."""
        if self.finish_reason:
            self.end("completed")
        else:
            self.end("error", "no-finish", "the stream ended without a finish reason")

    def end(self, outcome: str, error: str = "", message: str = "") -> None:
        self.outcome, self.error, self.message = outcome, error, message
        self.ended_at = time.monotonic()
        self.done.set()


def rest_stream(url: str, body: dict, result: StreamResult, cancel_after: int | None = None) -> None:
    """POST /v1/completions with stream: true; records every text chunk, an error event, [DONE]."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                result.end("error", str(r.status_code), r.text)
                return
            if cancel_after == 0:
                result.end("cancelled")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.end("error", chunk["error"]["code"], chunk["error"]["message"])
                    return
                for choice in chunk["choices"]:
                    result.text += choice["text"]
                    result.finish_reason = choice["finish_reason"] or result.finish_reason
                result.chunks += 1
                if cancel_after is not None and result.chunks >= cancel_after:
                    result.end("cancelled")  # leaving the block closes the connection
                    return
        result.finish_or_fail()
    except Exception as exc:
        result.end("error", type(exc).__name__, str(exc))


def rest_full(url: str, body: dict, result: StreamResult) -> None:
    """POST /v1/completions without streaming."""
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        if r.status_code != 200:
            result.end("error", str(r.status_code), r.json()["error"]["message"])
            return
        choice = r.json()["choices"][0]
        result.text, result.finish_reason, result.chunks = choice["text"], choice["finish_reason"], 1
        result.end("completed")
    except Exception as exc:
        result.end("error", type(exc).__name__, str(exc))


def grpc_stream(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest,
                result: StreamResult, cancel_after: int | None = None, timeout: float = 300) -> None:
    """Generate; records every message, the final status, or the client's own cancel."""
    call = stub.Generate(request, timeout=timeout)
    try:
        if cancel_after == 0:
            call.cancel()
            result.end("cancelled")
            return
        for reply in call:
            result.text += reply.text
            result.finish_reason = reply.finish_reason or result.finish_reason
            result.chunks += 1
            if cancel_after is not None and result.chunks >= cancel_after:
                call.cancel()
                result.end("cancelled")
                return
        result.finish_or_fail()
    except grpc.RpcError as exc:
        result.end("error", exc.code().name, exc.details() or "")
    except Exception as exc:
        result.end("error", type(exc).__name__, str(exc))


def start(fn: Callable, *args, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


def generation_stub(grpc_port: int) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))


def grpc_health(grpc_port: int, service: str = "") -> int | None:
    """The gateway's gRPC health status (of `service`), or None when it does not answer."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=5).status
        except grpc.RpcError:
            return None


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def target_load(service: Service) -> common_pb2.KvLoad:
    return target_pb2_grpc.TargetServiceStub(service.channel).GetLoad(target_pb2.GetLoadRequest(), timeout=10)


def draft_load(service: Service) -> common_pb2.KvLoad:
    return draft_pb2_grpc.DraftServiceStub(service.channel).GetLoad(draft_pb2.DraftLoadRequest(), timeout=10)


def holds_nothing(load: common_pb2.KvLoad) -> bool:
    return load.num_sequences == 0 and load.free_blocks == load.total_blocks
