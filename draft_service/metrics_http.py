"""The draft replica's load as Prometheus metrics over HTTP: what its autoscaler scales on.

Served on `tandem draft --metrics-port P` at `/metrics` (any path answers), read
from the engine at each scrape, so a value is never staler than the scrape:
- `tandem_draft_sequences`: requests whose draft state this replica holds. The
  gateway sticks each new request to the least loaded replica, so the mean of
  this over the replicas falls when one is added: the HorizontalPodAutoscaler in
  deploy/kubernetes targets it.
- `tandem_draft_kv_cache_usage_ratio`: share of this replica's KV blocks in use.
While the model loads, neither is reported (a scrape still succeeds).
"""

from __future__ import annotations

from collections.abc import Callable

from draft_service.types import DraftLoad
from tandem.service_metrics import LoadCollector

SEQUENCES = "tandem_draft_sequences"
KV_USAGE = "tandem_draft_kv_cache_usage_ratio"


def draft_load_collector(load: Callable[[], DraftLoad | None]) -> LoadCollector:
    """The replica's load gauges, asked of `load` at every scrape; None means still loading."""
    return LoadCollector(load, (SEQUENCES, "Requests whose draft state this replica holds"),
                         (KV_USAGE, "Share of this draft replica's KV blocks in use"))
