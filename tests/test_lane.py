"""The same-host step lane (tandem/lane.py): a stream handler served on a Unix socket, as gRPC would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest

from tandem.lane import LaneError, LaneMethod, LaneRefused, LaneServer, LaneStream, direct_sender
from tandem.v1 import target_pb2


class Echo:
    """A StepStream-shaped handler: one reply per call, its step_index the call's grant_steps; a call
    of grant_steps 99 aborts with INVALID_ARGUMENT. It notes what ran after each reply left."""

    def __init__(self):
        self.after_reply: list[int] = []
        self.closed = threading.Event()

    def __call__(self, calls, context):
        try:
            for call in calls:
                steps = call.step.grant_steps
                if steps == 99:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grant_steps 99 is refused")
                yield target_pb2.StepReply(step_index=steps, done=True)
                self.after_reply.append(steps)
        finally:
            self.closed.set()


def call(steps: int) -> target_pb2.StepCall:
    return target_pb2.StepCall(step=target_pb2.PackedStep(grant_steps=steps))


@pytest.fixture
def lane(tmp_path):
    handler = Echo()
    server = LaneServer(tmp_path / "lane" / "target.sock", {"StepStream": LaneMethod(handler, target_pb2.StepCall)})
    server.start()
    server.handler = handler
    yield server
    server.stop()


def open_stream(lane: LaneServer, token: str | None = None, method: str = "StepStream") -> LaneStream:
    return LaneStream(lane.path, token or lane.token, method, target_pb2.StepReply)


def test_calls_and_replies_travel_in_order_and_the_handler_resumes_after_each_reply_left(lane):
    stream = open_stream(lane)
    for steps in (1, 7, 3):
        stream.send(call(steps))
        assert stream.reply().step_index == steps
    assert lane.handler.after_reply[:2] == [1, 7]
    stream.close()
    assert lane.handler.closed.wait(5)


def test_an_abort_reaches_the_client_as_its_grpc_status_and_ends_the_stream(lane):
    stream = open_stream(lane)
    stream.send(call(99))
    with pytest.raises(LaneError) as err:
        stream.reply()
    assert isinstance(err.value, grpc.RpcError)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == "grant_steps 99 is refused"
    stream.send(call(1))  # the stream ended: a later call finds it so, never a stale reply
    with pytest.raises((StopIteration, LaneError)):
        stream.reply()


def test_a_wrong_token_an_unknown_stream_or_no_socket_is_refused(lane, tmp_path):
    with pytest.raises(LaneRefused, match="wrong lane token"):
        open_stream(lane, token="0" * 32)
    with pytest.raises(LaneRefused, match="no lane for 'DraftStream'"):
        open_stream(lane, method="DraftStream")
    with pytest.raises(LaneRefused):
        LaneStream(str(tmp_path / "nothing.sock"), lane.token, "StepStream", target_pb2.StepReply)
    assert open_stream(lane) is not None  # the refusals left the lane serving


def test_cancel_from_another_thread_ends_a_waiting_reply_as_cancelled(lane):
    stream = open_stream(lane)
    threading.Timer(0.2, stream.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(LaneError) as err:
        stream.reply()  # nothing was sent: only the cancel ends the wait
    assert err.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - t0 < 5


def test_a_stopped_service_ends_its_streams_and_takes_no_new_one(lane):
    stream = open_stream(lane)
    stream.send(call(2))
    assert stream.reply().step_index == 2
    lane.stop()
    with pytest.raises(StopIteration):
        stream.reply()
    with pytest.raises(LaneRefused):
        open_stream(lane)


def test_a_client_gone_mid_stream_closes_the_handler(lane):
    stream = open_stream(lane)
    stream.send(call(4))
    stream.reply()
    stream.close()
    assert lane.handler.closed.wait(5)


def test_a_server_stream_learns_through_its_callback_that_its_client_left(tmp_path):
    """SubscribeFeatures' shape: one request, replies as work comes, a callback that ends the wait."""
    left = threading.Event()

    def subscribe(request, context):
        context.add_callback(left.set)
        yield target_pb2.FeatureRows(ring_attached=request.batched)
        left.wait(10)  # as a subscription waits for the next step's rows

    server = LaneServer(tmp_path / "target.sock", {
        "SubscribeFeatures": LaneMethod(subscribe, target_pb2.SubscribeFeaturesRequest, unary=True)})
    server.start()
    try:
        stream = LaneStream(server.path, server.token, "SubscribeFeatures", target_pb2.FeatureRows)
        stream.send(target_pb2.SubscribeFeaturesRequest(sink="draft-1", batched=True))
        assert next(iter(stream)).ring_attached
        stream.close()
        assert left.wait(5)
    finally:
        server.stop()


@contextmanager
def direct_stream(tmp_path, first: target_pb2.FeatureRows) -> Iterator[tuple[LaneStream, Callable, threading.Event]]:
    """A SubscribeFeatures-shaped server stream on a lane, its client subscribed and its first reply
    (`first`) read: (the client's stream, the handler's direct sender, set once the stream ended)."""
    senders, left = [], threading.Event()

    def subscribe(request, context):
        context.add_callback(left.set)
        yield first
        senders.append(direct_sender(context))
        left.wait(10)

    server = LaneServer(tmp_path / "target.sock", {
        "SubscribeFeatures": LaneMethod(subscribe, target_pb2.SubscribeFeaturesRequest, unary=True)})
    server.start()
    try:
        stream = LaneStream(server.path, server.token, "SubscribeFeatures", target_pb2.FeatureRows)
        stream.send(target_pb2.SubscribeFeaturesRequest(sink="draft-1", batched=True))
        assert stream.reply() == first
        while not senders:
            time.sleep(0.01)
        yield stream, senders[0], left
    finally:
        server.stop()


def test_a_server_stream_on_a_lane_can_send_from_another_thread_after_its_first_reply(tmp_path):
    """How the target's step thread writes a feature push itself: the replies arrive whole and in order."""
    with direct_stream(tmp_path, target_pb2.FeatureRows(request_id="first")) as (stream, send, left):
        pushers = [threading.Thread(target=lambda i=i: [send(target_pb2.FeatureRows(
            request_id=f"{i}-{n}", request_ids=["x" * 1000] * 50), 5.0) for n in range(20)]) for i in range(3)]
        for pusher in pushers:
            pusher.start()
        got = [stream.reply().request_id for _ in range(60)]  # read as they write: 3 MB fill any socket buffer
        for pusher in pushers:
            pusher.join()
        for i in range(3):  # each thread's own order holds; whole frames only (a torn one would not parse)
            assert [name for name in got if name.startswith(f"{i}-")] == [f"{i}-{n}" for n in range(20)]
        stream.close()
        assert left.wait(5)


def test_a_send_to_a_client_that_stopped_reading_gives_up_and_ends_the_stream(tmp_path):
    """A stuck draft must not stall the target: once the socket's buffer stays full past the timeout the
    send raises, and the stream's end callbacks run."""
    with direct_stream(tmp_path, target_pb2.FeatureRows()) as (stream, send, left):
        big = target_pb2.FeatureRows(request_ids=["x" * 4096] * 64)  # about 260 kB: no socket buffer takes many
        t0 = time.monotonic()
        with pytest.raises(LaneError) as failed:
            for _ in range(1000):
                send(big, 0.3)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 5
        assert left.wait(5)
        with pytest.raises(LaneError):  # and nothing more is written on it
            send(target_pb2.FeatureRows(), 0.3)
        stream.close()


def test_a_grpc_context_offers_no_direct_sender():
    assert direct_sender(object()) is None


def test_spinning_reads_bring_the_same_frames_whether_they_come_within_the_spin_after_it_or_in_pieces():
    import socket

    from tandem.lane import MESSAGE, read_frame, write_frame

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        write_frame(theirs, MESSAGE, b"ready")  # there before the read: the first poll takes it
        assert read_frame(ours, spin_s=0.05) == (MESSAGE, b"ready")
        # The header in two pieces, the second after the spin gave up: the read blocks for the rest.
        header_and_payload = b"\x01" + (6).to_bytes(4, "little") + b"pieces"
        theirs.sendall(header_and_payload[:2])
        later = threading.Timer(0.05, lambda: theirs.sendall(header_and_payload[2:]))
        later.start()
        assert read_frame(ours, spin_s=0.001) == (MESSAGE, b"pieces")
        # Nothing within the spin: it blocks, and takes the frame sent later.
        later = threading.Timer(0.05, lambda: write_frame(theirs, MESSAGE, b"late"))
        later.start()
        assert read_frame(ours, spin_s=0.001) == (MESSAGE, b"late")
        theirs.shutdown(socket.SHUT_WR)
        assert read_frame(ours, spin_s=0.05) is None  # the end of the stream, seen while polling


def test_a_spinning_lane_serves_calls_and_a_cancel_still_ends_a_waiting_reply(lane, monkeypatch):
    from tandem import lane as lane_module

    spun = []
    spin_read = lane_module._spin_read
    monkeypatch.setattr(lane_module, "_spin_read", lambda *args: spun.append(args[2]) or spin_read(*args))
    monkeypatch.setenv("TANDEM_LANE_SPIN_US", "200000")  # polls longer than the cancel below takes to come
    lane.spin_s = 0.2
    stream = open_stream(lane)
    for steps in (2, 5):
        stream.send(call(steps))
        assert stream.reply().step_index == steps
    assert spun.count(0.2) >= 4  # both ends polled: the server for each call, the client for each reply
    threading.Timer(0.05, stream.cancel).start()
    with pytest.raises(LaneError) as err:
        stream.reply()
    assert err.value.code() == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("raw,seconds", [("", 0.0), ("250", 0.00025), ("0", 0.0), ("-5", 0.0), ("lots", 0.0),
                                         ("2e6", 0.0)])
def test_the_spin_comes_from_the_environment_and_a_bad_value_means_none(monkeypatch, caplog, raw, seconds):
    from tandem.lane import spin_from_env

    monkeypatch.setenv("TANDEM_LANE_SPIN_US", raw)
    assert spin_from_env() == pytest.approx(seconds)
    assert ("TANDEM_LANE_SPIN_US" in caplog.text) == (raw in ("-5", "lots", "2e6"))
