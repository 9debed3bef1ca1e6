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


def top_children(logprobs: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k best children of each row of [rows, vocab] log-probs, ranked as `ranked` does,
    as host lists. The sort runs where the log-probs are (the GPU for a GPU draft): one
    small copy for all rows instead of every row's full vocabulary."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return ids[:, :k].cpu().tolist(), values[:, :k].double().cpu().tolist()


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
        ids, lps = top_children(logprobs, self.budget.topk)
        return self.expand_ranked(ids, lps)

    def expand_ranked(self, child_ids: list[list[int]], child_lp: list[list[float]]) -> list[int]:
        """expand() from each expanded node's children already ranked (top_children): rows
        as in expand(), at least topk columns (extra ones are ignored)."""
        k = self.budget.topk
        parents = [-1] if self.level == 0 else self.frontier
        if len(child_ids) != len(parents):
            raise ValueError(f"expected {len(parents)} rows of children, got {len(child_ids)}")
        first = len(self.tokens)
        for p, ids, lps in zip(parents, child_ids, child_lp):
            base = 0.0 if p < 0 else self.scores[p]
            self.tokens += ids[:k]
            self.parents += [p] * k
            self.levels += [self.level] * k
            self.logprobs += lps[:k]
            self.scores += [base + lp for lp in lps[:k]]  # float64: fewer ties
        # A few dozen candidates: a Python sort (same order as `ranked`) beats a torch call.
        new = self.scores[first:]
        best = sorted(range(len(new)), key=lambda i: (-new[i], i))[:k]
        self.frontier = sorted(first + i for i in best)
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
