"""A round's draft call to one replica runs on the step loop's thread when nothing is queued for
that replica, and waits behind queued jobs otherwise, so a replica still applies its calls in
the order they were made (an ingest queued without waiting comes before the next draft call)."""

from __future__ import annotations

import threading

import pytest

from gateway.draft_pool import DraftReplica
from tandem.errors import Unavailable


class FakeClient:
    address = "draft:1"

    def close(self) -> None:
        pass


def test_a_call_with_nothing_queued_runs_on_the_callers_thread():
    replica = DraftReplica(0, FakeClient())
    try:
        fut = replica.call(threading.get_ident)
        assert fut.done() and fut.result() == threading.get_ident()
        with pytest.raises(ValueError, match="refused"):
            replica.call(lambda: (_ for _ in ()).throw(ValueError("refused"))).result()
    finally:
        replica.close()


def test_a_call_behind_a_queued_job_waits_for_it_on_the_replicas_worker():
    replica = DraftReplica(0, FakeClient())
    order: list[str] = []
    release = threading.Event()
    try:
        replica.submit(lambda: (release.wait(5), order.append("ingest")))
        fut = replica.call(lambda: (order.append("draft"), threading.get_ident())[1])
        assert not fut.done()  # queued behind the ingest, not run here
        release.set()
        assert fut.result(timeout=5) != threading.get_ident()
        assert order == ["ingest", "draft"]
        assert replica.call(threading.get_ident).result() == threading.get_ident()  # idle again: inline
    finally:
        release.set()
        replica.close()


def test_a_call_to_a_retired_replica_fails_as_a_replica_failure():
    replica = DraftReplica(0, FakeClient())
    replica.close()
    with pytest.raises(Unavailable, match="retired"):
        replica.call(lambda: None).result()
