"""Feature rows per sequence and position, bounded: where features wait for their reader.

The target holds here the features of a step with hold_features until a draft
replica reads them (ReadFeatures); a draft replica keeps here the rows the
target pushed to it (SubscribeFeatures) until an ingest uses them. Neither
side learns anything of the other's model: rows are keyed by request id and
position, and a read frees what it has passed.

Rows are a cache: the store is bounded (max_rows in all), and when it is full
the sequences written longest ago lose their rows first. A reader then finds
fewer rows and computes those positions without target features (the draft's
approximate catch-up); output never depends on them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class _Held:
    start: int  # position of the first held row
    chunks: list[torch.Tensor] = field(default_factory=list)  # contiguous rows, in order
    rows: int = 0

    @property
    def end(self) -> int:
        return self.start + self.rows


class FeatureStore:
    """Held feature rows per sequence, each run contiguous in position. Thread-safe: a writer
    (the target's step thread, the draft's subscription thread) and readers (calls) may run at
    once, and a reader may wait for rows still on their way (wait_for)."""

    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"the feature store needs room for at least one row, got {max_rows}")
        self.max_rows = max_rows
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently written first
        self._rows = 0
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)

    @property
    def rows(self) -> int:
        return self._rows

    def hold(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """Keep `rows` ([n, F], host) as the features of positions start.., after what is held
        when contiguous with it, otherwise instead of it."""
        self.hold_many([(request_id, start, rows)])

    def hold_many(self, entries: list[tuple[str, int, torch.Tensor]]) -> None:
        """hold() for several sequences (a step's pushed rows) under one lock, waking waiters once."""
        with self._lock:
            for request_id, start, rows in entries:
                n = int(rows.shape[0])
                if n == 0:
                    continue
                held = self._held.pop(request_id, None)
                if held is None or held.end != start or (held.chunks and held.chunks[0].shape[1:] != rows.shape[1:]):
                    if held is not None:
                        self._rows -= held.rows
                    held = _Held(start)
                held.chunks.append(rows)
                held.rows += n
                self._rows += n
                self._held[request_id] = held
            self._evict()
            self._written.notify_all()

    def read(self, request_id: str, start: int, end: int) -> tuple[int, torch.Tensor | None]:
        """(first position, rows) of what is held in [start, end); frees the sequence's rows below end."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                return start, None
            lo, hi = max(start, held.start), min(end, held.end)
            found = None
            if lo < hi:
                every = held.chunks[0] if len(held.chunks) == 1 else torch.cat(held.chunks)
                found = every[lo - held.start: hi - held.start]
                held.chunks = [every]
            self._drop_below(request_id, held, end)
            return (lo if found is not None else start), found

    def wait_for(self, request_id: str, end: int, timeout: float) -> bool:
        """Wait until rows up to position `end` of the sequence are held (True), or `timeout`
        seconds have passed (False): for rows another thread is about to write."""
        deadline = time.monotonic() + timeout
        with self._written:
            while (held := self._held.get(request_id)) is None or held.end < end:
                left = deadline - time.monotonic()
                if left <= 0 or not self._written.wait(left):
                    return False
            return True

    def release(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                held = self._held.pop(rid, None)
                if held is not None:
                    self._rows -= held.rows

    def _drop_below(self, request_id: str, held: _Held, position: int) -> None:
        if position >= held.end:
            del self._held[request_id]
            self._rows -= held.rows
            return
        gone = position - held.start
        if gone > 0:
            every = held.chunks[0] if len(held.chunks) == 1 else torch.cat(held.chunks)
            held.chunks, held.start, held.rows = [every[gone:].clone()], position, held.rows - gone
            self._rows -= gone

    def _evict(self) -> None:
        while self._rows > self.max_rows and self._held:
            rid, held = next(iter(self._held.items()))
            if len(self._held) == 1:  # one sequence over the bound: keep its newest rows
                self._drop_below(rid, held, held.end - self.max_rows)
                return
            del self._held[rid]
            self._rows -= held.rows
