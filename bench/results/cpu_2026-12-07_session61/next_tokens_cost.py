"""What a push's next tokens cost a target step: split_features alone (before the reply leaves) and
with_next_tokens (after it, since 23182d1), batch 1/8/64 of verify items with four committed rows each.
    PYTHONPATH=. python bench/results/cpu_2026-12-07_session61/next_tokens_cost.py
"""

import time

import numpy as np
import torch

from target_service.feature_sinks import split_features, with_next_tokens
from target_service.step_batch import StepBatch, StepResults
from target_service.types import SequenceStep


def median_us(fn, n: int = 2000) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[n // 2]


for B in (1, 8, 64):
    steps = [SequenceStep(f"r{b}", (5, 6, 7, 8, 9), (-1, 0, 1, 2, 3), 1, return_features=True, sample_is_output=True)
             for b in range(B)]
    batch = StepBatch.from_items(steps)
    M = 5
    results = StepResults(request_ids=batch.request_ids, num_accepted=np.full(B, 3, np.int32),
                          accepted_nodes=np.zeros((B, M), np.int32), new_tokens=np.arange(B * M, dtype=np.int32)
                          .reshape(B, M), logprobs=np.zeros((B, M), np.float32),
                          num_committed=np.full(B, 100, np.int64), features=torch.randn(4 * B, 64),
                          feature_counts=np.full(B, 4, np.int64))
    light, found = split_features(results)
    pushes = [("sink", rows) for _, rows in found]
    split_us = median_us(lambda results=results: split_features(results))
    tokens_us = median_us(lambda pushes=pushes, batch=batch, light=light: with_next_tokens(pushes, batch, light))
    print(f"batch {B}: split_features {split_us:.1f} us, with_next_tokens {tokens_us:.1f} us")
