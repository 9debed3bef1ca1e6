"""Adapters from the engine's thread callbacks to the API layers' waiting styles.

The engine calls a request's sink from its own thread with each Delta. The
REST layer waits in asyncio, the gRPC layer in a server thread; both need the
same guarantee: a request the caller stops reading before it finished is
aborted in the engine, so its KV is freed at once rather than when it would
have finished on its own.

Submission happens when a stream is created, not on its first read, so that
InvalidArgument / ResourceExhausted / Unavailable surface before a response
has started (a 400/429/503 instead of a broken stream).

The words and the retry delay both edges answer with live here too, so that
REST and gRPC say the same.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from gateway.types import Delta, GenerationEngine, GenerationParams
from tandem.errors import Unavailable

NOT_READY_MESSAGE = "the engine is not ready (loading, draining, or waiting for an unreachable target)"
ABORTED_MESSAGE = "the server ended the request before it finished (it may be shutting down); retry"
RETRY_AFTER_S = 1  # what REST's 429 and 503, and gRPC's RESOURCE_EXHAUSTED, ask a client to wait before retrying


def aborted_error(delta: Delta) -> Unavailable | None:
    """What a client is told of a request the engine ended with "abort" (draining, or a target
    lost past --target-wait): UNAVAILABLE, with the engine's reason when it gave one. None for
    any other delta."""
    if delta.finish_reason != "abort":
        return None
    return Unavailable(delta.error or ABORTED_MESSAGE)


@dataclass(frozen=True)
class SubRequest:
    """One engine request: a choice of a REST response, or a gRPC call."""

    request_id: str
    prompt_token_ids: list[int]
    params: GenerationParams


class _Tracker:
    """Which sub-requests have finished; aborts the rest exactly once."""

    def __init__(self, engine: GenerationEngine, request_ids: Sequence[str]):
        self.engine = engine
        self.request_ids = list(request_ids)
        self.finished = [False] * len(request_ids)
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return all(self.finished)

    def mark(self, index: int, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self.finished[index] = True

    def abort_unfinished(self) -> None:
        with self._lock:
            pending = [i for i, f in enumerate(self.finished) if not f]
            for i in pending:
                self.finished[i] = True
        for i in pending:
            self.engine.abort(self.request_ids[i])


def _submit_all(engine: GenerationEngine, requests: Sequence[SubRequest], make_sink) -> None:
    """Submit every sub-request, or none: a refusal part-way aborts those already queued."""
    submitted: list[str] = []
    try:
        for index, req in enumerate(requests):
            engine.submit(req.request_id, list(req.prompt_token_ids), req.params, make_sink(index))
            submitted.append(req.request_id)
    except BaseException:
        for request_id in submitted:
            engine.abort(request_id)
        raise


class _LoopPost:
    """Hands (queue, item) pairs from other threads to one event loop, a wake-up for as many as
    arrive before the loop runs. The engine emits a step's deltas request by request: one
    call_soon_threadsafe each was a write to the loop's wake-up pipe and a wake-up of its thread
    per stream per step, each a bid for the GIL while the engine's step loop still runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, into: asyncio.Queue, item: object) -> None:
        """Queue `item` into `into` on the loop (RuntimeError once the loop is closed)."""
        with self._lock:
            self._pending.append((into, item))
            if len(self._pending) > 1:
                return  # a wake-up is already on its way and will take this one too
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._pending.clear()
            raise

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for into, item in pending:
            into.put_nowait(item)


_posts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPost] = weakref.WeakKeyDictionary()
_posts_lock = threading.Lock()


def _post_for(loop: asyncio.AbstractEventLoop) -> _LoopPost:
    with _posts_lock:
        post = _posts.get(loop)
        if post is None:
            post = _posts[loop] = _LoopPost(loop)
        return post


_POLL = object()  # queued by an AsyncDeltaStream's poll timer: get() returns None


class AsyncDeltaStream:
    """Deltas of one or more sub-requests as (index, Delta) pairs, for asyncio callers.

    Use as `async with AsyncDeltaStream(...) as s: while not s.done: item = await s.get()`.
    With `poll_s`, get() also returns None at least every poll_s seconds while nothing
    arrives (callers check on their client then). Leaving the block (normally, by exception
    or by cancellation) aborts every sub-request that has not finished.
    """

    def __init__(self, engine: GenerationEngine, requests: Sequence[SubRequest], poll_s: float | None = None):
        self._loop = asyncio.get_running_loop()
        self._post = _post_for(self._loop)
        self._queue: asyncio.Queue[tuple[int, Delta] | object] = asyncio.Queue()
        self._tracker = _Tracker(engine, [req.request_id for req in requests])
        # One timer a stream every poll_s, not a timeout on every get: a timeout is a timer armed
        # and cancelled for every chunk of every stream (BENCHMARKS.md, "The REST layer's cost").
        # It starts with the first get (a stream nobody reads keeps none) and ends with close().
        self._poll_s = poll_s
        self._poll_timer: asyncio.TimerHandle | None = None
        self._closed = False
        _submit_all(engine, requests, self._sink)

    def _sink(self, index: int):
        def put(delta: Delta) -> None:
            try:
                self._post.put(self._queue, (index, delta))
            except RuntimeError:
                pass  # the event loop is closed: nobody is listening any more

        return put

    def _poll(self) -> None:
        if self._closed:
            return
        if self._queue.empty():
            self._queue.put_nowait(_POLL)
        self._poll_timer = self._loop.call_later(self._poll_s, self._poll)

    @property
    def done(self) -> bool:
        """True once every sub-request has delivered its final delta (or was aborted)."""
        return self._tracker.done and self._queue.empty()

    async def get(self) -> tuple[int, Delta] | None:
        """The next (index, delta); None when the poll timer fired first."""
        if self._poll_timer is None and self._poll_s is not None and not self._closed:
            self._poll_timer = self._loop.call_later(self._poll_s, self._poll)
        item = self._queue.get_nowait() if not self._queue.empty() else await self._queue.get()
        if item is _POLL:
            return None
        self._tracker.mark(*item)
        return item

    def get_ready(self) -> tuple[int, Delta] | None:
        """The next (index, delta) if one is waiting, else None; never blocks."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not _POLL:
                self._tracker.mark(*item)
                return item
        return None

    def close(self) -> None:
        """Abort whatever has not finished, and stop the poll timer; idempotent."""
        self._closed = True
        if self._poll_timer is not None:
            self._poll_timer.cancel()
        self._tracker.abort_unfinished()

    async def __aenter__(self) -> AsyncDeltaStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def stream_deltas(engine: GenerationEngine, request_id: str, prompt_ids: list[int],
                        params: GenerationParams) -> AsyncIterator[Delta]:
    """Yield one request's deltas until its final one; abort it if the caller stops early.

    Submission happens on the first `__anext__`. Callers that must see submission
    errors before committing to a response use AsyncDeltaStream directly.
    """
    async with AsyncDeltaStream(engine, [SubRequest(request_id, prompt_ids, params)]) as stream:
        while not stream.done:
            item = await stream.get()
            if item is not None:
                yield item[1]


_CANCELLED = object()


class BlockingDeltaStream:
    """One request's deltas for a thread that may block (a gRPC servicer).

    Submits on construction. Iterating yields Deltas until the final one.
    `cancel()` may be called from any thread (e.g. a gRPC termination callback):
    it aborts the request and wakes the iterating thread, which then stops.
    """

    def __init__(self, engine: GenerationEngine, request: SubRequest):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._tracker = _Tracker(engine, [request.request_id])
        self.cancelled = False
        _submit_all(engine, [request], lambda _index: self._queue.put)

    def cancel(self) -> None:
        self.cancelled = True
        self._tracker.abort_unfinished()
        self._queue.put(_CANCELLED)

    def __iter__(self) -> Iterator[Delta]:
        try:
            while not self._tracker.done:
                delta = self._queue.get()
                if delta is _CANCELLED:
                    return
                self._tracker.mark(0, delta)
                yield delta
        finally:
            # The consumer stopped early (generator closed, or an exception).
            self._tracker.abort_unfinished()


def iter_deltas(engine: GenerationEngine, request_id: str, prompt_ids: list[int],
                params: GenerationParams) -> BlockingDeltaStream:
    """Blocking counterpart of stream_deltas; submits now, so errors raise here."""
    return BlockingDeltaStream(engine, SubRequest(request_id, prompt_ids, params))
