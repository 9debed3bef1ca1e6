"""The draft's load metrics endpoint: the metric its autoscaler scales on, read at each scrape."""

from __future__ import annotations

import urllib.request

from draft_service.metrics import DraftMetrics
from draft_service.metrics_http import KV_USAGE, SEQUENCES
from draft_service.server import build_parser
from draft_service.types import DraftLoad
from tandem.service_metrics import serve_metrics


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_endpoint_reports_the_engine_load_at_each_scrape_and_nothing_while_loading():
    current: list[DraftLoad | None] = [None]
    m = DraftMetrics(load=lambda: current[0])
    port = serve_metrics(m.registry, "127.0.0.1", 0)  # as `tandem draft --metrics-port` serves it
    assert SEQUENCES not in scrape(port)  # still loading: no value rather than a false zero
    current[0] = DraftLoad(num_sequences=3, block_size=16, total_blocks=100, free_blocks=75)
    got = scrape(port)
    assert got[SEQUENCES] == 3 and got[KV_USAGE] == 0.25
    current[0] = DraftLoad(num_sequences=0, block_size=16, total_blocks=100, free_blocks=100)
    assert scrape(port)[SEQUENCES] == 0


def test_the_draft_command_takes_a_metrics_port_and_leaves_it_off_by_default():
    base = ["--model", "d", "--target-model", "t", "--port", "0"]
    assert build_parser().parse_args(base).metrics_port is None
    assert build_parser().parse_args([*base, "--metrics-port", "9090"]).metrics_port == 9090
