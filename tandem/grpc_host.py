"""Hosting a gRPC service: health, reflection, one error mapping, graceful stop.

Every tandem server starts NOT_SERVING, flips to SERVING once its model is
loaded, and on SIGTERM/SIGINT goes NOT_SERVING (draining), lets in-flight
calls finish within a grace period, then stops.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from tandem.grpc_tracing import server_interceptors

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 512 * 1024 * 1024  # between the services: a long prefill's features in float32


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


GRPC_OPTIONS = message_options(MAX_MESSAGE_BYTES)

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def map_errors(method: Callable) -> Callable:
    """Decorate a unary servicer method: service errors become gRPC status codes."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # the one place service errors reach the wire
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
            context.abort(code, message)

    return wrapper


class ServiceHost:
    """credentials: None listens in plaintext; interceptors: e.g. tandem.grpc_auth.ApiKeyInterceptor;
    max_message_bytes bounds what a call may send or receive."""

    def __init__(self, host: str, port: int, service_names: Iterable[str], max_workers: int = 32, *,
                 credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = (), max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.service_names = list(service_names)
        # Tracing interceptors exist only when tandem.telemetry.setup_tracing ran first (an OTLP endpoint).
        # SO_REUSEPORT off (gRPC sets it by default): a second server told the same port would share it with
        # the first, the kernel splitting connections between two different processes; it is refused instead.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                                  options=[*message_options(max_message_bytes), ("grpc.so_reuseport", 0)],
                                  interceptors=[*server_interceptors(), *interceptors])
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        address = f"{host}:{port}"
        try:
            self.port = (self.server.add_insecure_port(address) if credentials is None
                         else self.server.add_secure_port(address, credentials))
        except RuntimeError:  # gRPC's "Failed to bind to address"
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {address}: the address is in use, or not this host's")
        self.stopping = threading.Event()
        # Called once a stop begins, before the drain: e.g. to end streams that would otherwise
        # stay open until the grace runs out.
        self.on_draining: list[Callable[[], None]] = []
        self.set_serving(False)

    def add(self, add_fn: Callable, servicer: object) -> None:
        add_fn(servicer, self.server)

    def start(self) -> None:
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace: float = 5.0) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let running ones finish."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.set_serving(False)
        for hook in self.on_draining:
            hook()
        self.server.stop(grace).wait()

    def run_until_signal(self, grace: float = 5.0, on_stop: Callable[[], None] | None = None) -> None:
        """Block until SIGTERM or SIGINT, then stop gracefully and call on_stop."""
        requested = threading.Event()

        def handler(signum, _frame):
            log.info("received %s, draining", signal.Signals(signum).name)
            requested.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        while not requested.wait(0.5) and not self.stopping.is_set():
            pass
        self.stop(grace)
        if on_stop is not None:
            on_stop()
