"""Draft replicas as the gateway sees them: a FIFO worker per replica, health, failover.

Every call to one replica goes through its single worker thread, so an ingest
queued without waiting (feature traffic off the critical path) is always
applied before a later draft call to the same replica. Any failure marks the
replica unhealthy; its requests then decode plainly until they move to a
healthy replica, catching up there from their tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from gateway.clients import DraftClient
from tandem.telemetry import bind_context

log = logging.getLogger("tandem.gateway")


class DraftReplica:
    def __init__(self, index: int, client: DraftClient):
        self.index = index
        self.client = client
        self.healthy = False
        self.requests: set[str] = set()
        self._jobs: queue.Queue[tuple[Callable, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"draft-{index}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        self._jobs.put((bind_context(fn), fut))  # the worker runs fn in the caller's trace context
        return fut

    def close(self) -> None:
        self._jobs.put(None)
        self.client.close()


class DraftPool:
    def __init__(self, clients: list[DraftClient], on_lost: Callable[[DraftReplica], None]):
        self.replicas = [DraftReplica(i, c) for i, c in enumerate(clients)]
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def healthy(self) -> list[DraftReplica]:
        return [r for r in self.replicas if r.healthy]

    def least_loaded(self) -> DraftReplica | None:
        live = self.healthy()
        return min(live, key=lambda r: len(r.requests)) if live else None

    def mark_lost(self, replica: DraftReplica, why: str) -> None:
        with self._lock:
            if not replica.healthy:
                return
            replica.healthy = False
        log.warning("draft replica %s lost (%s): its requests continue without speculation",
                    replica.client.address, why)
        self.on_lost(replica)

    def probe_forever(self, interval: float = 1.0) -> None:
        """Background: bring replicas back when their health check passes."""
        while not self._stop.wait(interval):
            for r in self.replicas:
                # The step loop detaches a lost replica's requests first; only then can it
                # come back (it may have restarted and forgotten them).
                if not r.healthy and not r.requests and r.client.healthy():
                    r.healthy = True
                    log.info("draft replica %s is healthy", r.client.address)

    def stop(self) -> None:
        self._stop.set()
        for r in self.replicas:
            r.close()
