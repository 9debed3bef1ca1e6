"""What the target's and the draft's metrics modules share: bucket layouts, the KV load gauges read at
each scrape, and the /metrics HTTP server.

Each service keeps its own registry (with process CPU and memory) and serves it
on `--metrics-port` (0 or absent: no server, nothing recorded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tandem.lane import SPIN_STATS

# Step times from a fraction of a millisecond (an 8B decode on a GPU is ~4 ms) to a slow CPU prefill.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                        0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNT_BUCKETS = tuple(float(2 ** i) for i in range(13))  # 1 .. 4096: tokens or sequences in a step


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(LaneSpinCollector())
    return registry


class LaneSpinCollector:
    """This process's spinning lane reads (tandem/lane.py, `tandem serve --lane-spin-us`), read at each scrape:
    how many found their message within the spin and how many blocked after it (a spin too short for the
    waits it meets), and the seconds spent spinning (what the spin costs in CPU)."""

    def collect(self) -> Iterator[Metric]:
        caught, blocked, seconds = SPIN_STATS.snapshot()
        reads = CounterMetricFamily("tandem_lane_spin_reads", "Lane reads that spun first, by whether their "
                                    "message came within the spin ('data') or the read then blocked ('blocked')",
                                    labels=["outcome"])
        reads.add_metric(["data"], caught)
        reads.add_metric(["blocked"], blocked)
        yield reads
        yield CounterMetricFamily("tandem_lane_spin_seconds", "Seconds lane reads spent spinning (a core each)",
                                  value=seconds)


class KvLoadLike(Protocol):
    num_sequences: int
    total_blocks: int
    free_blocks: int


class LoadCollector:
    """A service's sequences and KV usage as gauges, asked of `load` at every scrape (None: still
    loading, so no value rather than a false zero): never staler than the scrape. (A load recorded with
    each step can land after a later release's: a step's metrics are recorded once its reply has left,
    and a CI run waited 60 s for the target's sequences to read 0 after the gateway had released it.)"""

    def __init__(self, load: Callable[[], KvLoadLike | None], sequences: tuple[str, str], usage: tuple[str, str]):
        """sequences, usage: each gauge's (name, help)."""
        self.load = load
        self.sequences, self.usage = sequences, usage

    def collect(self) -> Iterator[Metric]:
        load = self.load()
        if load is None:
            return
        yield GaugeMetricFamily(*self.sequences, value=load.num_sequences)
        yield GaugeMetricFamily(*self.usage, value=1 - load.free_blocks / max(load.total_blocks, 1))


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` as Prometheus text on http://host:port/metrics in a daemon thread; the bound port."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SystemExit(f"error: cannot serve metrics on {host}:{port}: {exc}") from None
    return server.server_port
