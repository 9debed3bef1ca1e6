"""Plain decoding the target feeds forward itself: a grant of up to k steps.

The gateway grants k steps when a batch decodes plainly; each step's new token
is the next step's input, a sequence stops being fed once it emits one of its
stop token ids or its max_new_tokens, and the grant ends early when the caller
says so (a new plan at the gateway). The gateway still owns every request: it
receives every step's tokens and discards, by count, any past a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from target_service.step_batch import StepBatch, StepResults
from target_service.types import InvalidStep
from target_service.wire import GrantStops


@dataclass(frozen=True, kw_only=True, eq=False)
class GrantStep:
    results: StepResults | None  # None: nothing to report (the grant ended between steps)
    item_index: np.ndarray  # which items of the grant's first batch the results are for
    last: bool
    batch: StepBatch | None = None  # what ran in this step (for metrics), when known


def check_grant(batch: StepBatch, stops: GrantStops) -> None:
    bad = (batch.num_nodes != 1) | (batch.num_fixed != 1) | batch.create
    if bad.any():
        rid = batch.request_ids[int(np.flatnonzero(bad)[0])]
        raise InvalidStep(f"request {rid!r}: a grant's items must be one fixed node of an existing sequence")
    if (stops.max_new_tokens < 1).any():
        rid = batch.request_ids[int(np.flatnonzero(stops.max_new_tokens < 1)[0])]
        raise InvalidStep(f"request {rid!r}: max_new_tokens of a grant must be >= 1")


def run_grant(step: Callable[[StepBatch], StepResults], batch: StepBatch, stops: GrantStops, steps: int,
              interrupted: Callable[[], bool]) -> Iterator[GrantStep]:
    """Run up to `steps` steps of `batch` (checked with check_grant), yielding each."""
    active = np.arange(batch.size)
    emitted = np.zeros(batch.size, dtype=np.int64)
    current = batch
    for done_steps in range(1, steps + 1):
        results = step(current)
        new = results.new_tokens[:, 0]
        emitted[active] += 1
        stopped = emitted[active] >= stops.max_new_tokens[active]
        for i, (item, token) in enumerate(zip(active.tolist(), new.tolist())):
            if token in stops.stop_token_ids[item]:
                stopped[i] = True
        follow = active[~stopped]
        last = done_steps == steps or len(follow) == 0 or interrupted()
        yield GrantStep(results=results, item_index=active, last=last, batch=current)
        if last:
            return
        if interrupted():  # arrived while the reply was on its way: end without another step
            yield GrantStep(results=None, item_index=follow[:0], last=True)
            return
        current = batch.take(follow, new[~stopped])
        active = follow
