"""EAGLE-2/3 dynamic tree growth for one request, independent of the model.

Level 0 takes the root's top-k children. Every later level takes the top-k
children of each of the k frontier nodes; a child's score is its parent's score
plus its own log-prob (a cumulative log-prob), and the best k of those k*k
become the next frontier. Every child looked at is a candidate. After `steps`
levels the best num_draft_tokens - 1 candidates are kept (SGLang counts the
root in num_draft_tokens) and ordered by level, so parents precede children.

A kept node's parent is always kept: scores never increase along a path, and
ties are broken towards the earlier candidate (a parent is created before its
children), so the parent ranks at least as high as any of its children.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_service.types import DraftBudget


def ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best scores along the last dim, ties to the lower index (deterministic)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


@dataclass
class TreeGrowth:
    budget: DraftBudget
    tokens: list[int] = field(default_factory=list)  # draft-vocabulary ids, one per candidate
    parents: list[int] = field(default_factory=list)  # parent candidate, -1 for the root
    levels: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # candidates to expand at the next level
    level: int = 0  # levels expanded so far

    @property
    def done(self) -> bool:
        return self.budget.empty or self.level >= self.budget.steps

    def expand(self, logprobs: torch.Tensor) -> list[int]:
        """Add the next level given log-probs [rows, vocab] below the nodes being expanded:
        one row (the root) at level 0, one per frontier node after. Returns the new frontier."""
        k = self.budget.topk
        parents = [-1] if self.level == 0 else self.frontier
        if logprobs.shape[0] != len(parents):
            raise ValueError(f"expected {len(parents)} rows of log-probs, got {logprobs.shape[0]}")
        logprobs = logprobs.double().cpu()  # scores add up in float64: fewer ties
        child_ids = ranked(logprobs, k)  # [rows, k]
        child_lp = logprobs.gather(1, child_ids)
        base = torch.tensor([0.0 if p < 0 else self.scores[p] for p in parents], dtype=torch.float64)[:, None]
        cand_scores = (base + child_lp).flatten()
        first = len(self.tokens)
        self.tokens += child_ids.flatten().tolist()
        self.parents += [p for p in parents for _ in range(k)]
        self.levels += [self.level] * cand_scores.numel()
        self.logprobs += child_lp.flatten().tolist()
        self.scores += cand_scores.tolist()
        self.frontier = sorted(first + i for i in ranked(cand_scores, k).tolist())
        self.level += 1
        return self.frontier

    def select(self) -> list[int]:
        """Candidates to return, ordered by creation (so by level: parents first)."""
        n = min(self.budget.max_nodes, len(self.tokens))
        if n <= 0:
            return []
        # Candidates are stored in creation order, so the stable sort breaks score
        # ties towards parents and earlier siblings.
        return sorted(ranked(torch.tensor(self.scores, dtype=torch.float64), n).tolist())
