"""Token-tree structure of one sequence's step: a fixed chain, then drafted nodes."""

from __future__ import annotations

import functools

import numpy as np
import torch


def validate_tree(parents: list[int] | tuple[int, ...], num_fixed: int) -> str | None:
    """Return why the tree is malformed, or None when it is well formed.

    Node 0 has parent -1 (the committed prefix). Nodes 1..num_fixed-1 form a chain.
    Drafted nodes (index >= num_fixed) hang below node num_fixed-1 and have
    parents that come before them.
    """
    n = len(parents)
    if n == 0:
        return "empty tree: a step item needs at least one token"
    if not 1 <= num_fixed <= n:
        return f"num_fixed must be between 1 and the number of nodes ({n}), got {num_fixed}"
    if parents[0] != -1:
        return f"node 0 must have parent -1, got {parents[0]}"
    for i in range(1, num_fixed):
        if parents[i] != i - 1:
            return (f"the first num_fixed={num_fixed} nodes must form a chain, "
                    f"but node {i} has parent {parents[i]}")
    for i in range(num_fixed, n):
        p = parents[i]
        if p >= i:
            return f"node {i} has parent {p}, which does not come before it"
        if p < num_fixed - 1:
            return f"drafted node {i} has parent {p}, above the last fixed node {num_fixed - 1}"
    return None


def depths(parents: list[int] | tuple[int, ...]) -> list[int]:
    """Depth of each node: 0 for node 0, parent's depth + 1 otherwise."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: list[int] | tuple[int, ...]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when j is i or an ancestor of i. Shared between
    calls with the same tree (a batch repeats few shapes): read it, never write it."""
    return _ancestor_mask(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    # numpy rows: a per-row torch op costs microseconds, and a step builds hundreds of rows.
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return torch.from_numpy(mask)


def children(parents: list[int] | tuple[int, ...]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids
