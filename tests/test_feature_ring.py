"""The shared-memory ring for pushed features: what the writer puts in, the reader gets back,
unless the writer has lapped it; only a ring's own name opens; nothing is left under /dev/shm."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from draft_service.target_features import TargetFeatureReader
from tandem.feature_ring import HEADER_BYTES, RING_DIR, FeatureRing, RingUnavailable
from tandem.lane import LaneMethod, LaneServer, LaneStream
from tandem.tensors import array_to_proto
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.feature_sinks import CommittedRows
from target_service.server import TargetServicer

pytestmark = pytest.mark.skipif(not RING_DIR.is_dir(), reason="no /dev/shm on this machine: rings are never made here")


def rows(start: int, n: int, width: int = 8) -> torch.Tensor:
    """bf16 rows whose values say their position (exact up to 256)."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, width).to(torch.bfloat16)


@pytest.fixture
def ring_pair():
    reader = FeatureRing.create(1024)
    writer = FeatureRing.attach(reader.name, reader.data_bytes)
    reader.unlink()
    yield reader, writer
    writer.close()
    reader.close()


def test_batches_come_back_as_written_and_one_that_would_run_past_the_end_starts_at_the_front(ring_pair):
    reader, writer = ring_pair
    at = []
    for step in range(11):  # 3 x 8 bf16 = 48 bytes a part, 96 a batch: 1024 bytes hold ten
        batch = [rows(10 * step, 3), rows(10 * step + 3, 3)]
        at.append((writer.write(batch), torch.cat(batch)))
    assert at[-2][0] == 864 and at[-1][0] == 1024  # the eleventh would run past the end: it starts at the front
    for start, want in at[-2:]:
        assert torch.equal(reader.read(start, tuple(want.shape), torch.bfloat16), want)


def test_a_batch_the_writer_may_have_overwritten_is_not_read(ring_pair):
    reader, writer = ring_pair
    first = writer.write([rows(0, 4)])  # 64 bytes
    assert reader.read(first, (4, 8), torch.bfloat16) is not None
    for step in range(1, 16):  # 15 x 64 = 960 more bytes: still within one ring's length of the first
        writer.write([rows(step, 4)])
    assert reader.read(first, (4, 8), torch.bfloat16) is not None
    writer.write([rows(99, 4)])  # the 17th batch lands on the first's bytes
    assert reader.read(first, (4, 8), torch.bfloat16) is None


def test_a_batch_larger_than_the_ring_is_refused_by_the_writer(ring_pair):
    _, writer = ring_pair
    assert writer.write([rows(0, 65)]) is None  # 1040 bytes


def test_only_a_rings_own_name_and_size_open():
    ring = FeatureRing.create(4096)
    try:
        for name in ("../../etc/passwd", "tandem-features-xyz", ring.name + "0"):
            with pytest.raises(RingUnavailable):
                FeatureRing.attach(name, 4096)
        with pytest.raises(RingUnavailable, match="holds"):
            FeatureRing.attach(ring.name, 8192)
        assert (RING_DIR / ring.name).stat().st_size == HEADER_BYTES + 4096
        assert (RING_DIR / ring.name).stat().st_mode & 0o777 == 0o600
    finally:
        ring.close()
    assert not (RING_DIR / ring.name).exists()
    with pytest.raises(RingUnavailable):
        FeatureRing.attach(ring.name, 4096)


# --- through the target's subscription stream ------------------------------------------------------


@pytest.fixture
def target():
    """The target's servicer alone, in process: SubscribeFeatures needs no model."""
    servicer = TargetServicer(Path("."))
    server = grpc.server(futures.ThreadPoolExecutor(4))
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.feature_sinks.close_all()
    server.stop(0)


def _until(condition) -> None:
    import time
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("ring_bytes", [1 << 20, 2048, 0])
def test_a_steps_rows_reach_the_draft_in_one_message_through_the_ring_or_the_stream(target, ring_bytes):
    """2048 bytes: the ring is attached, but the second step's batch (3200 bytes) does not fit and comes
    in the message."""
    servicer, address = target
    reader = TargetFeatureReader(address, ring_bytes=ring_bytes)
    try:
        _until(lambda: reader.live)
        assert (reader.ring is not None) == (ring_bytes > 0)
        # The file went as the target answered. (Its own file: another test's draft, or one a killed
        # process left, may have one of its own there.)
        assert reader.ring is None or not (RING_DIR / reader.ring.name).exists()
        from_ring = []
        if reader.ring is not None:
            read = reader.ring.read
            reader.ring.read = lambda *args: from_ring.append(args[1]) or read(*args)
        for step, sizes in enumerate(([2, 1, 3], [70, 50, 80])):
            batch = [CommittedRows(f"r{i}", 10 * step, rows(10 * step + i, n)) for i, n in enumerate(sizes)]
            assert servicer.feature_sinks.push(reader.sink, batch)
            for i, n in enumerate(sizes):
                assert reader.pushed.wait_for(f"r{i}", 10 * step + n, timeout=30)
                start, got = reader.pushed.read(f"r{i}", 10 * step, 10 * step + n)
                assert start == 10 * step and torch.equal(got, rows(10 * step + i, n)), (step, i)
        assert from_ring == {1 << 20: [(6, 8), (200, 8)], 2048: [(6, 8)], 0: []}[ring_bytes]
    finally:
        reader.close()
    assert reader.ring is None


