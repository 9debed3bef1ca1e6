"""The push's store on the draft (TargetFeatureReader._take_batch), warm and cold, in two trees of the code.

    python store_cost.py BEFORE_TREE AFTER_TREE [--turns 3]

One sequence's push (4 rows of 768 float32 values in the message, 4 next tokens), as at one request: the
median over calls run back to back (warm), and over calls each after a 20 ms sleep (cold, as a served push
comes after a step's wait). Each tree in its own process, the trees in turn. Microseconds.
"""
from two_trees import compare

PROBE = r'''
import json, statistics, sys, time
import numpy as np, torch
sys.path.insert(0, ".")
from draft_service.target_features import TargetFeatureReader
from tandem.tensors import array_to_proto, tensor_to_proto
from tandem.v1 import target_pb2
reader = TargetFeatureReader("127.0.0.1:1", subscribe=False, on_push=lambda pushes: None)
def message(pos):
    return target_pb2.FeatureRows(
        request_ids=["r0"], start_positions=array_to_proto(np.array([pos], np.int64)),
        row_counts=array_to_proto(np.array([4], np.int64)), features=tensor_to_proto(torch.randn(4, 768)),
        next_tokens=array_to_proto(np.array([5, 6, 7, -1], np.int32)))
def timed(n, pause):
    out = []
    for i in range(n):
        msg = message(4 * i)
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter_ns()
        reader._take_batch(msg)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(out)
print(json.dumps({"": {"warm_us": timed(500, 0), "cold_us": timed(150, 0.02)}}))
'''


if __name__ == "__main__":
    raise SystemExit(compare(__doc__, PROBE, lambda key: ""))
