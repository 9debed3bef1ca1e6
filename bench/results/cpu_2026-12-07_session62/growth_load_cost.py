"""A draft growth's input load (BatchTreeGrowth.load), warm and cold, in two trees of the code.

    python growth_load_cost.py BEFORE_TREE AFTER_TREE [--turns 3]

The tiny draft pair of the tests (Triton attention's metadata, CPU, no graph), budget 5/4/8, a call of
1 and of 8 requests, each call like the last (the served case at a steady load): the median over loads
run back to back (warm), and over loads each after a 20 ms sleep (cold). Each tree in its own process,
the trees in turn. Microseconds.
"""
from two_trees import compare

PROBE = r'''
import json, statistics, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, ".")
from draft_service.device_tree import BatchTreeGrowth, GrowthShape
from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget
import os; os.environ.setdefault("TRITON_INTERPRET", "1"); torch.set_num_threads(1)
from tests.tiny_models import make_tiny_llama
from tests.tiny_draft import make_tiny_eagle3
root = Path(tempfile.mkdtemp())
target = make_tiny_llama(root / "t", "gqa")
model = Eagle3Draft(make_tiny_eagle3(root / "d", target, seed=31), target, attention_backend="triton")
kv = DraftEngine(model, num_blocks=64, block_size=4).kv
figures = {}
for batch in (1, 8):
    growth = BatchTreeGrowth(model, kv, GrowthShape(batch=batch, budget=DraftBudget(5, 4, 8)), capture=False)
    h = [torch.randn(model.cfg.hidden_size) for _ in range(batch)]
    def timed(n, pause):
        out = []
        for i in range(n):
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter_ns()
            growth.load(h, [100 + i + b for b in range(batch)], list(range(batch)), kv.block_table.padding_row)
            out.append((time.perf_counter_ns() - t0) / 1e3)
        return statistics.median(out)
    figures[batch] = {"warm_us": timed(500, 0), "cold_us": timed(150, 0.02)}
print(json.dumps(figures))
'''


if __name__ == "__main__":
    raise SystemExit(compare(__doc__, PROBE))
