"""The wait before a served call, for benchmarks that time calls back to back.

In a serve a service's call comes after the other services' work (the target's verify before a Draft
call, the draft's call and the gateway's hops before a step): its host slept meanwhile and its caches
went to other work, so the call's host part runs cold. A benchmark that times calls back to back runs
them warm, and the served timelines ran the same engines 0.5-0.9 ms slower (BENCHMARKS.md, "A round hop
by hop"). `--pause-ms` in bench/draft_step.py and bench/engine_step.py waits this way before each timed
call: the host asleep, and a GPU kept busy meanwhile (a spin kernel), as the other service's step keeps it,
so that its clocks do not drop.
"""

from __future__ import annotations

import time

import torch

SPIN_CYCLES_PER_S = 1.5e9  # a spin kernel's clock cycles a second: about the H100's and H200's SM clock


def wait_as_served(pause_s: float, device: str) -> None:
    """Sleep pause_s with the GPU (if any) busy meanwhile; the caller synchronizes after it."""
    if pause_s <= 0:
        return
    if device.startswith("cuda"):
        torch.cuda._sleep(int(pause_s * SPIN_CYCLES_PER_S))
    time.sleep(pause_s)
