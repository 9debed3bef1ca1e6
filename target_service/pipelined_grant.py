"""A plain-decode grant with two steps in flight: step j+1 is on the GPU before step j is read.

A granted step's input is known before the previous step's result, except for
its tokens: each sequence's next token is the bonus token the previous step
sampled, which stays on the device. So the host packs step j+1 (positions,
block tables, cache slots) while step j runs, the device copies step j's bonus
tokens into step j+1's input, and step j's results are read while step j+1 runs.
The GPU never waits for the host between granted steps.

What the host learns late is a stop token: a sequence that emits one at step j
was already launched in step j+1; that step's token for it is dropped (never
reported) and the sequence is not fed again. Stops by count (max_new_tokens) are
known in advance and cost nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from target_service.grant import GrantStep
from target_service.step_batch import StepBatch, StepResults
from target_service.types import OutOfCapacity
from target_service.wire import GrantStops

if TYPE_CHECKING:
    from target_service.cuda_graphs import BucketGraph
    from target_service.engine import TargetEngine


@dataclass(eq=False)
class _Launched:
    """A step on the device, not yet read."""

    active: np.ndarray  # which items of the grant it serves, ascending
    batch: StepBatch
    bucket: BucketGraph
    host_out: torch.Tensor  # where its results land (pinned)
    event: torch.cuda.Event | None
    committed: np.ndarray  # each item's length after the step


def pipelined(engine: TargetEngine, batch: StepBatch) -> bool:
    """Whether a grant of `batch` can run pipelined: greedy without logits controls, on CUDA-graph
    buckets, nothing but tokens back."""
    return (engine.graphs is not None and bool(batch.greedy.all()) and not batch.top_logprobs.any()
            and not batch.return_features.any() and batch.controls is None
            and engine.graphs.bucket_for(batch, (), 0) is not None)


class PipelinedGrant:
    def __init__(self, engine: TargetEngine, batch: StepBatch, stops: GrantStops, steps: int,
                 interrupted: Callable[[], bool]):
        self.engine, self.batch, self.stops, self.steps, self.interrupted = engine, batch, stops, steps, interrupted
        self.cuda = engine.device.type == "cuda"
        self._flip = 0

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The other pair of pinned input and output buffers than the last step's."""
        self._flip ^= 1
        return self.engine.graphs.grant_buffer_pair(self._flip)

    def _launch(self, active: np.ndarray, previous: _Launched | None) -> _Launched | None:
        """Pack and start one plain step of the items `active`; None when the KV cache cannot take it."""
        engine, kv = self.engine, self.engine.kv
        rids = [self.batch.request_ids[i] for i in active.tolist()]
        seqs = [kv.seqs[rid] for rid in rids]
        need = sum(kv.extra_blocks_needed(rid, s.length + 1) for rid, s in zip(rids, seqs))
        if need > kv.free_blocks:
            return None
        if previous is None:
            tokens = self.batch.tokens[active]
        else:  # the rows of the previous step's results that hold each item's next token
            tokens = np.searchsorted(previous.active, active).astype(np.int32)
        part = self.batch.take(active, tokens)
        for rid, seq in zip(rids, seqs):
            kv.reserve(rid, seq.length + 1)
        updates = engine.table.take_pending()
        bucket = engine.graphs.bucket_for(part, (), len(updates))
        if bucket is None:  # more table entries than the bucket carries (left by an earlier step): set them now
            engine.table.pending.update(updates)
            engine.table.flush()
            updates = {}
            bucket = engine.graphs.bucket_for(part, (), 0)
        host_in, host_out = self._buffers()
        prefix = engine.pack(part, updates, bucket.shape, bucket.block_m, bucket.layout.host_views(host_in.numpy()))
        bucket.load_inputs(host_in[: bucket.layout.size])
        if previous is not None:  # each item's token: the bonus the previous step sampled for it
            into = bucket.views["tokens"][: len(active)]
            into.copy_(previous.bucket.out[:, 1][into.long()])
        _, out = bucket.replay(greedy_only=True)
        landing = host_out[: out.numel()].view(out.shape)
        landing.copy_(out, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        for seq in seqs:  # the fixed token is committed whatever the step samples
            seq.length += 1
        return _Launched(active=active, batch=part, bucket=bucket, host_out=landing, event=event,
                         committed=prefix + 1)

    def _read(self, step: _Launched) -> StepResults:
        if step.event is not None:
            step.event.synchronize()
        raw = step.host_out.numpy()[: len(step.active)]
        n = len(step.active)
        return StepResults(request_ids=step.batch.request_ids, num_accepted=np.zeros(n, dtype=np.int32),
                           accepted_nodes=np.zeros((n, 1), dtype=np.int32), new_tokens=raw[:, 2:3].copy(),
                           logprobs=raw[:, 3:4].copy().view(np.float32), num_committed=step.committed.copy())

    def __iter__(self) -> Iterator[GrantStep]:
        limit = self.stops.max_new_tokens.astype(np.int64)
        emitted = np.zeros(self.batch.size, dtype=np.int64)
        stopped = np.zeros(self.batch.size, dtype=bool)
        follow = np.arange(self.batch.size)  # items the next launch feeds
        in_flight: deque[_Launched] = deque()
        launched = 0
        ending = False
        while True:
            while (not ending and len(in_flight) < 2 and launched < self.steps and len(follow)
                   and (launched == 0 or not self.interrupted())):
                step = self._launch(follow, in_flight[-1] if in_flight else None)
                if step is None:  # out of KV: end here; the gateway plans (and preempts) next
                    if launched == 0:
                        raise OutOfCapacity("a granted step needs more KV blocks than are free")
                    ending = True
                    break
                in_flight.append(step)
                launched += 1
                emitted[follow] += 1
                follow = follow[emitted[follow] < limit[follow]]
            if not in_flight:
                return
            step = in_flight.popleft()
            results = self._read(step)
            live = ~stopped[step.active]  # launched before an earlier token stopped them: dropped
            tokens = results.new_tokens[:, 0]
            for i, (item, token) in enumerate(zip(step.active.tolist(), tokens.tolist())):
                if live[i] and token in self.stops.stop_token_ids[item]:
                    stopped[item] = True
            follow = follow[~stopped[follow]]
            if self.interrupted() or launched >= self.steps or not len(follow):
                ending = True
            last = ending and not in_flight
            keep = np.flatnonzero(live)
            if len(keep) < len(step.active):
                results = _take(results, keep)
            yield GrantStep(results=results if len(keep) else None, item_index=step.active[keep], last=last,
                            batch=step.batch)
            if last:
                return


def _take(results: StepResults, rows: np.ndarray) -> StepResults:
    return StepResults(request_ids=tuple(results.request_ids[r] for r in rows.tolist()),
                       num_accepted=results.num_accepted[rows], accepted_nodes=results.accepted_nodes[rows],
                       new_tokens=results.new_tokens[rows], logprobs=results.logprobs[rows],
                       num_committed=results.num_committed[rows])
