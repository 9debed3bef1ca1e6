"""`auto` alone and under load, read off the gateway's Prometheus counters (demo pair, real processes, CPU).

Phase 1: one request at a time, the first on a fresh gateway (the held-out
prompts the demo tests start with: the first is among the hardest for the
draft). Trees pay (about 1.3x on this CPU), so the `tandem_spec_decode_*`
counters move and `tandem_plain_decode_steps_total` moves less.

Phase 2: LOAD streams at once. On this 2-core CPU the demo pair's 3-token
chain still pays at that load: with 48 streams, all of them on the chain made
1.37-1.54x the tokens/s of plain decoding (three alternating 10 s windows;
1.28-1.37x at 64 streams), while the 5/4/8 tree made 0.85x at 64. So `auto`
must keep speculating, with the chain, and decode plainly only in the load
gate's probes and for requests whose drafts do badly. Plain decoding wins
under load only where verifying a tree costs more as the batch grows (a GPU
at large batch); on this CPU the per-sequence costs of a step (Python in the
services, gRPC, streaming) dominate, and a tree spreads them over ~3 tokens.

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

from tests.stack import Stack

DEMO = Path(__file__).resolve().parent.parent / "demo"
PROMPTS = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
LOAD = 48
WINDOW = (20, 32)  # chunks streamed by the slowest stream when the window opens / closes
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


def test_auto_speculates_alone_and_keeps_the_chain_under_load(tmp_path):
    t0 = time.monotonic()
    st = Stack(tmp_path, DEMO / "target", [DEMO / "draft"], "--speculation", "auto", "--max-model-len", "1024",
               target_args=("--num-blocks", "2048", "--block-size", "16"))
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
        assert share >= 0.5, f"alone, auto speculated in only {share:.0%} of decode steps"

        # Phase 2: LOAD streams; read the counters over a window in which all of them run.
        load = Streams(st.url, [PROMPTS[i % len(PROMPTS)] for i in range(LOAD)], 400)
        try:
            load.wait_all(WINDOW[0], 45)
            a = counters(st)
            load.wait_all(WINDOW[1], 45)
            b = counters(st)
        finally:
            load.stop()
        trees, share, size = delta(a, b)
        print(f"under load ({LOAD}): {share:.0%} of decode steps speculative, {size:.1f} tokens per tree "
              f"({time.monotonic() - t0:.0f} s in all)")
        # Plain steps left: the gate's probes, and requests whose drafts are doing badly (auto's budgets are
        # per request). Stopping under load would leave about 10% (probes only).
        assert share >= 0.6, f"under load auto speculated in only {share:.0%} of decode steps, though trees pay"
        assert size <= 4.5, f"under load auto drafted {size:.1f} tokens per tree; the 3-token chain is cheapest"
    finally:
        st.stop()
