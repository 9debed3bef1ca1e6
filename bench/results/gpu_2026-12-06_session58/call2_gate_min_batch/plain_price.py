"""At each `tandem bench` level's start: the plain step's price at one and two sequences, learned per grant as
GatewayCore._learn_grant does, replayed from a gateway's DEBUG log with bench/cost_replay.py's parsing; and, beside
it, the price learned as a full grant of GRANT_STEPS would run: a grant's first step (the plan's round trip in it)
and its other steps learned apart (each a decayed mean), the first spread over GRANT_STEPS.

    PYTHONPATH=. python bench/results/gpu_2026-12-06_session58/call2_gate_min_batch/plain_price.py \
        GATEWAY_LOG[.gz] BENCH_JSON
"""

from __future__ import annotations

import gzip
import json
import sys
from datetime import datetime

import bench.cost_replay as replay

GRANT_STEPS = 8  # tandem serve's default --grant-steps
DECAY = 0.3


def main(log: str, bench_json: str) -> None:
    text = gzip.open(log, "rt").read() if log.endswith(".gz") else open(log).read()
    levels = sorted((level["started_at"], level["mode"], level["concurrency"], level["round"])
                    for level in json.load(open(bench_json))["results"])
    costs = spread = None
    grant: dict[int, list[float]] = {}  # the grant under way: sequences -> its steps' seconds
    first: dict[int, float] = {}  # sequences -> a grant's first step (decayed mean)
    rest: dict[int, float] = {}  # sequences -> a grant's other steps (decayed mean)
    for line in text.splitlines():
        stamp = replay.STAMP.match(line)
        if stamp and levels and costs is not None:
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            while levels and when >= levels[0][0]:
                _, mode, concurrency, round_ = levels.pop(0)
                print(f"{mode:>6} c={concurrency} r={round_}: plain step priced "
                      f"{1e3 * costs.step_time(1, 1, []):.3f} ms at 1, {1e3 * costs.step_time(2, 2, []):.3f} at 2; "
                      f"spread over {GRANT_STEPS}: {1e3 * spread.step_time(1, 1, []):.3f} and "
                      f"{1e3 * spread.step_time(2, 2, []):.3f}")
        if costs is None:
            if found := replay.PROFILE.search(line):
                costs, spread = replay.load_profile(found.group(1)), replay.load_profile(found.group(1))
            continue
        if not (found := replay.STEP.search(line)):
            continue
        row = found.groups()
        seqs, trees, granted, fed, decode, ms = int(row[2]), int(row[3]), int(row[4]), row[5], row[6], float(row[8])
        if granted <= 1:  # a new plan's step: the grant before it ended
            for n, seconds in grant.items():
                first[n] = seconds[0] if n not in first else (1 - DECAY) * first[n] + DECAY * seconds[0]
                if len(seconds) > 1:
                    mean = sum(seconds[1:]) / (len(seconds) - 1)
                    rest[n] = mean if n not in rest else (1 - DECAY) * rest[n] + DECAY * mean
                if n in rest:
                    spread.observe(n, n, [], (first[n] + (GRANT_STEPS - 1) * rest[n]) / GRANT_STEPS)
            replay.learn_grant(costs, grant)
        if decode == "True" and not trees and fed == "False":
            if granted:
                grant.setdefault(seqs, []).append(ms / 1000)
            else:
                costs.observe(seqs, seqs, [], ms / 1000)
                spread.observe(seqs, seqs, [], ms / 1000)


if __name__ == "__main__":
    main(*sys.argv[1:3])
