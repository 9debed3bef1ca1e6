"""At each `tandem bench` level's start, replayed from a gateway's DEBUG log: the plain step's price at one and two
sequences as GatewayCore learns it (a grant's mean into the cost ratio), beside the median and the least of the last
WINDOW grants' means at that load (an alternative that one slow grant cannot move).

    PYTHONPATH=. python bench/results/gpu_2026-12-06_session59/cpu_replay/median_price.py GATEWAY_LOG[.gz] BENCH_JSON
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from datetime import datetime

import bench.cost_replay as replay

WINDOW = 9  # grants


def main(log: str, bench_json: str) -> None:
    text = gzip.open(log, "rt").read() if log.endswith(".gz") else open(log).read()
    levels = sorted((level["started_at"], level["mode"], level["concurrency"], level["round"])
                    for level in json.load(open(bench_json))["results"])
    costs = None
    grant: dict[int, list[float]] = {}  # the grant under way: sequences -> its steps' seconds
    grant_means: dict[int, list[float]] = {1: [], 2: []}  # sequences -> every finished grant's mean step
    for line in text.splitlines():
        stamp = replay.STAMP.match(line)
        if stamp and levels and costs is not None:
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            while levels and when >= levels[0][0]:
                _, mode, concurrency, round_ = levels.pop(0)
                recent = {seqs: means[-WINDOW:] for seqs, means in grant_means.items()}
                median = {seqs: 1e3 * statistics.median(means) if means else float("nan")
                          for seqs, means in recent.items()}
                print(f"{mode:>6} c={concurrency} r={round_}: learned {1e3 * costs.step_time(1, 1, []):.3f} / "
                      f"{1e3 * costs.step_time(2, 2, []):.3f} ms  median of {WINDOW} grants {median[1]:.3f} / "
                      f"{median[2]:.3f}  least at 1 {1e3 * min(recent[1] or [0.0]):.3f}")
        if costs is None:
            if found := replay.PROFILE.search(line):
                costs = replay.load_profile(found.group(1))
            continue
        if not (found := replay.STEP.search(line)):
            continue
        row = found.groups()
        seqs, trees, granted, fed, decode, ms = int(row[2]), int(row[3]), int(row[4]), row[5], row[6], float(row[8])
        if granted <= 1:  # a new plan's step: the grant before it ended
            for grant_seqs, seconds in grant.items():
                if grant_seqs in grant_means:
                    grant_means[grant_seqs].append(sum(seconds) / len(seconds))
            replay.learn_grant(costs, grant)
        if decode == "True" and not trees and fed == "False":
            if granted:
                grant.setdefault(seqs, []).append(ms / 1000)
            else:
                costs.observe(seqs, seqs, [], ms / 1000)


if __name__ == "__main__":
    main(*sys.argv[1:3])
