"""A request's target features, by position, kept in the blocks they arrived in.

The target sends a step's rows (or a joining prompt's) as one tensor [rows, width]. Taking it apart
into a tensor per position, then stacking those rows again for the forward, was most of the draft's
host time in a joining prompt's catch-up: under torch.profiler on an H100, 513 `select`s (1.55 ms)
and the stack's `cat` (2.6 ms) of a 512-position prompt's 8.1 ms. Here a position points into its
block, and a segment's rows come out as the runs of consecutive rows they form: usually one per
block, copied in one call each. One such prompt's catch-up went from 5.7-6.1 to 3.5-3.6 ms, four of
them from 16.2-16.3 to 7.2-7.5 ms (`bench/catch_up_cost.py`, H100, 2026-12-06).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class FeatureRows:
    """Feature rows by position, each a row of the block it came in."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[torch.Tensor, int]] = {}

    def put(self, start: int, block: torch.Tensor, first: int = 0) -> None:
        """Rows first.. of `block` are the features of positions start + first, ...; a later put of a
        position replaces the row an earlier one gave it."""
        for i in range(first, block.shape[0]):
            self._at[start + i] = (block, i)

    def __contains__(self, position: int) -> bool:
        return position in self._at

    def __len__(self) -> int:
        return len(self._at)

    def __iter__(self) -> Iterator[int]:
        return iter(self._at)

    def row(self, position: int) -> torch.Tensor | None:
        """The feature row of `position` ([width]), or None when there is none."""
        found = self._at.get(position)
        return None if found is None else found[0][found[1]]

    def drop(self, start: int, stop: int) -> None:
        """Forget positions start..stop-1 (computed: their features are no longer needed)."""
        for p in range(start, stop):
            self._at.pop(p, None)

    def runs(self, positions: Iterable[int]) -> list[torch.Tensor]:
        """The rows of `positions` (each must have one), in their order, as slices [n, width] of their
        blocks: consecutive rows of one block make one slice."""
        out: list[torch.Tensor] = []
        block: torch.Tensor | None = None
        first = end = 0
        for p in positions:
            got, i = self._at[p]
            if got is block and i == end:
                end += 1
                continue
            if block is not None:
                out.append(block[first:end])
            block, first, end = got, i, i + 1
        if block is not None:
            out.append(block[first:end])
        return out

