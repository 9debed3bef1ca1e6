"""The draft service's Prometheus metrics, served on `tandem draft --metrics-port`.

The servicer records each call with one call here, after the engine has
returned; the engine knows nothing of metrics. A Draft call's time covers the
lazy catch-up of its requests and the tree growth; an Ingest with catch_up
(how the gateway feeds a replica off the critical path) is the catch-up time.
The KV gauge is `tandem_draft_kv_cache_usage_ratio`, the draft's own view of
what the gateway reports as `tandem_kv_cache_usage_ratio{service="draft"}`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from draft_service.metrics_http import draft_load_collector
from draft_service.types import DraftItem, DraftLoad, DraftTree, IngestItem
from tandem.service_metrics import COUNT_BUCKETS, STEP_SECONDS_BUCKETS, new_registry


def _feature_bytes(items: Sequence[IngestItem]) -> int:
    return sum(it.features.numel() * it.features.element_size() for it in items if it.features is not None)


class DraftMetrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 load: Callable[[], DraftLoad | None] | None = None):
        self.registry = registry or new_registry()
        r = self.registry
        self.step_seconds = Histogram("tandem_draft_step_seconds", "Engine time of one Draft call (catch-up "
                                      "and tree growth for all its requests)", buckets=STEP_SECONDS_BUCKETS,
                                      registry=r)
        self.step_tokens = Histogram("tandem_draft_step_tokens", "Tree nodes drafted in one Draft call",
                                     buckets=COUNT_BUCKETS, registry=r)
        self.step_sequences = Histogram("tandem_draft_step_sequences", "Requests given a tree in one Draft call "
                                        "(batch size)", buckets=COUNT_BUCKETS, registry=r)
        self.draft_tokens = Counter("tandem_draft_tokens", "Tree nodes drafted", registry=r)
        self.catch_up_seconds = Histogram("tandem_draft_catch_up_seconds", "Engine time of one Ingest call with "
                                          "catch_up (the draft KV computed off the critical path)",
                                          buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.ingested_tokens = Counter("tandem_draft_ingested_tokens", "Tokens sent to the draft (Ingest and "
                                       "the ingest part of Draft calls)", registry=r)
        self.feature_bytes = Counter("tandem_draft_feature_bytes", "Bytes of target features received",
                                     registry=r)
        self.feature_read_seconds = Histogram("tandem_draft_feature_read_seconds", "Time one call spent taking "
                                              "its target features (--target): pushed rows, waited for if on "
                                              "their way, then a ReadFeatures read of the rest",
                                              buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.target_feature_rows = Counter("tandem_draft_target_feature_rows", "Target feature rows asked for "
                                           "(--target), by where they came from: pushed by the target, read "
                                           "from it, or absent (dropped, or the target unreachable: those "
                                           "positions are caught up without them)", ["source"], registry=r)
        self.push_catch_up_positions = Counter(
            "tandem_draft_push_catch_up_positions", "Draft positions computed as the target pushed their features "
            "and the tokens after them (--catch-up-on-push), before the gateway's next call brought the same "
            "tokens", registry=r)
        self.push_catch_up_seconds = Histogram(
            "tandem_draft_push_catch_up_seconds", "Engine time of one catch-up on a step's pushed rows "
            "(--catch-up-on-push)", buckets=STEP_SECONDS_BUCKETS, registry=r)
        if load is not None:  # tandem_draft_sequences and _kv_cache_usage_ratio, read at each scrape
            r.register(draft_load_collector(load))

    def _record_ingest(self, items: Sequence[IngestItem]) -> None:
        if items:
            self.ingested_tokens.inc(sum(len(it.tokens) for it in items))
            feature_bytes = _feature_bytes(items)
            if feature_bytes:
                self.feature_bytes.inc(feature_bytes)

    def record_draft(self, ingest: Sequence[IngestItem], items: Sequence[DraftItem], trees: Sequence[DraftTree],
                     seconds: float) -> None:
        nodes = sum(len(t.tokens) for t in trees)
        self.step_seconds.observe(seconds)
        self.step_tokens.observe(nodes)
        self.step_sequences.observe(sum(1 for it in items if not it.budget.empty))
        if nodes:
            self.draft_tokens.inc(nodes)
        self._record_ingest(ingest)

    def record_feature_read(self, seconds: float) -> None:
        self.feature_read_seconds.observe(seconds)

    def record_feature_rows(self, source: str, rows: int) -> None:
        """source: pushed, read or absent."""
        if rows:
            self.target_feature_rows.labels(source=source).inc(rows)

    def record_push_catch_up(self, positions: int, seconds: float) -> None:
        if positions:
            self.push_catch_up_positions.inc(positions)
            self.push_catch_up_seconds.observe(seconds)

    def record_ingest(self, items: Sequence[IngestItem], catch_up: bool, seconds: float) -> None:
        if catch_up:
            self.catch_up_seconds.observe(seconds)
        self._record_ingest(items)
