"""How much to speculate: per request and per step, from a cost model and acceptance statistics.

`never` gives every request budget 0; `always` gives each request whose draft is
ready the fixed budget; `auto` picks, per step, the budgets that maximise
expected committed tokens per second of predicted step time:

    goodput = sum_r (1 + E[accepted | budget_r]) / (T_target(tokens) + T_draft(trees))

Light load: the target's fixed cost dominates, extra tree nodes are nearly free
and trees win. Heavy load: every node costs real compute for all requests, the
draft call adds its own time, and budget 0 wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_service.types import DraftBudget

NO_SPEC = DraftBudget(0, 0, 0)


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "auto"
    steps: int = 5
    topk: int = 4
    draft_tokens: int = 8

    def __post_init__(self) -> None:
        if self.mode not in ("never", "always", "auto"):
            raise ValueError(f"speculation mode must be never, always or auto, got {self.mode!r}")
        if self.steps < 1 or self.topk < 1 or self.draft_tokens < 2:
            raise ValueError("--spec-steps and --spec-topk must be >= 1 and --spec-draft-tokens >= 2")

    @property
    def fixed_budget(self) -> DraftBudget:
        return DraftBudget(self.steps, self.topk, self.draft_tokens)

    def auto_options(self) -> list[DraftBudget]:
        """Budgets `auto` chooses among: a short chain, the configured tree and a wider tree."""
        opts = [DraftBudget(3, 1, 4), self.fixed_budget,
                DraftBudget(self.steps + 1, self.topk * 2, self.draft_tokens * 2)]
        return list(dict.fromkeys(opts))


@dataclass
class CostModel:
    """Predicted wall time of a step, in seconds, from profiled linear fits.

    target: base + per_token * tokens + per_seq * sequences
    draft:  base + per_level * deepest tree + per_expansion * sum(steps * topk)
    A running correction factor per service absorbs drift from the profile.
    """

    target_base: float = 5e-3
    target_per_token: float = 2e-4
    target_per_seq: float = 1e-4
    draft_base: float = 2e-3
    draft_per_level: float = 1e-3
    draft_per_expansion: float = 5e-5
    target_scale: float = 1.0
    draft_scale: float = 1.0

    def target_time(self, tokens: int, seqs: int) -> float:
        return self.target_scale * (self.target_base + self.target_per_token * tokens
                                    + self.target_per_seq * seqs)

    def draft_time(self, budgets: list[DraftBudget]) -> float:
        live = [b for b in budgets if not b.empty]
        if not live:
            return 0.0
        return self.draft_scale * (self.draft_base + self.draft_per_level * max(b.steps for b in live)
                                   + self.draft_per_expansion * sum(b.steps * b.topk for b in live))

    def observe(self, target_pred: float, target_seen: float, draft_pred: float, draft_seen: float) -> None:
        if target_pred > 0 and target_seen > 0:
            self.target_scale = 0.9 * self.target_scale + 0.1 * self.target_scale * target_seen / target_pred
        if draft_pred > 0 and draft_seen > 0:
            self.draft_scale = 0.9 * self.draft_scale + 0.1 * self.draft_scale * draft_seen / draft_pred


@dataclass
class AcceptanceBook:
    """Global acceptance per budget (all requests), the prior for requests with little history."""

    totals: dict[DraftBudget, list[float]] = field(default_factory=dict)
    # Optimism under uncertainty: an untried budget is assumed to accept half its
    # depth, so each budget gets tried while speculation is cheap; two observations
    # weigh as much as the prior.
    prior_share: float = 0.5
    prior_weight: float = 2.0

    def record(self, budget: DraftBudget, accepted: int) -> None:
        s = self.totals.setdefault(budget, [0.0, 0.0])
        s[0] = 0.98 * s[0] + accepted
        s[1] = 0.98 * s[1] + 1.0

    def expected(self, budget: DraftBudget, own: tuple[float, float] | None) -> float:
        """Expected accepted drafted tokens for a request: its own decayed mean blended with
        the global mean, which is in turn blended with the prior."""
        s = self.totals.get(budget, [0.0, 0.0])
        prior = self.prior_share * budget.steps
        glob = (s[0] + prior * self.prior_weight) / (s[1] + self.prior_weight)
        if own is None:
            return glob
        mean, weight = own
        return (mean * weight + glob * 2.0) / (weight + 2.0)


@dataclass(frozen=True)
class Candidate:
    """A decoding request the policy may give a tree to."""

    key: str
    own_stats: dict[DraftBudget, tuple[float, float] | None]  # the request's mean accepted per budget
    mode: str  # the request's effective mode


def choose_budgets(cfg: PolicyConfig, costs: CostModel, book: AcceptanceBook,
                   candidates: list[Candidate], other_tokens: int, other_seqs: int) -> dict[str, DraftBudget]:
    """Budget per candidate. other_tokens/other_seqs: prefill work already in the step.

    For `auto`, each option o is tried on the k requests expected to accept most
    under it, for every k; the (o, k) with the highest goodput wins. That is
    O(options * requests) per step, cheap enough to run every step at batch 256.
    """
    out = {c.key: NO_SPEC for c in candidates}
    auto = []
    for c in candidates:
        if c.mode == "always":
            out[c.key] = cfg.fixed_budget
        elif c.mode == "auto":
            auto.append(c)
    if not auto:
        return out
    fixed = [b for b in out.values() if not b.empty]
    base_tokens = other_tokens + len(candidates) + sum(b.max_nodes for b in fixed)
    base_seqs = other_seqs + len(candidates)
    base_committed = float(len(candidates))  # + the fixed-budget requests' acceptance, same for all choices
    best_rate = base_committed / (costs.target_time(base_tokens, base_seqs) + costs.draft_time(fixed))
    best: tuple[DraftBudget, list[Candidate]] | None = None
    for o in cfg.auto_options():
        ranked = sorted(auto, key=lambda c: -book.expected(o, c.own_stats.get(o)))
        committed, tokens = base_committed, base_tokens
        for k, c in enumerate(ranked, start=1):
            committed += book.expected(o, c.own_stats.get(o))
            tokens += o.max_nodes
            t = costs.target_time(tokens, base_seqs) + costs.draft_time(fixed + [o] * k)
            if committed / t > best_rate * (1 + 1e-9):
                best_rate, best = committed / t, (o, ranked[:k])
    if best is not None:
        for c in best[1]:
            out[c.key] = best[0]
    return out
