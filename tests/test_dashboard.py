"""deploy/grafana/tandem-dashboard.json asks only for metrics that the services export."""

from __future__ import annotations

import json
import re

from draft_service.metrics import DraftMetrics
from draft_service.types import DraftLoad
from gateway.metrics import GatewayMetrics
from target_service.metrics import TargetMetrics
from target_service.types import KvLoad
from tests.services import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "tandem-dashboard.json"
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def exported_families() -> dict[str, str]:
    """Every metric family the three services register: name -> counter, gauge or histogram."""
    # The services' load gauges are read at scrape time: give them a load to read.
    draft = DraftMetrics(load=lambda: DraftLoad(num_sequences=1, block_size=16, total_blocks=8, free_blocks=4))
    target = TargetMetrics(load=lambda: KvLoad(num_sequences=1, block_size=16, total_blocks=8, free_blocks=4))
    return {family.name: family.type for metrics in (GatewayMetrics(), target, draft)
            for family in metrics.registry.collect()}


def family_of(series: str) -> str:
    for suffix in SERIES_SUFFIXES:
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def test_every_dashboard_query_names_an_exported_metric_of_the_right_type():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    assert all(e.count("(") == e.count(")") and e.count("{") == e.count("}") for e in exprs)
    kinds = exported_families()
    used = {name for e in exprs for name in re.findall(r"\btandem_[a-z0-9_]+", e)}
    assert {family_of(n) for n in used} <= set(kinds), sorted({family_of(n) for n in used} - set(kinds))
    # Counters are read as _total, histograms through their buckets, sums and counts, gauges as they are.
    for name in used:
        kind = kinds[family_of(name)]
        if kind == "counter":
            assert name.endswith("_total"), name
        elif kind == "histogram":
            assert name.endswith(("_bucket", "_sum", "_count")), name
        else:
            assert name == family_of(name), name
    # What the dashboard is for: tok/s by mode, acceptance, step time and KV usage of every service.
    for needed in ("tandem_generation_tokens_total", "tandem_target_accepted_tokens_by_position_total",
                   "tandem_step_seconds_bucket", "tandem_target_step_seconds_bucket",
                   "tandem_draft_step_seconds_bucket", "tandem_kv_cache_usage_ratio",
                   "tandem_target_kv_cache_usage_ratio",
                   "tandem_draft_kv_cache_usage_ratio"):
        assert needed in used, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"] for t in p.get("targets", []))
