"""Per `tandem bench` level: the gateway's decode steps by kind (trees; plain granted; plain one call, fed or not),
count and mean ms, from a DEBUG gateway log.

    PYTHONPATH=. python bench/results/gpu_2026-12-06_session59/cpu_replay/level_kinds.py GATEWAY_LOG[.gz] BENCH_JSON
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from datetime import datetime

import bench.cost_replay as replay


def main(log: str, bench_json: str) -> None:
    text = gzip.open(log, "rt").read() if log.endswith(".gz") else open(log).read()
    levels = sorted((level["started_at"], level["ended_at"], level["mode"], level["concurrency"], level["round"])
                    for level in json.load(open(bench_json))["results"])
    kinds: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in text.splitlines():
        stamp = replay.STAMP.match(line)
        found = replay.STEP.search(line)
        if not (stamp and found):
            continue
        when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        level = next((lv for lv in levels if lv[0] <= when <= lv[1]), None)
        if level is None:
            continue
        row = found.groups()
        trees, granted, fed, decode, ms = int(row[3]), int(row[4]), row[5], row[6], float(row[8])
        if decode != "True":
            continue
        kind = "trees" if trees else ("plain granted" if granted else f"plain one call, fed={fed}")
        kinds[level[2:]][kind].append(ms)
    for (mode, concurrency, round_), by_kind in sorted(kinds.items(), key=lambda item: (item[0][1], item[0][2])):
        parts = [f"{kind} {len(ms)} x {sum(ms) / len(ms):.2f} ms" for kind, ms in sorted(by_kind.items())]
        print(f"{mode:>6} c={concurrency} r={round_}: " + "; ".join(parts))


if __name__ == "__main__":
    main(*sys.argv[1:3])
