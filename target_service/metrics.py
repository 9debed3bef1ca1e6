"""The target service's Prometheus metrics, served on `tandem target --metrics-port`.

The servicer records each step with one call (`record_batch`) after the engine
has returned, outside its lock; the engine knows nothing of metrics. The KV
gauges (`tandem_target_sequences`, `tandem_target_kv_cache_usage_ratio`) are
read from the engine at each scrape (tandem.service_metrics.LoadCollector). A
step's sequences are counted by kind: `verify` (drafted nodes below the fixed chain),
`prefill` (a new sequence, or more than one fixed token), `decode` (one fixed
token of a known sequence: plain decoding). Acceptance by draft position: a
verified tree whose first k drafted tokens were accepted counts once at each
position 1..k, so position k's rate per verified tree is
`accepted_tokens_by_position{position="k"} / sequence_steps{kind="verify"}`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from tandem.service_metrics import COUNT_BUCKETS, STEP_SECONDS_BUCKETS, LoadCollector, new_registry
from target_service.step_batch import StepBatch, StepResults
from target_service.types import KvLoad

KINDS = ("prefill", "decode", "verify")


class TargetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, load: Callable[[], KvLoad | None] | None = None):
        """load: the engine's load now, None while the model loads (no load: no KV gauges)."""
        self.registry = registry or new_registry()
        r = self.registry
        self.step_seconds = Histogram("tandem_target_step_seconds", "Engine time of one Step (all its sequences)",
                                      buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.step_tokens = Histogram("tandem_target_step_tokens", "Tokens (prompt chunks, decode tokens and tree "
                                     "nodes) in one Step", buckets=COUNT_BUCKETS, registry=r)
        self.step_sequences = Histogram("tandem_target_step_sequences", "Sequences in one Step (batch size)",
                                        buckets=COUNT_BUCKETS, registry=r)
        self.sequence_steps = Counter("tandem_target_sequence_steps", "Sequences stepped, by kind "
                                      "(prefill, decode = plain, verify = a drafted tree)", ["kind"], registry=r)
        self.draft_tokens = Counter("tandem_target_draft_tokens", "Drafted tree nodes verified", registry=r)
        self.accepted_tokens = Counter("tandem_target_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.accepted_by_position = Counter("tandem_target_accepted_tokens_by_position",
                                            "Verified trees whose drafted token at this depth was accepted",
                                            ["position"], registry=r)
        self.committed_tokens = Counter("tandem_target_committed_tokens", "Tokens committed to sequences "
                                        "(accepted drafted tokens plus the token each step samples)", ["kind"],
                                        registry=r)
        self.feature_bytes = Counter("tandem_target_feature_bytes", "Bytes of EAGLE-3 features returned for the "
                                     "draft", registry=r)
        self.held_feature_bytes = Counter("tandem_target_held_feature_bytes", "Bytes of EAGLE-3 features held "
                                          "for draft replicas to read (hold_features), not returned", registry=r)
        self.pushed_feature_bytes = Counter("tandem_target_pushed_feature_bytes", "Bytes of EAGLE-3 features "
                                            "pushed to the subscriber a step named (SubscribeFeatures), not "
                                            "returned", registry=r)
        if load is not None:
            r.register(LoadCollector(load, ("tandem_target_sequences", "Sequences holding KV on the target"),
                                     ("tandem_target_kv_cache_usage_ratio", "Share of the target's KV blocks in use")))
        self._kind = {k: self.sequence_steps.labels(kind=k) for k in KINDS}
        self._committed = {k: self.committed_tokens.labels(kind=k) for k in KINDS}
        self._positions: list = []  # position k -> its child counter, at index k - 1
        self._grow = threading.Lock()  # two Steps may finish together

    def record_batch(self, batch: StepBatch, results: StepResults, seconds: float) -> None:
        """One step (unary or streamed), from its columns, with array operations."""
        n = batch.num_nodes.astype(np.int64)
        nf = batch.num_fixed.astype(np.int64)
        accepted = results.num_accepted.astype(np.int64)
        verify = n > nf
        prefill = ~verify & (batch.create | (nf > 1))
        decode = ~verify & ~prefill
        new_tokens = accepted + 1
        self.step_seconds.observe(seconds)
        self.step_tokens.observe(int(n.sum()))
        self.step_sequences.observe(batch.size)
        for kind, mask in (("prefill", prefill), ("decode", decode), ("verify", verify)):
            count = int(mask.sum())
            if count:
                self._kind[kind].inc(count)
                self._committed[kind].inc(int(new_tokens[mask].sum()))
        if verify.any():
            self.draft_tokens.inc(int((n - nf)[verify].sum()))
            self.accepted_tokens.inc(int(accepted[verify].sum()))
            lengths = np.bincount(accepted[verify])
            for position in range(1, len(lengths)):
                trees = int(lengths[position:].sum())  # trees that accepted at least `position` tokens
                if trees:
                    self._position(position).inc(trees)
        if results.features is not None:
            self.feature_bytes.inc(results.features.numel() * results.features.element_size())

    def _position(self, position: int):
        if len(self._positions) < position:
            with self._grow:
                while len(self._positions) < position:
                    self._positions.append(self.accepted_by_position.labels(position=str(len(self._positions) + 1)))
        return self._positions[position - 1]
