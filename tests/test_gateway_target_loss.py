"""The step loop when the target becomes unreachable, in process against the fakes of
tests/test_gateway_loop.py (the real processes: tests/test_fault_target.py).

A lost target makes the gateway not ready; its requests wait, are re-prefilled from their
tokens when the target answers again (output unchanged), or end aborted with the reason
once --target-wait has passed; either way the gateway is ready again when the target is."""

from __future__ import annotations

import threading
import time

import pytest

from gateway.clients import TargetUnavailable
from gateway.core import CoreConfig, GatewayCore
from gateway.main import build_parser
from gateway.policy import PolicyConfig
from gateway.scheduler import SchedulerConfig
from tandem.errors import Unavailable
from tests.fake_engine import make_char_tokenizer
from tests.faults import wait_for
from tests.test_gateway_loop import FakeDraft, FakeTarget, expected, submit, tokens_of


class RestartingTarget(FakeTarget):
    """A fake target that becomes unreachable at its `die_at_step`-th step and answers again
    (healthy) once `come_back()` is called; `restarts`: it forgets every sequence meanwhile
    (False: a broken stream to a target that kept them)."""

    address = "fake-target:1"

    def __init__(self, die_at_step: int, restarts: bool = True, **kw):
        super().__init__(**kw)
        self.die_at_step, self.restarts = die_at_step, restarts
        self.calls = 0
        self.down = False
        self.reconnects = 0
        self.released: list[str] = []

    def healthy(self) -> bool:
        return not self.down

    def health(self) -> bool | None:
        return not self.down

    def reconnect(self) -> None:
        self.reconnects += 1

    def come_back(self) -> None:
        self.down = False

    def step(self, items, feature_layers, hold_features=False, feature_sinks=None, release=()):
        self.calls += 1
        if self.calls == self.die_at_step:
            self.down = True
            if self.restarts:
                self.lengths = {}
        if self.down:
            raise TargetUnavailable("target failed: UNAVAILABLE: Socket closed")
        return super().step(items, feature_layers, release=release)

    def release(self, ids):
        if self.down:
            raise TargetUnavailable("target failed: UNAVAILABLE: Socket closed")
        self.released += ids
        return super().release(ids)

    def info(self):
        if self.down:
            raise TargetUnavailable("target failed: UNAVAILABLE: Socket closed")
        return super().info()


def running_core(tokenizer, target: RestartingTarget, wait_s: float) -> tuple[GatewayCore, list[bool], FakeDraft]:
    """A core whose loop runs in its own thread, as start() would run it; returns it with the
    readiness values it reported and its draft."""
    draft = FakeDraft("draft0")
    cfg = CoreConfig(policy=PolicyConfig("always"), scheduler=SchedulerConfig(block_size=target.block_size),
                     profile=False, target_wait_s=wait_s)
    core = GatewayCore(target, [draft], tokenizer, cfg, "fake")
    core.configure()
    readiness: list[bool] = []
    core.on_readiness = readiness.append
    core._ready = True
    loop = threading.Thread(target=core._loop, daemon=True)
    loop.start()
    core._threads.append(loop)  # shutdown() stops and joins it
    return core, readiness, draft


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_char_tokenizer(tmp_path_factory.mktemp("tok"))


def finished(out) -> bool:
    return bool(out) and out[-1].finish_reason is not None


def test_requests_running_when_the_target_is_lost_finish_unchanged_once_it_returns(tokenizer):
    target = RestartingTarget(die_at_step=4)
    core, readiness, draft = running_core(tokenizer, target, wait_s=60)
    try:
        outs = [submit(core, f"r{i}", [5 + i, 11, 13], max_tokens=20) for i in range(3)]
        wait_for(lambda: target.down, "the target to die mid-generation")
        wait_for(lambda: not core.ready(), "the gateway to report not ready")
        with pytest.raises(Unavailable, match="unreachable"):
            submit(core, "late", [1, 2], max_tokens=4)
        assert not any(finished(out) for out in outs)
        target.come_back()
        wait_for(lambda: all(finished(out) for out in outs), "every request to finish")
        for i, out in enumerate(outs):
            assert tokens_of(out) == expected([5 + i, 11, 13], 20)
            assert out[-1].finish_reason == "length" and out[-1].error is None
        assert readiness == [False, True] and core.ready()
        assert target.reconnects == 1  # the broken step stream is not reused
        wait_for(lambda: target.lengths == {} and draft.known == {}, "the target and draft to hold nothing")
    finally:
        core.shutdown()


def test_after_a_broken_stream_to_a_target_that_kept_its_kv_the_stale_kv_is_released_first(tokenizer):
    target = RestartingTarget(die_at_step=3, restarts=False)
    core, _, _ = running_core(tokenizer, target, wait_s=60)
    try:
        outs = [submit(core, f"r{i}", [3 + i, 4], max_tokens=20) for i in range(2)]
        wait_for(lambda: target.down, "the stream to break")
        assert set(target.lengths) == {"r0", "r1"}  # the target still holds both
        target.come_back()
        wait_for(lambda: all(finished(out) for out in outs), "every request to finish")
        assert target.released[:2] == ["r0", "r1"]  # before they were prefilled again
        for i, out in enumerate(outs):
            assert tokens_of(out) == expected([3 + i, 4], 20)
        wait_for(lambda: target.lengths == {}, "the target to hold nothing")
    finally:
        core.shutdown()


