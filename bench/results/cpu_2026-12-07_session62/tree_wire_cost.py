"""Draft trees packed on the draft and parsed on the gateway (draft_service.tree_wire), warm and cold, in two trees
of the code.

    python tree_wire_cost.py BEFORE_TREE AFTER_TREE [--turns 3]

One tree of 8 nodes (a call at one request, 5/4/8) and eight such trees: trees_to_proto with the reply's
serialisation, and trees_from_proto on the parsed reply (the parse itself not timed). The median over calls run
back to back (warm), and over calls each after a 20 ms sleep (cold, as each side runs it after a wait). Each tree
in its own process, the trees in turn. Microseconds.
"""
from two_trees import compare

PROBE = r'''
import json, statistics, sys, time
sys.path.insert(0, ".")
from draft_service.tree_wire import trees_from_proto, trees_to_proto
from draft_service.types import DraftTree
from tandem.v1 import draft_pb2
def tree(i):
    return DraftTree(f"r{i}", 5, 100, [1, 2, 3, 4, 5, 6, 7, 8], [-1, 0, 0, 1, 2, 3, 4, 5], [1, 2, 2, 3, 3, 4, 4, 5],
                     [-0.1] * 8, [-0.2] * 8)
figures = {}
for batch in (1, 8):
    trees = [tree(i) for i in range(batch)]
    data = draft_pb2.DraftResponse(packed=trees_to_proto(trees)).SerializeToString()
    def pack():
        t0 = time.perf_counter_ns()
        draft_pb2.DraftResponse(packed=trees_to_proto(trees)).SerializeToString()
        return time.perf_counter_ns() - t0
    def parse():
        msg = draft_pb2.DraftResponse.FromString(data)
        t0 = time.perf_counter_ns()
        trees_from_proto(msg.packed)
        return time.perf_counter_ns() - t0
    for name, fn in (("pack", pack), ("parse", parse)):
        warm = statistics.median(fn() / 1e3 for _ in range(400))
        cold = []
        for _ in range(100):
            time.sleep(0.02)
            cold.append(fn() / 1e3)
        figures[f"{name} {batch}"] = {"warm_us": warm, "cold_us": statistics.median(cold)}
print(json.dumps(figures))
'''


if __name__ == "__main__":
    raise SystemExit(compare(__doc__, PROBE, lambda key: f"{key:8s}:"))
