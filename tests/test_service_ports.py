"""A service told a port that another server holds refuses to start, with a reason: gRPC's default
(SO_REUSEPORT) would have let it share the port, the kernel splitting connections between two processes."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from tandem.grpc_host import ServiceHost
from tests.services import REPO


def test_a_second_service_host_on_a_taken_port_is_refused():
    first = ServiceHost("127.0.0.1", 0, ["x"])
    first.start()
    try:
        with pytest.raises(OSError, match="in use"):
            ServiceHost("127.0.0.1", first.port, ["x"])
    finally:
        first.server.stop(0)


def test_a_port_held_by_a_server_with_grpcs_defaults_is_refused_too():
    other = grpc.server(futures.ThreadPoolExecutor(1))  # SO_REUSEPORT on, as gRPC sets it
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        with pytest.raises(OSError, match="in use"):
            ServiceHost("127.0.0.1", port, ["x"])
    finally:
        other.stop(0)


def test_tandem_target_on_a_taken_port_exits_with_a_reason_not_a_traceback(tiny_llama):
    holder = ServiceHost("127.0.0.1", 0, ["x"])
    holder.start()
    try:
        out = subprocess.run([sys.executable, "-m", "tandem.cli", "target", "--model", str(tiny_llama("gqa")),
                              "--port", str(holder.port)], capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        holder.server.stop(0)
    assert out.returncode != 0
    assert re.search(rf"error: --port: cannot listen on \S+:{holder.port}: the address is in use", out.stderr), \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr
