"""The C spin that lane reads wait in: it sees data, a timeout and a hang-up as a read would, it lets
the process's other threads run while it spins, and where it cannot be built the lanes' reads block
(polling from Python only when asked for)."""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time

import pytest

from tandem import lane, spin_wait


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(spin_wait.CACHE_ENV, str(tmp_path / "cache"))
    spin_wait.native_waiter.cache_clear()
    yield tmp_path / "cache"
    spin_wait.native_waiter.cache_clear()


def compiler_here() -> bool:
    return shutil.which("cc") is not None or shutil.which("gcc") is not None


def test_the_waiter_sees_data_a_timeout_and_a_hang_up(fresh_cache):
    waiter = spin_wait.native_waiter()
    if not compiler_here():
        assert waiter is None
        return
    assert waiter is not None and list(fresh_cache.glob("spin_wait-*.so"))
    ours, theirs = socket.socketpair()
    with ours, theirs:
        t0 = time.perf_counter()
        assert waiter(ours.fileno(), 0.03) == 0
        assert time.perf_counter() - t0 >= 0.03
        threading.Timer(0.02, lambda: theirs.sendall(b"x")).start()
        assert waiter(ours.fileno(), 2.0) == 1 and ours.recv(1) == b"x"
        theirs.shutdown(socket.SHUT_WR)
        assert waiter(ours.fileno(), 2.0) == 1 and ours.recv(1) == b""  # the read then sees the end


def test_the_process_runs_on_while_a_thread_spins(fresh_cache):
    waiter = spin_wait.native_waiter()
    if waiter is None:
        assert not compiler_here()
        return
    ours, theirs = socket.socketpair()
    with ours, theirs:
        spinning = threading.Thread(target=waiter, args=(ours.fileno(), 1.0))
        spinning.start()
        time.sleep(0.01)
        total = sum(range(200_000))  # Python work: needs the GIL, which a held one would keep for a second
        assert spinning.is_alive(), "the Python work waited for the spin to end: the spin held the GIL"
        assert total == 199_999 * 200_000 // 2
        theirs.sendall(b"x")
        spinning.join(5)
        assert not spinning.is_alive()


def test_no_compiler_means_no_waiter_and_a_warning(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="tandem.spin_wait"):
        assert spin_wait.native_waiter() is None
    assert "could not be built" in caplog.text


