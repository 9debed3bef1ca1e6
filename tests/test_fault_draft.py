"""Draft faults, client deadlines and a soak, against real processes (the demo pair, one draft replica).

- The draft replica SIGKILLed under load and started again at the same address: no client sees
  an error, outputs are unchanged, and the gateway speculates with it again without a restart
  (the accepted-token counter moves again).
- A gRPC Generate whose deadline passes frees the request's KV on the target and the draft.
- A soak: 600 short requests, 32 at a time, over REST and gRPC, 10% cancelled by their client
  at a random point, the draft killed and restarted part-way: every request completes or was
  cancelled by its client, and at the end the target and the draft hold no KV, as their own
  load reports and the gateway's gauges say.

The target is paced (--emulate-step-cost, at least 25 ms a step, so a 400-token request takes
over 1.6 s even if every drafted token were accepted) only so that the deadline test's request
is surely still running when its 1.5 s deadline passes; outputs do not depend on it.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from pathlib import Path

import pytest

from tandem.v1 import generation_pb2
from tests.faults import (
    DRAFT_GAUGE,
    TARGET_GAUGE,
    StreamResult,
    draft_load,
    generation_stub,
    grpc_stream,
    holds_nothing,
    rest_stream,
    start,
    target_load,
    wait_for,
)
from tests.stack import Stack

DEMO = Path(__file__).resolve().parent.parent / "demo"
# Short prompts: the first line or two of held-out functions.
PROMPTS = [json.loads(line)["prompt"][:80] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()][:16]
ACCEPTED = "tandem_spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    st = Stack(tmp_path_factory.mktemp("draft-faults"), DEMO / "target", [DEMO / "draft"], "--no-profile",
               "--max-model-len", "512", "--max-queue", "256",
               target_args=("--num-blocks", "1024", "--block-size", "16", "--emulate-step-cost", "25,0"))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def expected(stack) -> dict[tuple[int, int], str]:
    """Greedy text per (prompt, max_tokens), undisturbed and without speculation (all at once:
    greedy output does not depend on the batch, tests/test_gateway_e2e.py)."""
    out: dict[tuple[int, int], str] = {}

    def one(prompt: int, max_tokens: int) -> None:
        reply = stack.complete(PROMPTS[prompt], max_tokens=max_tokens, temperature=0, speculation="never")
        out[(prompt, max_tokens)] = reply["choices"][0]["text"]

    for thread in [start(one, i, n) for i in range(len(PROMPTS)) for n in (6, 24)]:
        thread.join(120)
    assert len(out) == 2 * len(PROMPTS)
    return out


def call(stack: Stack, stub, api: str, prompt: int, max_tokens: int, speculation: str,
         cancel_after: int | None = None) -> StreamResult:
    """One request over `api` ("rest" or "grpc"), to its end."""
    result = StreamResult(api)
    if api == "rest":
        rest_stream(stack.url, {"prompt": PROMPTS[prompt], "max_tokens": max_tokens, "temperature": 0,
                                "speculation": speculation}, result, cancel_after)
    else:
        request = generation_pb2.GenerateRequest(prompt=PROMPTS[prompt], max_tokens=max_tokens, temperature=0,
                                                 speculation=speculation)
        grpc_stream(stub, request, result, cancel_after)
    return result


def restart_draft(stack: Stack) -> None:
    stack.drafts[0] = stack.drafts[0].restarted()  # the same address
    stack.drafts[0].wait_serving()


def wait_kv_free(stack: Stack) -> None:
    """Both services' own reports, then the gateway's gauges, read no KV held."""
    wait_for(lambda: holds_nothing(target_load(stack.target)), "the target to hold no KV")
    wait_for(lambda: holds_nothing(draft_load(stack.drafts[0])), "the draft to hold no KV")
    wait_for(lambda: stack.metrics()[TARGET_GAUGE] == 0.0, "the gateway's target KV gauge to read 0")
    wait_for(lambda: stack.metrics()[DRAFT_GAUGE] == 0.0, "the gateway's draft KV gauge to read 0")


def test_a_draft_killed_and_restarted_under_load_is_used_again_and_no_client_sees_an_error(stack, expected):
    stub = generation_stub(stack.grpc_port)
    done: list[tuple[int, StreamResult]] = []
    stop = threading.Event()

    def worker(index: int) -> None:
        n = index
        while not stop.is_set():
            prompt = n % len(PROMPTS)
            done.append((prompt, call(stack, stub, ("rest", "grpc")[n % 2], prompt, 24, "always")))
            n += 8

    workers = [start(worker, i) for i in range(8)]
    try:
        wait_for(lambda: len(done) >= 8, "load to be under way")
        assert stack.metrics()[ACCEPTED] > 0
        stack.drafts[0].kill()
        at_kill = len(done)
        wait_for(lambda: len(done) >= at_kill + 8, "requests to complete without the draft")
        restart_draft(stack)
        accepted = stack.metrics()[ACCEPTED]
        wait_for(lambda: stack.metrics()[ACCEPTED] > accepted, "the restarted draft's trees to be accepted")
        assert draft_load(stack.drafts[0]).total_blocks > 0
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    assert f"draft replica {stack.drafts[0].address} is healthy" in stack.gateway_log.read_text()
    failed = [(r.api, r.error, r.message) for _, r in done if r.outcome != "completed"]
    assert failed == []
    assert all(r.text == expected[(prompt, 24)] for prompt, r in done)
    wait_kv_free(stack)


def test_a_grpc_deadline_that_passes_frees_the_kv_on_the_target_and_the_draft(stack):
    aborted = 'tandem_requests_total{finish_reason="abort"}'
    before = stack.metrics().get(aborted, 0.0)
    request = generation_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=400, temperature=0, ignore_eos=True,
                                             speculation="always")
    result = StreamResult("grpc")
    start(grpc_stream, generation_stub(stack.grpc_port), request, result, timeout=1.5)
    held: list[bool] = []

    def both_hold_it() -> bool:
        if target_load(stack.target).num_sequences == 1 and draft_load(stack.drafts[0]).num_sequences == 1:
            held.append(True)
        return bool(held) or result.done.is_set()

    wait_for(both_hold_it, "the request to hold KV on the target and the draft")
    assert held, "the call ended before the request reached both services"
    assert result.done.wait(60)
    assert (result.outcome, result.error) == ("error", "DEADLINE_EXCEEDED")
    assert result.chunks > 0  # it was generating when the deadline passed
    wait_kv_free(stack)
    assert stack.metrics()[aborted] == before + 1


SOAK_REQUESTS = 600
SOAK_CONCURRENCY = 32
SOAK_MAX_TOKENS = 6


def test_soak_600_requests_with_cancellations_and_a_draft_kill_loses_nothing_and_frees_all_kv(stack, expected):
    rng = random.Random(15)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for n in range(SOAK_REQUESTS):
        cancel_after = rng.choice([0, 1, 2, 3]) if rng.random() < 0.1 else None
        jobs.put((n, ("rest", "grpc")[n % 2], rng.randrange(len(PROMPTS)),
                  rng.choice(["auto", "always", "never"]), cancel_after))
    results: dict[int, tuple[int, StreamResult]] = {}
    stub = generation_stub(stack.grpc_port)
    before = stack.metrics()

    def worker() -> None:
        while True:
            try:
                n, api, prompt, speculation, cancel_after = jobs.get_nowait()
            except queue.Empty:
                return
            results[n] = (prompt, call(stack, stub, api, prompt, SOAK_MAX_TOKENS, speculation, cancel_after))

    started = time.monotonic()
    workers = [start(worker) for _ in range(SOAK_CONCURRENCY)]
    wait_for(lambda: len(results) >= SOAK_REQUESTS // 3, "a third of the soak", timeout=300)
    stack.drafts[0].kill()
    restart_draft(stack)
    for w in workers:
        w.join(300)
    seconds = time.monotonic() - started

    assert len(results) == SOAK_REQUESTS
    outcomes = [r.outcome for _, r in results.values()]
    failed = [(r.api, r.error, r.message) for _, r in results.values() if r.outcome not in ("completed", "cancelled")]
    assert failed == [], f"{len(failed)} of {SOAK_REQUESTS} requests failed"
    completed, cancelled = outcomes.count("completed"), outcomes.count("cancelled")
    assert completed + cancelled == SOAK_REQUESTS and cancelled >= SOAK_REQUESTS // 20
    wrong = [n for n, (prompt, r) in results.items()
             if r.outcome == "completed" and r.text != expected[(prompt, SOAK_MAX_TOKENS)]]
    assert wrong == []
    wait_kv_free(stack)
    after = stack.metrics()
    assert after["tandem_requests_running"] == 0 and after["tandem_requests_waiting"] == 0

    def counted(reason: str) -> float:
        name = f'tandem_requests_total{{finish_reason="{reason}"}}'
        return after.get(name, 0.0) - before.get(name, 0.0)

    # A request the client cancelled may have finished on the server first; none is counted twice.
    assert completed <= counted("stop") + counted("length") <= completed + cancelled
    assert counted("abort") <= cancelled
    print(f"soak: {completed} completed, {cancelled} cancelled in {seconds:.1f} s")
