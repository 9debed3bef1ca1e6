"""What `auto`'s per-step choice costs the gateway: search_budgets then choose_budgets, as the loop calls them,
for 1, 8 and 64 auto candidates with warm figures (every option drafted 20 times, 50 main paths, 10 of each
request's own).

    python bench/policy_search.py [--candidates 1,8,64] [--repeats 300]

Prints the median microseconds per step's choice. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.acceptance import AcceptanceBook, LevelRates, MainPath  # noqa: E402
from gateway.cost_model import CostModel  # noqa: E402
from gateway.policy import Candidate, PolicyConfig, choose_budgets, search_budgets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    cfg = PolicyConfig()
    # The test suite's GPU-like costs: a large fixed cost a step, cheap extra tokens at a small batch.
    costs = CostModel(target_base=4e-3, target_per_token=4e-5, target_per_seq=1e-6, draft_base=5e-4,
                      draft_per_level=2e-4, draft_per_expansion=2e-6)
    book = AcceptanceBook()
    for option in cfg.auto_options():
        for _ in range(20):
            book.record(option, 3)
    for _ in range(50):
        book.levels.record(MainPath(5, 3))
    for n in (int(x) for x in args.candidates.split(",")):
        candidates = []
        for i in range(n):
            levels = LevelRates()
            for _ in range(10):
                levels.record(MainPath(5, 3))
            candidates.append(Candidate(f"r{i}", {o: (2.5, 6.0) for o in cfg.explored_options()}, "auto",
                                        levels=levels))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            search = search_budgets(cfg, costs, book, candidates, 0, 0)
            choose_budgets(cfg, costs, book, candidates, 0, 0, search=search)
            times.append(time.perf_counter() - t0)
        print(f"{n:4d} candidates: {1e6 * statistics.median(times):7.1f} us per step's choice", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
