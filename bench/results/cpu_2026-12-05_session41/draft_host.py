"""The host's share of a draft call at batch 1 (tiny random head, CPU, one thread, budget 5/4/8, prefix 128,
3 tokens ingested a call): the whole call, its catch-up and its growth, with their compute and then with the
catch-up's and the growth's run() doing nothing (what is left is Python, numpy and tensor bookkeeping).

    PYTHONPATH=. python bench/results/cpu_2026-12-05_session41/draft_host.py
"""

import statistics
import time

import torch

from bench import draft_step
from draft_service import catch_up, device_tree
from draft_service.engine import DraftEngine
from draft_service.types import DraftBudget

CALLS = 200


def measure(model, tag: str) -> None:
    engine = DraftEngine(model, num_blocks=4096, block_size=16)
    parts: dict[str, list[float]] = {"catch_up": [], "grow": []}
    catch_up_of, grow_of = engine._catch_up, engine._grow

    def timed_catch_up(ids):
        t0 = time.perf_counter()
        catch_up_of(ids)
        parts["catch_up"].append(time.perf_counter() - t0)

    def timed_grow(items):
        t0 = time.perf_counter()
        trees = grow_of(items)
        parts["grow"].append(time.perf_counter() - t0)
        return trees

    engine._catch_up, engine._grow = timed_catch_up, timed_grow
    whole = [draft_step.time_calls(engine, 1, 128, DraftBudget(5, 4, 8), 2, CALLS, "cpu") for _ in range(3)]
    print(f"{tag}: whole call {1e6 * statistics.median(whole):.0f} us; "
          f"catch-up {1e6 * statistics.median(parts['catch_up']):.0f} us; "
          f"growth {1e6 * statistics.median(parts['grow']):.0f} us")


def main() -> None:
    torch.set_num_threads(1)
    parser = draft_step.argparse.ArgumentParser()
    draft_step.add_head_arguments(parser)
    model = draft_step.head_from_args(parser.parse_args(["--tiny"])).model
    measure(model, "real compute")
    catch_up.BatchCatchUp.run = lambda self: None
    device_tree.BatchTreeGrowth.run = lambda self: None
    measure(model, "compute stubbed")


if __name__ == "__main__":
    main()
