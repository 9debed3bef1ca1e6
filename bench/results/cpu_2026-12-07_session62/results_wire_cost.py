"""A verify step's results parsed on the gateway (target_service.wire.results_from_proto), warm and cold, in two
trees of the code.

    python results_wire_cost.py BEFORE_TREE AFTER_TREE [--turns 3]

One sequence that accepted 3 of a tree's nodes (a round at one request), and eight such: the parse of the packed
columns into per-sequence results (the message's own parse not timed). The median over calls run back to back
(warm), and over calls each after a 20 ms sleep (cold, as the gateway runs it after waiting for the step). Each tree
in its own process, the trees in turn. Microseconds.
"""
from two_trees import compare

PROBE = r'''
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, ".")
from target_service.step_batch import StepResults
from target_service.wire import results_from_proto, results_to_proto
from tandem.v1 import target_pb2
figures = {}
for batch in (1, 8):
    results = StepResults(request_ids=tuple(f"r{i}" for i in range(batch)), num_accepted=np.full(batch, 3, np.int32),
                          accepted_nodes=np.tile(np.arange(8, dtype=np.int32), (batch, 1)),
                          new_tokens=np.tile(np.arange(8, dtype=np.int32), (batch, 1)),
                          logprobs=np.zeros((batch, 8), np.float32), num_committed=np.full(batch, 100, np.int64))
    data = results_to_proto(results, np.arange(batch)).SerializeToString()
    ids = results.request_ids
    def parse():
        msg = target_pb2.PackedResults.FromString(data)
        t0 = time.perf_counter_ns()
        results_from_proto(msg, ids)
        return time.perf_counter_ns() - t0
    warm = statistics.median(parse() / 1e3 for _ in range(400))
    cold = []
    for _ in range(100):
        time.sleep(0.02)
        cold.append(parse() / 1e3)
    figures[batch] = {"warm_us": warm, "cold_us": statistics.median(cold)}
print(json.dumps(figures))
'''


if __name__ == "__main__":
    raise SystemExit(compare(__doc__, PROBE))
