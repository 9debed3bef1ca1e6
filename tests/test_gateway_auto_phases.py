"""`auto` alone and under load, read off the gateway's Prometheus counters (demo pair, real processes, CPU).

Phase 1: one request at a time, the first on a fresh gateway (the held-out
prompts the demo tests start with: the first is among the hardest for the
draft). Trees pay, so the `tandem_spec_decode_*` counters move and
`tandem_plain_decode_steps_total` moves little.

Phase 2: LOAD streams at once. Whether trees pay there is a property of the
hardware. With the demo pair's own costs on a 2-core CPU the per-sequence
costs of a step (Python, gRPC, streaming) dominate, and a 3-token chain still
paid at 48 streams: the load gate measured 280 tok/s with trees against 243
plain here, and one CI run measured the opposite, so a test of that regime
asserts a coin toss. On a GPU at load every drafted token costs compute, in
the target's verify and in the draft's call (H200 scale track at 64 requests:
a plain step 13 ms, a verify of 4 nodes per request 17 ms, the chain's draft
call 27 ms). So both services run with `--emulate-step-cost` (tandem/pacing.py):
each call lasts at least a base plus a cost per token (target: per token in
the step; draft: per tree node expanded). Under load the figures are harsher
than the H200's so the verdict is not close: with them the gate measured trees
at a quarter of plain's tok/s. Alone, a token in the step costs about what a node of
an 8-node verify added on the H200 at batch 1 (2.8% of the step); at 4 ms a
token (13%) a 3-token chain paid only from 0.94 accepted, the first held-out
prompt's first 54 tokens averaged 0.75, and whether auto went on speculating
was a coin toss (CI, 2026-11-30). The gateway sees only the calls' wall times,
as on a GPU.

The window of phase 2 opens once every stream has streamed WINDOW[0] chunks
(all admitted, the gate's first probes of this batch size done) and closes at
WINDOW[1], long before any stream ends: the ramp-up and the drain pass through
smaller batch sizes, whose probes would blur the figure.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.stack import Stack

# The gate's verdicts rest on measured tok/s: run alone, not beside another test (see .ci/run).
pytestmark = pytest.mark.serial

DEMO = Path(__file__).resolve().parent.parent / "demo"
PROMPTS = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
LOAD = 48
WINDOW = (24, 64)  # chunks streamed by the slowest stream when the window opens / closes
TARGET_COST = "30,1"  # ms per step, ms per token in it
DRAFT_COST = "5,3"  # ms per Draft call, ms per tree node expanded
COUNTERS = ("tandem_spec_decode_num_drafts_total", "tandem_spec_decode_num_draft_tokens_total",
            "tandem_spec_decode_num_accepted_tokens_total", "tandem_plain_decode_steps_total")


class Streams:
    """Greedy `auto` streams, one per prompt, that run until they end or are stopped; counts their chunks."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int):
        self.chunks = [0] * len(prompts)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i, p, max_tokens), daemon=True)
                         for i, p in enumerate(prompts)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, i: int, prompt: str, max_tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "speculation": "auto"}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return  # closing the connection aborts the request in the gateway
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        self.chunks[i] += 1
        except httpx.HTTPError as exc:
            self.errors.append(f"stream {i}: {exc!r}")

    def wait_all(self, chunks: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while min(self.chunks) < chunks:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"streams too slow: {sorted(self.chunks)[:8]} chunks"
            time.sleep(0.05)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)
        assert not self.errors, self.errors

    def stop(self) -> None:
        self._stop.set()
        self.join(30)


def counters(st: Stack) -> dict[str, float]:
    m = st.metrics()
    return {k: m[k] for k in COUNTERS}


def delta(a: dict[str, float], b: dict[str, float]) -> tuple[float, float, float]:
    """(trees verified, share of decode steps with a tree, drafted tokens per tree) between a and b."""
    trees = b[COUNTERS[0]] - a[COUNTERS[0]]
    plain = b[COUNTERS[3]] - a[COUNTERS[3]]
    return trees, trees / max(trees + plain, 1), (b[COUNTERS[1]] - a[COUNTERS[1]]) / max(trees, 1)


def test_auto_speculates_alone_and_stops_under_load(tmp_path):
    t0 = time.monotonic()
    st = Stack(tmp_path, DEMO / "target", [DEMO / "draft"], "--speculation", "auto", "--max-model-len", "1024",
               target_args=("--num-blocks", "2048", "--block-size", "16", "--emulate-step-cost", TARGET_COST),
               draft_args=("--emulate-step-cost", DRAFT_COST))
    try:
        # Phase 1: one request at a time.
        before = counters(st)
        for prompt in PROMPTS[::5][:3]:
            Streams(st.url, [prompt], 128).join(60)
        after = counters(st)
        trees, share, size = delta(before, after)
        accepted = after[COUNTERS[2]] - before[COUNTERS[2]]
        print(f"\nalone: {trees:.0f} trees, {share:.0%} of decode steps speculative, {size:.1f} tokens per tree, "
              f"{accepted / max(trees, 1):.2f} accepted per tree")
        assert trees >= 10 and accepted > trees, "alone, auto did not speculate (or nothing was accepted)"
        # The start-up profile is where CI runs have differed: the message carries what it fitted.
        log_lines = st.gateway_log.read_text().splitlines()
        profiled = [line.split(" INFO ")[1] for line in log_lines if "cost model:" in line]
        assert share >= 0.5, f"alone, auto speculated in only {share:.0%} of decode steps; {profiled}"

        # Phase 2: LOAD streams; read the counters over a window in which all of them run.
        load = Streams(st.url, [PROMPTS[i % len(PROMPTS)] for i in range(LOAD)], 400)
        try:
            load.wait_all(WINDOW[0], 150)
            a = counters(st)
            load.wait_all(WINDOW[1], 120)
            b = counters(st)
        finally:
            load.stop()
        trees, share, size = delta(a, b)
        plain = b[COUNTERS[3]] - a[COUNTERS[3]]
        print(f"under load ({LOAD}): {share:.0%} of decode steps speculative, {plain:.0f} plain "
              f"({time.monotonic() - t0:.0f} s in all)")
        gate = [line.split(" INFO ")[1] for line in st.gateway_log.read_text().splitlines() if "load gate" in line]
        print("\n".join(gate))
        # What may remain: a probe of trees (at most 8 steps of the 40 in the window; after a clear
        # loss the next comes 160 steps later) and the one tree auto tries after 32 quiet steps.
        assert plain >= LOAD * 20, f"under load only {plain:.0f} plain decode steps in the window"
        assert share <= 0.25, f"under load auto still speculated in {share:.0%} of decode steps"
    finally:
        st.stop()
