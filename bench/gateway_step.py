"""The gateway's own host time per step: GatewayCore._step with the test suite's fake target
and draft (tests/test_gateway_loop.py), so that what is timed is the gateway's Python
(scheduling, budgets, applying results, detokenizing, metrics) and the fakes' little work.

    python bench/gateway_step.py [--requests 1,16,64,128] [--steps 60] [--target-ms 3] [--phases]
                                 [--debug-log] [--acceptance P]

Prints the median step time per (requests, mode). A benchmark, not a test.

--target-ms: each fake target step also sleeps this long, as a GPU step would take. The fake draft
is always right, so with a target step that dear `auto`'s load gate measures trees winning and
`auto` drafts, as it does on a GPU where trees pay (without it, plain steps are cheaper and `auto`
decodes plainly). --acceptance P: each level of a fake tree is right with probability P, the first
miss ending what the target accepts (drawn per request and position, the same for every mode, as the
scale track forces it); always right, `auto` drafts deeper chains than `always` and its update
applies more tokens, which hides what its own bookkeeping costs. --phases: the mean milliseconds a
step of the loop's phases (and of the policy's search) took. --debug-log: the gateway's DEBUG lines
are formatted and written (to /dev/null), as in the GPU benches' serves (SERVE_LOG_LEVEL=DEBUG).
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.call_clock import CallClock  # noqa: E402
from gateway import core as gateway_core  # noqa: E402
from tests import test_gateway_loop as loop  # noqa: E402

# What --phases times: the loop's phases, the policy's search of the figures, and the schedule's other work for
# `auto` (each request's figures, the expected tokens the load gate is given, the plain spell's price).
PHASES = ("_schedule", "_budgets", "_candidate", "_expected_accepted", "_plain_extra_seconds", "_draft", "_update",
          "_apply", "_record")
POLICY = ("search_budgets",)


def phase_clock() -> CallClock:
    """A clock on PHASES and POLICY, started."""
    clock = CallClock()
    for name in PHASES:
        clock.wrap(gateway_core.GatewayCore, name)
    for name in POLICY:
        clock.wrap(gateway_core, name)
    return clock


def slow_target(target_ms: float) -> None:
    """Each fake target step (a call's, or a granted one's) sleeps `target_ms` first."""
    run = loop.FakeTarget.run

    def slow_run(self, items, *args, **kwargs):
        time.sleep(target_ms / 1000)
        return run(self, items, *args, **kwargs)

    loop.FakeTarget.run = slow_run


def forced_acceptance(rate: float) -> None:
    """Each level of the fake draft's trees is right with probability `rate`: from the first level drawn wrong,
    the tree's tokens are wrong ones, so the target accepts the levels before it. The draws hang on the request
    and the tree's position, so every mode meets the same ones."""
    draft = loop.FakeDraft.draft

    def missing_draft(self, ingest, calls):
        reply = draft(self, ingest, calls)
        for tree in reply.trees:
            draws = random.Random(f"{tree.request_id}:{tree.root_position}")
            right = next((level for level in range(len(tree.tokens)) if draws.random() >= rate), len(tree.tokens))
            tree.tokens[right:] = [(token + 1) % loop.VOCAB for token in tree.tokens[right:]]
        return reply

    loop.FakeDraft.draft = missing_draft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1,16,64,128")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--target-ms", type=float, default=0.0,
                    help="each fake target step also sleeps this long (default 0)")
    ap.add_argument("--phases", action="store_true", help="print the mean ms a step of each phase")
    ap.add_argument("--debug-log", action="store_true", help="write the gateway's DEBUG lines (to /dev/null)")
    ap.add_argument("--acceptance", type=float, default=1.0,
                    help="each level of a fake tree is right with this probability (default 1: always)")
    args = ap.parse_args(argv)
    try:
        loads = [int(x) for x in args.requests.split(",")]
    except ValueError:
        ap.error(f"--requests takes request counts separated by commas, got {args.requests!r}")
    if min(loads) < 1 or args.steps < 6 or args.target_ms < 0 or not 0.0 <= args.acceptance <= 1.0:
        ap.error("--requests must be at least 1, --steps at least 6, --target-ms at least 0 and --acceptance "
                 "within 0-1")
    if args.acceptance < 1.0:
        forced_acceptance(args.acceptance)
    if args.target_ms:
        slow_target(args.target_ms)
    if args.debug_log:
        logging.basicConfig(filename="/dev/null", level=logging.DEBUG,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tokenizer = loop.make_char_tokenizer(Path(tempfile.mkdtemp(prefix="tandem-gw-")))
    for n in loads:
        for mode in ("never", "always", "auto"):  # auto: its per-step search of the figures too
            core, _, drafts = loop.new_core(tokenizer, mode=mode, blocks=100_000)
            for i in range(n):
                loop.submit(core, f"r{i}", [5 + i % 50, 11, 13], max_tokens=100_000)
            core._take_inbox()
            reqs = list(core.waiting)
            gc.freeze()  # as the services do once ready (tandem/gc_pauses.py)
            warm = args.steps // 6
            clock = CallClock()  # started at the first timed step where --phases asks
            times, calls_before, tokens_before = [], 0, 0
            for step in range(args.steps):
                if not core.running and not core.waiting:  # every request reached the fake model's length
                    break
                if step == warm:
                    calls_before = drafts[0].draft_calls
                    tokens_before = sum(len(req.output) for req in reqs)
                    if args.phases:
                        clock = phase_clock()
                t0 = time.perf_counter()
                core._step()
                times.append(time.perf_counter() - t0)
                core._take_inbox()
                time.sleep(0.002)  # the replica workers report their ingests, as between real steps
            clock.restore()
            gc.unfreeze()
            timed = len(times) - warm
            if timed < 1:
                print(f"{n:5d} requests {mode:>6}: the requests ended before the timed steps (fewer --steps)")
                continue
            ms = 1e3 * statistics.median(times[warm:])
            drafted = (drafts[0].draft_calls - calls_before) / timed  # the share of rounds that drafted trees
            tokens = (sum(len(req.output) for req in reqs) - tokens_before) / timed / n
            line = (f"{n:5d} requests {mode:>6}: {ms:7.3f} ms per step ({1e3 * ms / n:6.1f} us per request), "
                    f"trees in {100 * drafted:3.0f}% of steps, {tokens:4.1f} tokens a request a step")
            if args.phases:
                line += "  " + " ".join(f"{name.lstrip('_')} {1e3 * s / timed:.3f}"
                                        for name, s in clock.seconds.items())
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
