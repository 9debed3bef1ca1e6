"""Draft replicas as the gateway sees them: a FIFO worker per replica, health, failover, discovery.

Every call to one replica goes through its single worker thread, so an ingest
queued without waiting (feature traffic off the critical path) is always
applied before a later draft call to the same replica. Any failure marks the
replica unhealthy; its requests then decode plainly until they move to a
healthy replica, catching up there from their tokens. A lost replica is probed
and, once it answers again (restarted, or past a transient failure), used again
without a gateway restart; what it may still hold of the requests that left it
is released first, so its KV does not leak.

Replicas may come and go at run time (`follow`, fed by gateway/discovery.py).
The step loop keeps a request's replica as an index into `replicas`, so entries
are only ever appended, never removed or reordered: a replica whose address
disappears is *retired* (marked lost, so its requests move; its worker stops and
its channel closes; it is never probed back), and an address that appears, or
comes back after retirement, gets a new entry that joins once its health check
passes and, where an admission check is set, once that check accepts it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from gateway.clients import DraftClient
from tandem.errors import Unavailable
from tandem.telemetry import bind_context

log = logging.getLogger("tandem.gateway")

# Says why a replica must not join (e.g. it serves other feature layers), or None to admit it.
AdmissionCheck = Callable[[DraftClient], "str | None"]


class DraftReplica:
    def __init__(self, index: int, client: DraftClient):
        self.index = index
        self.client = client
        self.healthy = False
        self.retired = False  # its address left the source: never used again
        self.requests: set[str] = set()
        self.refused: str | None = None  # the admission check's last objection (logged once)
        # Requests it held when it was lost: they leave without a release (it did not answer),
        # so if it comes back without having restarted, their state is released then.
        self.orphans: set[str] = set()
        self._jobs: queue.Queue[tuple[Callable, Future] | None] = queue.Queue()
        self._queued = 0  # jobs submitted and not yet done
        self._client_busy = threading.Lock()  # held while a job or an inline call uses the client
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=f"draft-{index}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            outcome = None
            if fut.set_running_or_notify_cancel():
                with self._client_busy:
                    outcome = _outcome(fn)
            with self._lock:  # before the caller hears of it: its next call then finds the replica idle
                self._queued -= 1
            if outcome is not None:
                _settle(fut, outcome)
        with self._client_busy:  # and after an inline call that is still running
            self.client.close()  # after every job queued before close() has run

    def submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                # A caller that raced the retirement gets an ordinary replica failure.
                fut.set_exception(Unavailable(f"draft {self.client.address} was retired"))
                return fut
            self._queued += 1
            self._jobs.put((bind_context(fn), fut))  # the worker runs fn in the caller's trace context
        return fut

    def call(self, fn: Callable) -> Future:
        """fn's outcome, run on the caller's thread when no job of this replica is queued or
        running (so the FIFO order holds), else queued as `submit` does. A round's draft call
        then skips two hand-overs between threads, which cost about 0.1 ms each way on the
        H200's host (BENCHMARKS.md, "A round hop by hop")."""
        with self._lock:
            idle = not self._closed and self._queued == 0
        if not idle:
            return self.submit(fn)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._client_busy:  # a job submitted since by another thread waits for this call
            _settle(fut, _outcome(fn))
        return fut

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)


def _outcome(fn: Callable) -> tuple[object, Exception | None]:
    """fn's result, or the exception it raised."""
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def _settle(fut: Future, outcome: tuple[object, Exception | None]) -> None:
    result, exc = outcome
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def feature_layers_match(expected: Callable[[], tuple[int, ...]]) -> AdmissionCheck:
    """Admit a replica only if it asks the target for the feature layers the gateway requests.

    The gateway asks the target for one set of layers per step (core.start takes
    them from the replicas present at start); a replica with another checkpoint
    would draft from the wrong features.
    """
    def check(client: DraftClient) -> str | None:
        layers = client.info().feature_layers
        want = expected()
        return None if layers == want else f"it uses target feature layers {list(layers)}, the gateway {list(want)}"

    return check


