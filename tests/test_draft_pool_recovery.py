"""A draft replica that was lost comes back: the probe takes it back once the step loop has
detached its requests, releasing first what it may still hold of them (a replica lost to a
timeout or a network blip did not restart, and would otherwise keep their KV for ever).
Against real processes: tests/test_fault_draft.py."""

from __future__ import annotations

from gateway.draft_pool import DraftPool
from tandem.errors import Unavailable


class FakeClient:
    def __init__(self):
        self.address = "draft:1"
        self.up = True
        self.fail_releases = 0
        self.released: list[list[str]] = []

    def healthy(self) -> bool:
        return self.up

    def release(self, ids: list[str]) -> None:
        if self.fail_releases:
            self.fail_releases -= 1
            raise Unavailable("draft draft:1 failed: UNAVAILABLE")
        self.released.append(list(ids))

    def close(self) -> None:
        pass


def lost_replica_with(requests: set[str], back: list | None = None):
    client = FakeClient()
    pool = DraftPool([client], on_lost=lambda _replica: None, on_back=None if back is None else back.append)
    replica = pool.replicas[0]
    replica.healthy, replica.requests = True, set(requests)
    pool.mark_lost(replica, "deadline exceeded")
    return pool, replica, client


def test_a_returning_replica_releases_the_requests_it_held_when_lost_then_serves():
    pool, replica, client = lost_replica_with({"a", "b"})
    try:
        pool.probe_once()
        assert not replica.healthy and client.released == []  # its requests are not detached yet
        replica.requests.clear()  # the step loop detaches them (they decode plainly meanwhile)
        pool.probe_once()
        assert replica.healthy and client.released == [["a", "b"]] and replica.orphans == set()
    finally:
        pool.stop()


def test_a_replica_whose_release_fails_stays_out_until_it_succeeds():
    pool, replica, client = lost_replica_with({"a"})
    try:
        replica.requests.clear()
        client.fail_releases = 1
        pool.probe_once()
        assert not replica.healthy and replica.orphans == {"a"}
        pool.probe_once()
        assert replica.healthy and client.released == [["a"]]
    finally:
        pool.stop()


def test_a_replica_lost_with_no_requests_comes_back_without_a_release():
    pool, replica, client = lost_replica_with(set())
    try:
        client.up = False
        pool.probe_once()
        assert not replica.healthy
        client.up = True
        pool.probe_once()
        assert replica.healthy and client.released == []
    finally:
        pool.stop()


def test_a_replica_back_from_a_loss_is_announced_once_its_orphans_are_released():
    """The core refreshes the draft KV gauge then (the last requests may have ended while it was away)."""
    back: list = []
    pool, replica, client = lost_replica_with({"a"}, back)
    try:
        pool.probe_once()
        assert back == []  # its request is not detached yet
        replica.requests.clear()
        client.fail_releases = 1
        pool.probe_once()
        assert back == []  # the release failed: not back
        pool.probe_once()
        assert back == [replica] and replica.healthy
        pool.probe_once()
        assert back == [replica]  # healthy replicas are not probed again
    finally:
        pool.stop()