def test_past_the_wait_requests_end_unavailable_and_the_gateway_serves_once_the_target_returns(tokenizer):
    target = RestartingTarget(die_at_step=3)
    core, readiness, _ = running_core(tokenizer, target, wait_s=0.3)
    try:
        outs = [submit(core, f"r{i}", [7 + i, 2], max_tokens=30) for i in range(2)]
        started = time.monotonic()
        wait_for(lambda: all(finished(out) for out in outs), "the requests to be ended")
        assert time.monotonic() - started >= 0.3
        for out in outs:
            assert out[-1].finish_reason == "abort"
            assert "unreachable for longer than 0.3 s (--target-wait)" in out[-1].error
        assert not core.ready() and core.running == [] and core.waiting == []
        time.sleep(0.2)
        assert not core.ready()  # still waiting for the target, holding nothing
        target.come_back()
        wait_for(core.ready, "the gateway to serve again")
        assert readiness == [False, True]
        again = submit(core, "again", [7, 2], max_tokens=30)
        wait_for(lambda: finished(again), "a new request to finish")
        assert tokens_of(again) == expected([7, 2], 30)
    finally:
        core.shutdown()


def test_an_idle_gateway_notices_a_lost_target_and_serves_again_when_it_returns(tokenizer):
    target = RestartingTarget(die_at_step=0)
    core, readiness, _ = running_core(tokenizer, target, wait_s=60)
    try:
        target.down = True
        wait_for(lambda: not core.ready(), "the idle gateway to notice", timeout=10)
        target.come_back()
        wait_for(core.ready, "the gateway to serve again", timeout=10)
        assert readiness == [False, True]
    finally:
        core.shutdown()


def test_a_negative_target_wait_is_refused():
    with pytest.raises(ValueError, match="target wait"):
        CoreConfig(target_wait_s=-1)


def test_the_gateway_flag_defaults_to_a_minute_and_says_what_it_does():
    parser = build_parser()
    assert parser.parse_args(["--target", "t:1"]).target_wait == 60.0
    assert parser.parse_args(["--target", "t:1", "--target-wait", "5"]).target_wait == 5.0
    text = " ".join(parser.format_help().split())
    assert "--target-wait SECONDS" in text and "re-prefills them from their tokens" in text


class SlowToAnswer(RestartingTarget):
    """A live target whose idle health checks time out (None) while `slow` is set, as a busy host's do."""

    def __init__(self, **kw):
        super().__init__(die_at_step=0, **kw)
        self.slow = False
        self.checks: list[bool | None] = []

    def health(self) -> bool | None:
        answer = None if self.slow else not self.down
        self.checks.append(answer)
        return answer

    def healthy(self) -> bool:  # as the client's: a check that times out is not SERVING
        return not self.slow and not self.down


def test_an_idle_health_check_that_times_out_now_and_then_leaves_the_gateway_serving(tokenizer, monkeypatch):
    import gateway.core as core_module

    monkeypatch.setattr(core_module, "TARGET_PROBE_S", 0.05)
    target = SlowToAnswer()
    core, readiness, _ = running_core(tokenizer, target, wait_s=60)
    try:
        target.slow = True
        wait_for(lambda: target.checks[-2:] == [None, None], "two idle checks to time out")
        target.slow = False
        wait_for(lambda: target.checks[-1:] == [True], "an idle check to answer")
        assert readiness == [] and core.ready()
        out = submit(core, "r", [5, 11, 13], max_tokens=6)
        wait_for(lambda: finished(out), "the request to finish")
        assert tokens_of(out) == expected([5, 11, 13], 6)
        # Checks that keep timing out do count: the gateway stops serving until the target answers again.
        target.slow = True
        wait_for(lambda: not core.ready(), "the gateway to give the target up", timeout=10)
        assert target.checks[-core_module.IDLE_TARGET_MISSES:] == [None] * core_module.IDLE_TARGET_MISSES
        target.slow = False
        wait_for(core.ready, "the gateway to serve again")
        assert readiness == [False, True]
    finally:
        core.shutdown()


class BrokenCheck(RestartingTarget):
    """A target whose first idle health check raises (a client bug, say), then answers."""

    def __init__(self, **kw):
        super().__init__(die_at_step=0, **kw)
        self.raised = 0

    def health(self) -> bool | None:
        if not self.raised:
            self.raised += 1
            raise RuntimeError("the health check itself broke")
        return True


def test_an_idle_health_check_that_raises_does_not_stop_the_loop(tokenizer, monkeypatch):
    import gateway.core as core_module

    monkeypatch.setattr(core_module, "TARGET_PROBE_S", 0.05)
    target = BrokenCheck()
    core, _, _ = running_core(tokenizer, target, wait_s=60)
    try:
        wait_for(lambda: target.raised, "the health check to raise")
        out = submit(core, "r", [5, 11, 13], max_tokens=6)
        wait_for(lambda: finished(out), "the request to finish")
        assert tokens_of(out) == expected([5, 11, 13], 6)
    finally:
        core.shutdown()