def test_without_the_c_spin_lanes_block_unless_python_polling_is_asked_for(fresh_cache, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-cc"))
    monkeypatch.setenv(lane.SPIN_ENV, "1000")
    with caplog.at_level(logging.WARNING, logger="tandem.lane"):
        server = lane.LaneServer(tmp_path / "lane.sock", {})
    assert (server.spin_s, server.waiter) == (0.0, None)
    assert "lane reads block" in caplog.text
    monkeypatch.setenv(lane.NATIVE_SPIN_ENV, "0")
    assert lane.spin_setup(0.001) == (0.001, None)


def test_lanes_take_the_c_spin_unless_told_not_to(fresh_cache, monkeypatch, tmp_path):
    monkeypatch.setenv(lane.SPIN_ENV, "1000")
    server = lane.LaneServer(tmp_path / "lane.sock", {})
    assert server.spin_s == (pytest.approx(0.001) if compiler_here() else 0.0)  # no C spin: reads block
    assert (server.waiter is not None) == compiler_here()
    monkeypatch.setenv(lane.NATIVE_SPIN_ENV, "0")
    assert lane.LaneServer(tmp_path / "lane.sock", {}).waiter is None
    monkeypatch.delenv(lane.SPIN_ENV)
    assert lane.LaneServer(tmp_path / "lane.sock", {}).waiter is None  # no spin asked: nothing built


def test_a_read_that_spins_in_c_brings_whole_frames_and_the_end_of_the_stream(fresh_cache):
    waiter = spin_wait.native_waiter()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        lane.write_frame(theirs, lane.MESSAGE, b"ready")
        assert lane.read_frame(ours, spin_s=0.05, waiter=waiter) == (lane.MESSAGE, b"ready")
        threading.Timer(0.05, lambda: lane.write_frame(theirs, lane.MESSAGE, b"late")).start()
        assert lane.read_frame(ours, spin_s=0.001, waiter=waiter) == (lane.MESSAGE, b"late")  # then blocks
        threading.Timer(0.02, lambda: lane.write_frame(theirs, lane.MESSAGE, b"soon")).start()
        assert lane.read_frame(ours, spin_s=1.0, waiter=waiter) == (lane.MESSAGE, b"soon")  # within the spin
        theirs.shutdown(socket.SHUT_WR)
        assert lane.read_frame(ours, spin_s=1.0, waiter=waiter) is None


def test_a_lane_whose_ends_spin_in_c_serves_calls_and_ends_on_a_cancel_or_a_stop(fresh_cache, monkeypatch, tmp_path):
    import grpc

    from tandem.v1 import target_pb2

    def echo(calls, context):
        for call in calls:
            yield target_pb2.StepReply(step_index=call.step.grant_steps)

    monkeypatch.setenv(lane.SPIN_ENV, "500000")  # each wait spins half a second before it would block
    server = lane.LaneServer(tmp_path / "lane.sock", {"StepStream": lane.LaneMethod(echo, target_pb2.StepCall)})
    server.start()
    try:
        stream = lane.LaneStream(server.path, server.token, "StepStream", target_pb2.StepReply)
        for steps in (3, 4):
            stream.send(target_pb2.StepCall(step=target_pb2.PackedStep(grant_steps=steps)))
            assert stream.reply().step_index == steps
        threading.Timer(0.05, stream.cancel).start()
        t0 = time.perf_counter()
        with pytest.raises(lane.LaneError) as err:
            stream.reply()  # spinning when the cancel comes
        assert err.value.code() == grpc.StatusCode.CANCELLED and time.perf_counter() - t0 < 0.4
        other = lane.LaneStream(server.path, server.token, "StepStream", target_pb2.StepReply)
        threading.Timer(0.05, server.stop).start()
        t0 = time.perf_counter()
        with pytest.raises(StopIteration):
            other.reply()  # the server's end went away while both ends spun
        assert time.perf_counter() - t0 < 0.4
    finally:
        server.stop()


def test_a_tensor_parallel_rank_spins_for_rank_0s_messages_and_still_sees_its_end(fresh_cache, monkeypatch):
    import multiprocessing as mp

    from target_service.parallel import BLOCKING, PipeWait

    monkeypatch.setenv(lane.SPIN_ENV, "50000")
    wait = PipeWait.from_env()
    assert (wait.waiter is not None) == compiler_here() and wait.seconds == (0.05 if compiler_here() else 0.0)
    monkeypatch.setenv(lane.SPIN_ENV, "0")
    assert PipeWait.from_env() == BLOCKING
    ours, theirs = mp.Pipe(duplex=False)
    with ours, theirs:
        theirs.send_bytes(b"ready")
        assert wait.recv(ours) == b"ready"
        threading.Timer(0.01, lambda: theirs.send_bytes(b"soon")).start()
        assert wait.recv(ours) == b"soon"  # within the spin
        threading.Timer(0.2, lambda: theirs.send_bytes(b"late")).start()
        assert wait.recv(ours) == b"late"  # after it: the read blocked
        theirs.close()
        with pytest.raises(EOFError):  # rank 0 gone: the worker's loop ends on this
            wait.recv(ours)


def test_the_cache_is_tandem_cache_dir_else_under_xdg_cache_home_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv(spin_wait.CACHE_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert spin_wait.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(spin_wait.CACHE_ENV)
    assert spin_wait.cache_dir() == tmp_path / "xdg" / "tandem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert spin_wait.cache_dir() == tmp_path / "home" / ".cache" / "tandem"


@pytest.mark.parametrize("native", [True, False])
def test_spinning_reads_are_counted_by_outcome_with_the_time_they_spun(fresh_cache, native, monkeypatch):
    waiter = spin_wait.native_waiter() if native else None
    if native and waiter is None:
        assert not compiler_here()
        return
    monkeypatch.setattr(lane, "SPIN_STATS", lane.SpinStats())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        caught, blocked, seconds = lane.SPIN_STATS.snapshot()
        lane.write_frame(theirs, lane.MESSAGE, b"ready")
        assert lane.read_frame(ours, spin_s=0.05, waiter=waiter) == (lane.MESSAGE, b"ready")
        threading.Timer(0.05, lambda: lane.write_frame(theirs, lane.MESSAGE, b"late")).start()
        assert lane.read_frame(ours, spin_s=0.005, waiter=waiter) == (lane.MESSAGE, b"late")
        now = lane.SPIN_STATS.snapshot()
    assert (now[0] - caught, now[1] - blocked) == (1, 1)
    assert 0.005 <= now[2] - seconds < 0.05  # the blocked read's whole spin, and the caught one's moment


def test_every_services_metrics_export_the_spin(fresh_cache):
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics
    from tandem.service_metrics import new_registry

    for registry in (new_registry(), GatewayMetrics().registry):  # the target's and draft's, the gateway's
        text = generate_latest(registry).decode()
        assert 'tandem_lane_spin_reads_total{outcome="data"}' in text
        assert 'tandem_lane_spin_reads_total{outcome="blocked"}' in text and "tandem_lane_spin_seconds_total" in text
