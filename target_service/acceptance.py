"""Deciding which drafted nodes a step keeps, and sampling the bonus token.

Greedy: walk from the last fixed node; at each level accept the child whose
token is the target's argmax at its parent. Sampling (EAGLE's tree rule for
deterministic drafts): at each level try the children in order, accepting
child x with probability p(x) under the current distribution; on rejection
set p(x) = 0 and renormalise; if every child is rejected, sample the bonus
token from what remains. The result is distributed exactly as plain sampling
from the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """A seed for the draw that decides the token at `position` (splitmix64)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p. logits: [V]."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if 0 < top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


@dataclass(frozen=True)
class Acceptance:
    accepted: list[int]  # drafted node indices, root first
    bonus: int  # token sampled after the deepest accepted node


def accept_greedy(tokens: list[int], kids: list[list[int]], root: int,
                  argmax_of: Mapping[int, int]) -> Acceptance:
    """argmax_of[n]: the target's most likely token after node n."""
    accepted: list[int] = []
    node = root
    while True:
        best = argmax_of[node]
        nxt = next((c for c in kids[node] if tokens[c] == best), None)
        if nxt is None:
            return Acceptance(accepted, best)
        accepted.append(nxt)
        node = nxt


def accept_child_rule(p_x: float, u: float) -> bool:
    """Accept a drafted child with probability p(x). Replaced by tests to prove they catch a bad rule."""
    return u < p_x


def accept_sampling(tokens: list[int], kids: list[list[int]], root: int,
                    probs_of: dict[int, torch.Tensor], seed: int, root_position: int,
                    node_depth: list[int]) -> Acceptance:
    """`root_position` is the absolute position of the root node; the token chosen
    below node n lands at root_position + depth(n) - depth(root) + 1."""
    accepted: list[int] = []
    node = root
    while True:
        position = root_position + node_depth[node] - node_depth[root] + 1
        gen = torch.Generator().manual_seed(draw_seed(seed, position))
        p = probs_of[node].clone()
        nxt = None
        for c in kids[node]:
            total = float(p.sum())
            p_x = float(p[tokens[c]]) / total if total > 0 else 0.0
            if accept_child_rule(p_x, float(torch.rand((), generator=gen))):
                nxt = c
                break
            p[tokens[c]] = 0.0
        if nxt is None:
            if float(p.sum()) <= 0:  # every token with mass was drafted and rejected: cannot happen
                p = probs_of[node]  # with exact arithmetic; fall back to the unmodified distribution
            return Acceptance(accepted, int(torch.multinomial(p / p.sum(), 1, generator=gen)))
        accepted.append(nxt)
        node = nxt
