"""Where a step's features go when its caller asks the target to keep them (hold_features).

Either they wait in the FeatureStore until a reader pulls them (ReadFeatures),
or, when the step names a feature sink for the item and a reader is subscribed
under that name (SubscribeFeatures), they are pushed to it right after the step's
reply has left (the reply does not wait for them; the reader waits for pushed rows).
A push is one hop beside the step's reply, so the reader has the rows by about
the time it is asked to use them; a pull is a round trip on the speculative
round's critical path (about 1.85 ms of a 17 ms round at one request on the
H200, where the draft read features before every tree).

The target still knows nothing of drafts: a sink is a name a subscriber chose,
and the rows are keyed by request id and position, as held rows are.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from tandem.feature_ring import FeatureRing
from tandem.tensors import array_to_proto, dtype_name, tensor_to_proto
from tandem.v1 import target_pb2
from target_service.step_batch import StepBatch, StepResults

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedRows:
    """The features of positions start .. start + len(rows) - 1 of one sequence, on the host, and
    where known the token at each position + 1 (-1 where the step did not decide it)."""

    request_id: str
    start: int
    rows: torch.Tensor
    next_tokens: np.ndarray | None = None  # int32 [len(rows)]


def split_features(results: StepResults) -> tuple[StepResults, list[tuple[int, CommittedRows]]]:
    """The results without their features, and (item index, rows) of every item that asked."""
    counts = results.feature_counts
    if results.features is None or counts is None:
        return results, []
    host = results.features.cpu()  # one tensor for the step (the engine's own, on the host); rows are views of it
    ends = np.cumsum(counts)
    found = []
    for b, rid in enumerate(results.request_ids):
        count = int(counts[b])
        if count:
            # The rows are the tokens this step committed: the last `count` positions. Views: pushed rows are
            # sent and dropped at once; whoever keeps rows for long copies them (TargetServicer._hold), so
            # that they do not keep the whole step's features alive. (A copy per item cost 0.3-0.6 ms a step
            # at 64 requests on the dev machine.)
            rows = host[int(ends[b]) - count: int(ends[b])]
            found.append((b, CommittedRows(rid, int(results.num_committed[b]) - count, rows)))
    return dataclasses.replace(results, features=None, feature_counts=None), found


def with_next_tokens(pushes: list[tuple[str, CommittedRows]], batch: StepBatch | None, results: StepResults
                     ) -> list[tuple[str, CommittedRows]]:
    """The pushes of a step (`batch`, whose items `results` answer in order) with the token after each row.
    Once the step's reply has left: at 64 requests the tokens cost a step 27 us (dev machine) before it,
    where a draft that does not catch up on pushes ignores them. Per row at position p, the token at p + 1:
    the item's fixed nodes after the first, then its new tokens (the accepted drafted ones and the bonus);
    the bonus only where the item's sample is its next token (a prompt chunk short of the prompt's end
    samples a token nobody keeps), else -1."""
    if not pushes or batch is None:
        return pushes
    item = dict(zip(results.request_ids, range(len(results.request_ids))))
    fixed, outputs, starts = batch.num_fixed.tolist(), batch.sample_is_output.tolist(), batch.starts
    out = []
    for sink, rows in pushes:
        b, count = item[rows.request_id], rows.rows.shape[0]
        new = results.new_tokens[b, : count - fixed[b] + 1]  # count = fixed nodes + accepted drafted ones
        if fixed[b] > 1 or not outputs[b]:  # a prompt chunk (a decode step's tokens are a view of the results)
            new = np.concatenate((batch.tokens[starts[b] + 1: starts[b] + fixed[b]], new)).astype(np.int32)
            if not outputs[b]:
                new[-1] = -1
        out.append((sink, CommittedRows(rows.request_id, rows.start, rows.rows, new)))
    return out


_END = None  # what a closed subscription's queue ends with


class Subscription:
    """One subscriber's pushed rows, a step's at a time: queued for the subscription's own thread
    (iterating yields them until it is closed), or, once deliver_directly() gave it a writer,
    written by the pushing thread itself."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue[list[CommittedRows] | None] = queue.SimpleQueue()
        self._write: Callable[[list[CommittedRows]], None] | None = None
        # A direct write and close() never overlap: once closed, the handler frees what a write uses (its ring).
        self._lock = threading.Lock()
        self.closed = False

    def put(self, batch: list[CommittedRows]) -> bool:
        """True when the rows were queued or written; False when closed, or when the direct write
        failed (the subscription is then closed: its reader is gone or stuck)."""
        with self._lock:
            if self.closed:
                return False
            if self._write is None:
                self._queue.put(batch)
                return True
            return self._write_or_close(batch)

    def deliver_directly(self, write: Callable[[list[CommittedRows]], None]) -> None:
        """From now on put() calls `write` on the pushing thread; rows queued before it are written
        first, in order."""
        with self._lock:
            while not self.closed:
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    self._write = write
                    return
                self._write = write
                self._write_or_close(batch)

    def _write_or_close(self, batch: list[CommittedRows]) -> bool:
        try:
            self._write(batch)
            return True
        except Exception as exc:
            log.warning("feature sink %s: a push could not be written (%s); the subscription ends and its rows "
                        "are held for a pull", self.name, exc)
            self._close()
            return False

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put(_END)

    def __iter__(self) -> Iterator[list[CommittedRows]]:
        while (batch := self._queue.get()) is not _END:
            yield batch


class FeatureSinks:
    """The live subscriptions by sink name. Thread-safe: the step thread pushes, the
    SubscribeFeatures handlers subscribe and leave."""

    def __init__(self) -> None:
        self._subs: dict[str, Subscription] = {}
        self._lock = threading.Lock()
        self._closed = False

    def subscribe(self, name: str) -> Subscription:
        """A new subscription under `name`; one already there (a reader that reconnected
        before its old stream was noticed gone) is closed."""
        sub = Subscription(name)
        with self._lock:
            old = self._subs.get(name)
            if self._closed:
                sub.close()
            else:
                self._subs[name] = sub
        if old is not None:
            old.close()
        return sub

    def subscribed(self, name: str) -> bool:
        with self._lock:
            sub = self._subs.get(name)
            return sub is not None and not sub.closed

    def leave(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            if self._subs.get(sub.name) is sub:
                del self._subs[sub.name]

    def push(self, name: str, batch: list[CommittedRows]) -> bool:
        """One step's rows to the subscriber `name`, queued or written; False when none is subscribed
        or they could not go (the caller then holds them for a pull)."""
        with self._lock:
            sub = self._subs.get(name)
        return sub is not None and sub.put(batch)  # outside the lock: a direct write may take a while

    def close_all(self) -> None:
        """End every subscription (the service is stopping: its streams must not hold the drain)."""
        with self._lock:
            self._closed = True
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.close()


def batch_to_proto(batch: list[CommittedRows], ring: FeatureRing | None) -> target_pb2.FeatureRows:
    """One step's rows for a batched subscriber: in its ring where there is one and they fit,
    else in the message."""
    msg = target_pb2.FeatureRows(
        request_ids=[rows.request_id for rows in batch],
        start_positions=array_to_proto(np.array([rows.start for rows in batch], dtype=np.int64)),
        row_counts=array_to_proto(np.array([rows.rows.shape[0] for rows in batch], dtype=np.int64)))
    if any(rows.next_tokens is not None for rows in batch):
        msg.next_tokens.CopyFrom(array_to_proto(np.concatenate([
            rows.next_tokens if rows.next_tokens is not None else np.full(rows.rows.shape[0], -1, dtype=np.int32)
            for rows in batch]).astype(np.int32)))
    parts = [rows.rows for rows in batch]
    start = ring.write(parts) if ring is not None else None
    if start is None:
        msg.features.CopyFrom(tensor_to_proto(parts[0] if len(parts) == 1 else torch.cat(parts)))
    else:
        shape = [sum(int(part.shape[0]) for part in parts), *parts[0].shape[1:]]
        msg.ring_rows.CopyFrom(target_pb2.RingRows(start=start, shape=shape,
                                                   dtype=dtype_name(parts[0].dtype)))
    return msg


def single_to_proto(rows: CommittedRows) -> target_pb2.FeatureRows:
    """One sequence's rows, for a subscriber that does not take batches."""
    return target_pb2.FeatureRows(request_id=rows.request_id, start_position=rows.start,
                                  features=tensor_to_proto(rows.rows))
