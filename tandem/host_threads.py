"""How many OpenMP threads a service's torch uses for its CPU ops.

A service whose model runs on a GPU does little on the host but launch kernels and build small tensors. On an
H100 host the forty-fourth session's profiles of the draft's eager catch-ups read 1.7-4 ms for single torch CPU
ops (tril at 72 and 190 positions, fill at 190 but 7 us at 72, a cat of 1,152 feature rows 34 ms), which take
microseconds on the dev machine: as if each call waited to enter an OpenMP parallel region (tril's at any size,
fill's above torch's grain of 32,768 elements). With one thread they run serially. vLLM's GPU workers make the
same choice. An explicit OMP_NUM_THREADS always wins.
"""

from __future__ import annotations

import logging
import os

import torch

from tandem.cpu_quota import usable_cores

log = logging.getLogger(__name__)


def default_threads(device: str, cpus: int | None = None) -> int:
    """The threads a service on `device` starts with when OMP_NUM_THREADS is unset: one on a GPU; on the CPU,
    where the model itself runs on these threads, a third of the cores (three processes share them)."""
    cpus = usable_cores() if cpus is None else cpus  # a container's CPU quota counts (tandem/cpu_quota.py)
    return 1 if device == "cuda" else max(1, cpus // 3)


def limit_for_gpu(device: str) -> bool:
    """For a service started on its own (not by `tandem serve`, which sets the variable for its children): with
    `device` "cuda" and OMP_NUM_THREADS unset, one thread here and in the processes this one starts (a TP
    target's ranks). Returns whether it changed anything."""
    if device != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return False
    threads = default_threads(device)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    log.info("%d OpenMP thread(s) for torch's CPU ops (was %d): the model runs on the GPU; set OMP_NUM_THREADS to "
             "choose", threads, was)
    return True