class DraftPool:
    def __init__(self, clients: list[DraftClient], on_lost: Callable[[DraftReplica], None],
                 make_client: Callable[[str], DraftClient] = DraftClient,
                 on_back: Callable[[DraftReplica], None] | None = None):
        self.replicas = [DraftReplica(i, c) for i, c in enumerate(clients)]
        self.on_lost = on_lost
        # Called once a replica is healthy again (or, new, for the first time), after its orphans' release.
        self.on_back = on_back
        self.admission: AdmissionCheck | None = None
        self.make_client = make_client
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._follower: threading.Thread | None = None

    def healthy(self) -> list[DraftReplica]:
        return [replica for replica in self.replicas if replica.healthy]

    def least_loaded(self) -> DraftReplica | None:
        live = self.healthy()
        return min(live, key=lambda replica: len(replica.requests)) if live else None

    def mark_lost(self, replica: DraftReplica, why: str) -> None:
        with self._lock:
            if not replica.healthy:
                return
            replica.healthy = False
            replica.orphans |= replica.requests.copy()  # copy(): one step under the GIL, while the loop edits it
        log.warning("draft replica %s lost (%s): its requests continue without speculation",
                    replica.client.address, why)
        self.on_lost(replica)

    def probe_forever(self, interval: float = 1.0) -> None:
        """Background: bring replicas back (or in, when new) when their health check passes."""
        while not self._stop.wait(interval):
            self.probe_once()

    def probe_once(self) -> None:
        for replica in list(self.replicas):
            # The step loop detaches a lost replica's requests first; only then can it
            # come back (it may have restarted and forgotten them).
            if not replica.healthy and not replica.retired and not replica.requests:
                self._probe(replica)

    def _probe(self, replica: DraftReplica) -> None:
        try:
            ready = replica.client.healthy() and self._admits(replica)
        except Exception as exc:  # e.g. its channel closed by a retirement that raced us
            log.debug("probing draft replica %s failed: %s", replica.client.address, exc)
            return
        if not ready or not self._release_orphans(replica):
            return
        with self._lock:
            if replica.retired:  # retired while we probed it
                return
            replica.healthy = True
        log.info("draft replica %s is healthy", replica.client.address)
        if self.on_back is not None:
            self.on_back(replica)

    @staticmethod
    def _release_orphans(replica: DraftReplica) -> bool:
        """Release what a returning replica may hold of the requests it had when it was lost
        (nothing, if it restarted). Through its worker, after any call still queued from
        before the loss. False: it failed, so the replica is not ready yet."""
        if not replica.orphans:
            return True
        orphans = sorted(replica.orphans)
        try:
            replica.submit(lambda: replica.client.release(orphans)).result(timeout=60)
        except Exception as exc:
            log.debug("releasing the lost requests on draft replica %s failed: %s", replica.client.address, exc)
            return False
        replica.orphans.difference_update(orphans)
        return True

    def _admits(self, replica: DraftReplica) -> bool:
        if self.admission is None:
            return True
        try:
            why = self.admission(replica.client)
        except Exception as exc:  # a replica that cannot answer is not ready yet
            why = f"its admission check failed: {exc}"
        if why is not None and why != replica.refused:
            log.warning("draft replica %s not admitted: %s", replica.client.address, why)
        replica.refused = why
        return why is None

    # --- discovery -------------------------------------------------------------------------
    def reconcile(self, addresses: Iterable[str]) -> None:
        """Make the pool's live replicas those at `addresses`: append new ones, retire missing ones."""
        wanted = set(addresses)
        leaving = []
        with self._lock:
            live = {replica.client.address for replica in self.replicas if not replica.retired}
            for address in sorted(wanted - live):
                self.replicas.append(DraftReplica(len(self.replicas), self.make_client(address)))
                log.info("draft replica %s found: it joins once its health check passes", address)
            for replica in self.replicas:
                if not replica.retired and replica.client.address not in wanted:
                    replica.retired = True
                    leaving.append(replica)
        for replica in leaving:
            log.info("draft replica %s is gone from the source: retiring it", replica.client.address)
            self.mark_lost(replica, "gone from the draft source")  # its requests move to a live replica
            replica.close()

    def follow(self, resolve: Callable[[], Iterable[str] | None], interval_s: float) -> None:
        """Background: every interval_s, reconcile with what `resolve` answers (None: no change)."""
        if self._follower is not None:
            raise RuntimeError("the pool already follows a source")

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    found = resolve()
                except Exception:  # a resolver bug must not end discovery
                    log.exception("resolving the draft replicas failed")
                    continue
                if found is not None:
                    self.reconcile(found)

        self._follower = threading.Thread(target=loop, name="draft-discovery", daemon=True)
        self._follower.start()

    def stop(self) -> None:
        self._stop.set()
        if self._follower is not None:
            self._follower.join(timeout=5)
        for replica in self.replicas:
            replica.close()
