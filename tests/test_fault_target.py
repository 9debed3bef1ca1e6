"""The target dies (SIGKILL) under 8 greedy streams, over REST and gRPC, on the demo pair.

Started again at the same address within --target-wait, every stream completes equal to an
undisturbed run (the gateway re-prefills each request from its committed tokens); kept down
past the bound, every stream ends UNAVAILABLE (gRPC) / with an error event or a 503 (REST),
and the gateway serves again once the target is back. Meanwhile the gateway reports
NOT_SERVING and refuses new requests with 503 / UNAVAILABLE.

The target is paced (--emulate-step-cost, at least 30 ms a step) so that a 64-token stream
takes well over the time between the streams' first chunks and the kill (at least 11 more
steps even if every drafted token were accepted): the kill lands mid-stream on any machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import pytest

from tandem.v1 import generation_pb2
from tests.faults import (
    NOT_SERVING,
    SERVING,
    TARGET_GAUGE,
    StreamResult,
    generation_stub,
    grpc_health,
    grpc_stream,
    holds_nothing,
    rest_full,
    rest_stream,
    start,
    target_load,
    wait_for,
)
from tests.stack import Gateway, Stack

DEMO = Path(__file__).resolve().parent.parent / "demo"
PROMPTS = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()][:8]
MAX_TOKENS = 64
SHORT_WAIT_S = 2.0  # --target-wait of the gateway that gives up


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    st = Stack(tmp_path_factory.mktemp("target-restart"), DEMO / "target", [DEMO / "draft"], "--no-profile",
               "--max-model-len", "512", "--target-wait", "120",
               target_args=("--num-blocks", "1024", "--block-size", "16", "--emulate-step-cost", "30,0"))
    yield st
    st.stop()


def body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def start_streams(gw: Gateway) -> list[StreamResult]:
    """The 8 prompts at once: 3 REST streams, 1 REST request without streaming, 4 gRPC streams."""
    stub = generation_stub(gw.grpc_port)
    results = []
    for i, prompt in enumerate(PROMPTS):
        if i < 3:
            results.append(StreamResult("rest"))
            start(rest_stream, gw.url, body(prompt), results[-1])
        elif i == 3:
            results.append(StreamResult("rest-full"))
            start(rest_full, gw.url, body(prompt), results[-1])
        else:
            results.append(StreamResult("grpc"))
            request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                     ignore_eos=True)
            start(grpc_stream, stub, request, results[-1])
    return results


def kill_target_mid_stream(st: Stack, results: list[StreamResult]) -> None:
    """SIGKILL the target once every stream has output and the target holds all 8 sequences."""
    wait_for(lambda: all(r.chunks > 0 for r in results if r.api != "rest-full")
             and target_load(st.target).num_sequences == len(results), "every stream to be under way")
    st.target.kill()
    assert all(r.outcome == "running" for r in results), [(r.api, r.outcome, r.error) for r in results]


def assert_refuses_new_requests(gw: Gateway) -> None:
    r = httpx.post(f"{gw.url}/v1/completions", json=body("x = 1"), timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
    assert r.json()["error"]["code"] == "service_unavailable"
    with pytest.raises(grpc.RpcError) as refused:
        list(generation_stub(gw.grpc_port).Generate(generation_pb2.GenerateRequest(prompt="x = 1", max_tokens=4),
                                                    timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def wait_not_serving(gw: Gateway) -> None:
    wait_for(lambda: httpx.get(f"{gw.url}/health", timeout=5).status_code == 503, "REST /health to say 503")
    wait_for(lambda: grpc_health(gw.grpc_port) == NOT_SERVING, "gRPC health to say NOT_SERVING")
    assert grpc_health(gw.grpc_port, "tandem.liveness") == SERVING  # alive: a liveness probe must not restart it


def wait_serving(gw: Gateway) -> None:
    wait_for(lambda: httpx.get(f"{gw.url}/health", timeout=5).status_code == 200, "REST /health to say 200")
    assert grpc_health(gw.grpc_port) == SERVING


@pytest.fixture(scope="module")
def undisturbed(stack) -> list[str]:
    results = start_streams(stack)
    for r in results:
        assert r.done.wait(300)
        assert r.outcome == "completed", (r.api, r.error, r.message)
    return [r.text for r in results]


def test_target_killed_under_8_streams_and_restarted_every_stream_completes_unchanged(stack, undisturbed):
    results = start_streams(stack)
    kill_target_mid_stream(stack, results)
    wait_not_serving(stack)
    assert_refuses_new_requests(stack)
    assert all(r.outcome == "running" for r in results), "a request ended while the target was away"

    stack.target = stack.target.restarted()  # the same address
    for r in results:
        assert r.done.wait(300), f"{r.api} stream never ended"
    assert [(r.outcome, r.error, r.message) for r in results] == [("completed", "", "")] * len(results)
    assert [r.text for r in results] == undisturbed
    wait_serving(stack)
    assert "re-prefilling 8 request(s)" in stack.gateway_log.read_text()
    # The restarted target holds nothing once the streams are done, and the gateway's gauge says so.
    wait_for(lambda: holds_nothing(target_load(stack.target)), "the target's KV to be free")
    wait_for(lambda: stack.metrics()[TARGET_GAUGE] == 0.0, "the gateway's target KV gauge to read 0")


def test_target_down_past_the_bound_ends_every_stream_unavailable_then_serves_again(stack, undisturbed, tmp_path):
    gw = Gateway(tmp_path, stack.target.address, [d.address for d in stack.drafts], "--no-profile",
                 "--max-model-len", "512", "--target-wait", str(SHORT_WAIT_S), name="gateway-short-wait")
    try:
        results = start_streams(gw)
        kill_target_mid_stream(stack, results)
        killed_at = time.monotonic()
        for r in results:
            assert r.done.wait(120), f"{r.api} stream never ended"
        for r in results:
            assert r.outcome == "error" and r.ended_at - killed_at >= SHORT_WAIT_S * 0.9, (r.api, r.outcome)
            assert "--target-wait" in r.message, r.message  # says why, not the generic shutdown message
            assert r.error == {"rest": "service_unavailable", "rest-full": "503", "grpc": "UNAVAILABLE"}[r.api]
        wait_not_serving(gw)
        assert_refuses_new_requests(gw)  # still down: still refused

        stack.target = stack.target.restarted()
        wait_serving(gw)
        again = start_streams(gw)
        for r in again:
            assert r.done.wait(300)
        assert [r.text for r in again] == undisturbed
        assert gw.metrics()['tandem_requests_total{finish_reason="abort"}'] == len(results)
    finally:
        gw.stop()
