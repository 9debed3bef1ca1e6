"""A verify step's items packed on the gateway (gateway.clients.TargetClient._call's packing), warm and cold.

    python step_pack_cost.py REPO [--turns 3]

One tree item of 8 nodes (a round at one request) and eight: the batch's path (StepBatch.from_items, then
batch_to_proto) against the items' own (items_to_proto, new in the sixty-second session), each with the message's
serialisation; the median over calls run back to back (warm), and over calls each after a 20 ms sleep (cold, as the
gateway packs a step after waiting for the draft). Both in one process, in turn. Microseconds.
"""
import argparse
import json
import subprocess
import sys

PROBE = r'''
import json, statistics, sys, time
sys.path.insert(0, ".")
from target_service.step_batch import StepBatch
from target_service.types import SequenceStep
from target_service.wire import batch_to_proto, items_to_proto
figures = {}
for batch in (1, 8):
    items = [SequenceStep(f"r{i}", (5, 9, 11, 12, 13, 14, 15, 16, 17), (-1, 0, 0, 1, 2, 3, 4, 5, 6), 1,
                          return_features=True, sample_is_output=True) for i in range(batch)]
    ways = {"batch": lambda: batch_to_proto(StepBatch.from_items(items)).SerializeToString(),
            "items": lambda: items_to_proto(items).SerializeToString()}
    for name, fn in ways.items():
        def timed():
            t0 = time.perf_counter_ns()
            fn()
            return (time.perf_counter_ns() - t0) / 1e3
        warm = statistics.median(timed() for _ in range(400))
        cold = []
        for _ in range(100):
            time.sleep(0.02)
            cold.append(timed())
        figures[f"{name} {batch}"] = {"warm_us": warm, "cold_us": statistics.median(cold)}
print(json.dumps(figures))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo")
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    for turn in range(1, args.turns + 1):
        out = subprocess.run([sys.executable, "-c", PROBE], cwd=args.repo, capture_output=True, text=True, check=True)
        for what, figures in json.loads(out.stdout).items():
            print(f"turn {turn} {what:8s}: warm {figures['warm_us']:6.1f} us  cold {figures['cold_us']:6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
