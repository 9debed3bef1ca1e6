"""The target's KV gauges under calls that finish out of order (no model, no gRPC server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.v1 import target_pb2
from target_service.metrics import TargetMetrics
from target_service.server import TargetServicer, _StepRun
from target_service.step_batch import StepBatch, StepResults
from target_service.types import KvLoad, SequenceStep


class HeldSequences:
    """What the servicer asks of an engine here: its load and Release."""

    def __init__(self, request_ids: set[str]):
        self.request_ids = set(request_ids)

    def load(self) -> KvLoad:
        return KvLoad(num_sequences=len(self.request_ids), block_size=16, total_blocks=8,
                      free_blocks=8 - len(self.request_ids))

    def release(self, request_ids: list[str]) -> int:
        released = self.request_ids & set(request_ids)
        self.request_ids -= released
        return len(released)


def test_a_steps_metrics_recorded_after_a_later_release_do_not_bring_back_the_released_sequence():
    """A step's metrics are recorded once its reply has left; the gateway may have released the
    request by then. The gauges show the load at the scrape (a CI run waited 60 s for a stale 1)."""
    engine = HeldSequences({"a"})
    metrics = TargetMetrics(load=engine.load)
    servicer = TargetServicer(Path("."), metrics=metrics)
    servicer.engine = engine

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    step = _StepRun(batch=StepBatch.from_items([SequenceStep.chain("a", (1,))]),
                    results=StepResults(request_ids=("a",), num_accepted=np.zeros(1, np.int32),
                                        accepted_nodes=np.zeros((1, 1), np.int32),
                                        new_tokens=np.zeros((1, 1), np.int32), logprobs=np.zeros((1, 1), np.float32),
                                        num_committed=np.array([5])),
                    load=engine.load(), seconds=0.001, pushes=[])
    reply = servicer.Release(target_pb2.ReleaseRequest(request_ids=["a"]), None)
    assert reply.released == 1 and gauge("tandem_target_sequences") == 0
    servicer._after_reply(step)  # the step's metrics, late
    assert gauge("tandem_target_sequences") == 0 and gauge("tandem_target_kv_cache_usage_ratio") == 0
    assert gauge("tandem_target_step_seconds_sum") > 0  # the step itself was recorded
    engine.request_ids.add("b")  # a later step's load is shown
    assert gauge("tandem_target_sequences") == 1
