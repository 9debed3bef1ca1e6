"""What the target's and the draft's metrics modules share: bucket layouts and the /metrics HTTP server.

Each service keeps its own registry (with process CPU and memory) and serves it
on `--metrics-port` (0 or absent: no server, nothing recorded).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

# Step times from a fraction of a millisecond (an 8B decode on a GPU is ~4 ms) to a slow CPU prefill.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                        0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNT_BUCKETS = tuple(float(2 ** i) for i in range(13))  # 1 .. 4096: tokens or sequences in a step


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` as Prometheus text on http://host:port/metrics in a daemon thread; the bound port."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SystemExit(f"error: cannot serve metrics on {host}:{port}: {exc}") from None
    return server.server_port
