"""A call's inputs on their way to the device: a pinned host buffer and its device twin.

A copy from pageable memory makes torch wait for the GPU (it synchronises the stream), so
a draft call that copied each input that way waited for the catch-up graph before it could
load the growth's inputs, a dozen times a call (BENCHMARKS.md, the draft call's profile).
From a pinned buffer the copy is queued and the host goes on. The host side is written
again only once the last copy from it has run (an event), so a copy never reads a
buffer the next call is filling.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class StagedInput:
    """host (pinned where the device is CUDA) and device, both of `shape` and `dtype`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        pinned = device.type == "cuda"
        self.device = torch.zeros(shape, dtype=dtype, device=device)
        self._host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        self._sent = torch.cuda.Event() if pinned else None

    def host(self) -> torch.Tensor:
        """The host buffer, once the last copy from it has run."""
        if self._sent is not None:
            self._sent.synchronize()
        return self._host

    def send(self, rows: int | None = None) -> None:
        """Copy the first `rows` rows (all when None) to the device, without waiting for the copy."""
        src, dst = (self._host, self.device) if rows is None else (self._host[:rows], self.device[:rows])
        dst.copy_(src, non_blocking=self._sent is not None)
        if self._sent is not None:
            self._sent.record()


def staged_chunks(stage: StagedInput, runs: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Host rows on their way to the device through `stage`, as many at a time as it holds: `runs` are
    blocks of rows [n, width], taken in order as one sequence of rows (a run may span two chunks). Yields
    (the chunk's first row, the chunk on the device). Use each chunk before asking for the next: the next
    one is copied into the same device rows (after, in stream order, whatever the caller queued on this one)."""
    size = stage.device.shape[0]
    at = filled = 0
    host: torch.Tensor | None = None
    for run in runs:
        taken = 0
        while taken < run.shape[0]:
            if host is None:
                host = stage.host()
            n = min(size - filled, run.shape[0] - taken)
            host[filled: filled + n].copy_(run[taken: taken + n])
            filled, taken = filled + n, taken + n
            if filled == size:
                stage.send(size)
                yield at, stage.device[:size]
                at, filled, host = at + size, 0, None
    if filled:
        stage.send(filled)
        yield at, stage.device[:filled]
