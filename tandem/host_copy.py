"""Host arrays onto a device without waiting for the GPU."""

from __future__ import annotations

import numpy as np
import torch


def to_device_queued(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` on `device`, the copy queued. A copy from pageable memory makes torch wait for the GPU (it
    synchronises the stream); from pinned memory (torch's cache of it, which keeps the block until the copy has
    run) the host goes on. Off a GPU: the array's own memory, no copy."""
    host = torch.from_numpy(values)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
