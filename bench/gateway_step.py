"""The gateway's own host time per step: GatewayCore._step with the test suite's fake target
and draft (tests/test_gateway_loop.py), so that what is timed is the gateway's Python
(scheduling, budgets, applying results, detokenizing, metrics) and the fakes' little work.

    python bench/gateway_step.py [--requests 1,16,64,128] [--steps 60]

Prints the median step time per (requests, mode). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import test_gateway_loop as loop  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1,16,64,128")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    tokenizer = loop.make_char_tokenizer(Path(tempfile.mkdtemp(prefix="tandem-gw-")))
    for n in (int(x) for x in args.requests.split(",")):
        for mode in ("never", "always", "auto"):  # auto: its per-step search of the figures too
            core, _, _ = loop.new_core(tokenizer, mode=mode, blocks=100_000)
            for i in range(n):
                loop.submit(core, f"r{i}", [5 + i % 50, 11, 13], max_tokens=100_000)
            core._take_inbox()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                core._step()
                times.append(time.perf_counter() - t0)
                core._take_inbox()
                time.sleep(0.002)  # the replica workers report their ingests, as between real steps
            ms = 1e3 * statistics.median(times[args.steps // 6:])
            print(f"{n:5d} requests {mode:>6}: {ms:7.3f} ms per step ({1e3 * ms / n:6.1f} us per request)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
