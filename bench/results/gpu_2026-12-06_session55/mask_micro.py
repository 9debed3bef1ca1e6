"""Host cost of a segment's causal mask: torch.ones().tril() against numpy's tri, per call (median and max).

    python bench/results/gpu_2026-12-06_session55/mask_micro.py
"""
import statistics
import time

import numpy as np
import torch


def per_call_us(fn, n: int, reps: int = 200) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times), 1e6 * max(times)


for n in (8, 72, 190, 512):
    t = per_call_us(lambda k: torch.ones(k, k, dtype=torch.bool).tril(), n)
    m = per_call_us(lambda k: torch.from_numpy(np.tri(k, dtype=bool)), n)
    print(f"threads {torch.get_num_threads()} n {n:4d}: torch ones+tril median {t[0]:8.1f} us (max {t[1]:8.1f}); "
          f"numpy tri median {m[0]:6.1f} us (max {m[1]:8.1f})", flush=True)