def test_a_draft_leaves_its_grpc_subscription_for_the_step_lane_the_target_offers_and_gets_its_rows_there(
        target, tmp_path):
    servicer, address = target
    servicer.step_lane = LaneServer(tmp_path / "target.sock", {"SubscribeFeatures": LaneMethod(
        servicer.SubscribeFeatures, target_pb2.SubscribeFeaturesRequest, unary=True)})
    servicer.step_lane.start()
    reader = TargetFeatureReader(address, ring_bytes=1 << 20)
    try:
        _until(lambda: reader.live and isinstance(reader._call, LaneStream))
        assert reader.ring is not None  # a new ring for the lane's subscription, attached by the target
        for step in range(3):
            batch = [CommittedRows("r", 4 * step, rows(4 * step, 4))]
            _until(lambda batch=batch: servicer.feature_sinks.push(reader.sink, batch))
            assert reader.pushed.wait_for("r", 4 * step + 4, timeout=30)
            assert torch.equal(reader.pushed.read("r", 4 * step, 4 * step + 4)[1], rows(4 * step, 4))
    finally:
        reader.close()
        servicer.step_lane.stop()


def test_a_subscriber_that_asks_for_no_batches_gets_a_message_per_sequence_as_before(target):
    servicer, address = target
    channel = grpc.insecure_channel(address)
    call = target_pb2_grpc.TargetServiceStub(channel).SubscribeFeatures(target_pb2.SubscribeFeaturesRequest(sink="old"))
    messages = iter(call)
    first = next(messages)
    assert not first.request_id and not first.request_ids and not first.ring_attached
    assert servicer.feature_sinks.push("old", [CommittedRows("a", 3, rows(3, 2)), CommittedRows("b", 0, rows(0, 1))])
    got = [next(messages), next(messages)]
    assert [(m.request_id, m.start_position, list(m.features.shape)) for m in got] == [("a", 3, [2, 8]),
                                                                                        ("b", 0, [1, 8])]
    call.cancel()
    channel.close()


def test_a_batch_overwritten_before_the_draft_read_it_is_dropped_with_a_warning(caplog):
    """Its positions then go without the target's features (the engine's approximate catch-up)."""
    reader = TargetFeatureReader("127.0.0.1:1", subscribe=False)
    reader.ring = FeatureRing.create(1024)
    writer = FeatureRing.attach(reader.ring.name, 1024)
    try:
        start = writer.write([rows(0, 4)])
        for step in range(16):
            writer.write([rows(step, 4)])
        msg = target_pb2.FeatureRows(
            request_ids=["a"], start_positions=array_to_proto(np.array([0], dtype=np.int64)),
            row_counts=array_to_proto(np.array([4], dtype=np.int64)),
            ring_rows=target_pb2.RingRows(start=start, shape=[4, 8], dtype="bfloat16"))
        with caplog.at_level(logging.WARNING):
            reader._take_batch(msg)
        assert reader.pushed.read("a", 0, 4) == (0, None)
        assert "overwritten" in caplog.text
    finally:
        writer.close()
        reader.ring.close()
        reader.close()


def test_a_ring_is_offered_only_to_a_target_at_a_loopback_address():
    """A target elsewhere (another pod, another node) could not open it."""
    for address, offered in (("127.0.0.1:1", True), ("localhost:1", True), ("[::1]:1", True),
                             ("10.0.0.3:1", False), ("target:50052", False)):
        reader = TargetFeatureReader(address, subscribe=False, ring_bytes=4096)
        ring = reader._new_ring()
        assert (ring is not None) == offered, address
        if ring is not None:
            ring.close()
            assert not (RING_DIR / ring.name).exists()  # closing a ring never attached unlinks it
        reader.close()
