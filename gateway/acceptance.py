"""What trees accept: the acceptance book (per budget, per level of verified main paths, a request's own figures
blended with the workload's) and how far requests differ (Spread)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from draft_service.types import DraftBudget


class MainPath(NamedTuple):
    """A verified tree's main path (the best-scored child of each node on it, from the root): its
    depth, and how many of its nodes, from the root on, were accepted."""

    depth: int
    accepted: int


def main_path(parents: list[int], scores: list[float], accepted_nodes: list[int]) -> MainPath | None:
    """The main path of a verified tree (node i's parent parents[i], -1 the root; accepted_nodes the
    accepted nodes from the root on). None for a tree without scores: its main path is not known."""
    if len(scores) != len(parents):
        return None
    best: dict[int, int] = {}  # parent -> its best-scored child (the first of equals)
    for node, parent in enumerate(parents):
        rival = best.get(parent)
        if rival is None or scores[node] > scores[rival]:
            best[parent] = node
    path = []
    node = best.get(-1)
    while node is not None:
        path.append(node)
        node = best.get(node)
    run = 0
    while run < len(path) and run < len(accepted_nodes) and accepted_nodes[run] == path[run]:
        run += 1
    return MainPath(len(path), run)


@dataclass
class LevelRates:
    """Acceptance per level of verified trees' main paths: per level, the decayed count of paths that
    reached it (every level above it accepted) and of those that accepted it. A level is judged only
    where its prefix was accepted, so a deep level's rate is not pulled down by misses above it."""

    decay: float = 0.98
    levels: list[list[float]] = field(default_factory=list)  # index k: level k + 1, [accepted, reached]

    def record(self, path: MainPath) -> None:
        for k in range(min(path.accepted + 1, path.depth)):
            if k == len(self.levels):
                self.levels.append([0.0, 0.0])
            level = self.levels[k]
            level[0] = self.decay * level[0] + (k < path.accepted)
            level[1] = self.decay * level[1] + 1.0

    def fade(self, factor: float) -> None:
        for level in self.levels:
            level[0] *= factor
            level[1] *= factor


def chains_would_accept(path: MainPath | None, options: Iterable[DraftBudget],
                        drafted: DraftBudget) -> list[tuple[DraftBudget, int]]:
    """What each chain among `options` (topk 1, other than the budget `drafted`) would have accepted at
    this position, read off a verified tree's main path: (option, accepted) where the tree says it exactly.

    A chain drafts the draft's best child at every level, so its tokens are the tree's main path. A
    chain of depth d accepts the main path's accepted prefix, up to d. A chain deeper than the main path
    is left out whatever was accepted: where the main path was accepted whole, what the chain would
    accept below is not known, and recording it only where the main path failed early would teach it
    its misses and none of its successes. (LevelRates learns every level the main path
    reached, which prices deeper chains without that bias.) Wider trees are not inferred: their nodes
    off the main path are not the verified tree's.

    Why: each option's acceptance was learned only from its own trees, so figures that a few trees at
    a request's hardest positions had set stayed until the option ran again; which tree auto settled
    on turned on them (BENCHMARKS.md, sixth session: at 4 requests on the CPU, chains in one run and
    5/4/8 trees in the next). Every verified tree now also measures the chains, at the same positions
    as the tree it chose. (The scale track's forced acceptance sets only the main path right: there
    this is exact for every tree.) A tree without scores (path None) says nothing."""
    if path is None:
        return []
    return [(option, min(path.accepted, option.steps)) for option in options
            if option.topk == 1 and option != drafted and option.steps <= path.depth]


@dataclass
class Spread:
    """How far one figure (a budget's accepted tokens a tree, or whether a main path's first level was accepted)
    differs from request to request beyond its trees' own draws: decayed sums over ended requests, read by the
    method of moments. Each request adds its trees' count, sum and sum of squares; the within-request variance
    is pooled over requests, the between-request variance is the variance of the requests' means less what their
    draws alone would spread them (within / trees, averaged). Their ratio is how many of a request's trees the
    population's figure is worth against them (a normal prior's weight; a beta prior's strength is one less)."""

    decay: float = 0.97  # per ended request: about the last 30
    requests: float = 0.0
    means: float = 0.0  # sums of the requests' means and of their squares
    mean_squares: float = 0.0
    inverse_trees: float = 0.0  # sum of 1 / trees
    within: float = 0.0  # sum of (trees - 1) x a request's variance over its trees
    within_df: float = 0.0  # sum of (trees - 1)

    MIN_TREES = 4  # a request with fewer trees of the figure says little of its spread

    def add(self, trees: float, total: float, squares: float) -> None:
        if trees < self.MIN_TREES:
            return
        mean = total / trees
        variance = max(0.0, (squares - total * mean) / (trees - 1))
        d = self.decay
        self.requests = d * self.requests + 1.0
        self.means = d * self.means + mean
        self.mean_squares = d * self.mean_squares + mean * mean
        self.inverse_trees = d * self.inverse_trees + 1.0 / trees
        self.within = d * self.within + (trees - 1) * variance
        self.within_df = d * self.within_df + (trees - 1)

    def weight(self, min_requests: float, low: float, high: float, prior_strength: bool = False) -> float | None:
        """Within variance over between variance, within [low, high]; None before `min_requests` have ended."""
        if self.requests < max(min_requests, 2.0) or self.within_df <= 0:
            return None
        within = self.within / self.within_df
        means_variance = (self.mean_squares - self.means ** 2 / self.requests) / (self.requests - 1.0)
        between = means_variance - within * self.inverse_trees / self.requests
        if between <= 0:
            return high  # the requests' means differ no more than their draws explain
        if within <= 0:
            return low  # every tree of a request alike: its own figure is exact
        return min(high, max(low, within / between - (1.0 if prior_strength else 0.0)))


@dataclass
class AcceptanceBook:
    """Global acceptance per budget (all requests), the prior for requests with little history."""

    totals: dict[DraftBudget, list[float]] = field(default_factory=dict)
    # Per record: the book keeps about 1 / (1 - DECAY) recent trees of each budget. Why so many: the book
    # is the prior of requests with little history of their own, so it should hold the workload's
    # acceptance, not its last few prompts'. At 0.98 (about 50 trees) on the H100 scale track at 0.6,
    # where a tree's acceptance is drawn afresh and 5/4/8 trees accepted 1.35, the book read 1.59-1.69
    # as each level began, the tail of the level before (2026-12-06): the configured tree's
    # predicted tokens read 1.10-1.16x `always`'s at 8-64 requests. One standard deviation of such a mean
    # at that acceptance is 0.14 over 50 trees, 0.07 over 200.
    DECAY = 0.995
    # Optimism under uncertainty: an untried budget is assumed to accept half its
    # depth, so each budget gets tried while speculation is cheap; two observations
    # weigh as much as the prior.
    prior_share: float = 0.5
    prior_weight: float = 2.0
    # A request's own figures (its trees' acceptance per budget, its main paths' per level) are blended with
    # the book's as if the book's were this many of the request's trees (paths).
    own_weight: float = 2.0
    # Where set, each figure's weight is estimated instead from the auto requests that ended (request_ended):
    # how far their figures differed beyond what their trees' draws explain (see Spread). Where requests are
    # alike, a request's own few trees only add noise to the book's many; where they differ, its own figures
    # are the better guess. In `bench/option_sim.py` (common draws, 0.6, 128-token requests, 2026-12-07) a
    # fixed weight of 8 against 2 gained 1.3% at one request where requests were alike and lost 3.8% where
    # their acceptance spread +-0.35; no fixed weight was best for both. Until `spread_requests` have ended
    # for a figure (a decayed count: about the tenth request), `own_weight` holds for it.
    own_weight_from_spread: bool = False
    spread_requests: float = 8.0
    own_weight_bounds: tuple[float, float] = (1.0, 32.0)
    # budget -> how its per-request means spread; None -> the main paths' first level (accepted or not)
    spreads: dict[DraftBudget | None, Spread] = field(default_factory=dict)
    # Once auto stops speculating nothing refreshes these figures (nor the cost model's
    # ratio for steps with trees), so a few unlucky trees (the first steps after a prompt
    # are the hardest to guess) would rule speculation out for the life of the server.
    # After `explore_after` steps in which auto had candidates and chose no tree, the
    # most promising one gets a tree anyway. A draft that is never right costs one tree
    # per `explore_after` quiet steps: bounded, unlike fading the evidence towards the
    # prior, whose retry rate grows as speculation looks cheaper (tried: with a random
    # draft on the demo target, 23% of a lone request's steps went to trees).
    # The gateway's dormancy stops this count short (a dormant request is no candidate,
    # and auto requests go dormant after GatewayCore.QUIET_STEPS < explore_after quiet
    # steps), so the gateway also asks for a tree just before they go dormant (`explore`).
    explore_after: int = 32
    quiet_steps: int = 0  # steps since auto last chose a tree
    explored: bool = False  # the last choice's auto trees were exploration: the figures chose none
    speculating: bool = False  # the figures chose the last choice's auto trees (see KEEP_TREES_WITHIN)
    # A decline that rests on fewer trees than this (decayed count, all budgets) is thin: the first
    # trees after a prompt are the hardest to guess (demo pair, first held-out prompt: 0.6 accepted
    # per 3-token chain over its first 11 trees, 2.3 after), so the gateway explores more often
    # until the book holds this much (GatewayCore._explore_now).
    thin_evidence: float = 8.0
    # Acceptance per level of every verified tree's main path: what prices the depth options.
    levels: LevelRates = field(default_factory=lambda: LevelRates(decay=AcceptanceBook.DECAY))

    def __post_init__(self) -> None:
        if self.prior_weight < 1.0:  # optimistic's ln N must not be negative
            raise ValueError(f"prior_weight must be at least 1, got {self.prior_weight}")
        if self.own_weight < 0.0:
            raise ValueError(f"own_weight must be at least 0, got {self.own_weight}")
        low, high = self.own_weight_bounds
        if not 0.0 <= low <= high:
            raise ValueError(f"own_weight_bounds must be 0 <= low <= high, got {self.own_weight_bounds}")

    def request_ended(self, budgets: dict[DraftBudget, list[float]], first_level: tuple[float, float]) -> None:
        """An auto request ended: its raw figures (AcceptanceStats.raw and .first_level) join the spreads (kept only
        where they set the weight)."""
        if not self.own_weight_from_spread:
            return
        for budget, (trees, total, squares) in budgets.items():
            self.spreads.setdefault(budget, Spread()).add(trees, total, squares)
        paths, accepted = first_level
        self.spreads.setdefault(None, Spread()).add(paths, accepted, accepted)  # 0 or 1 a path: squares = sum

    def own_weight_for(self, budget: DraftBudget | None) -> float:
        """How many of a request's own trees (None: main paths, per level) the book's figure weighs as. A budget
        too few ended requests drafted takes the weight of the one most did: how far requests differ is a
        property of the workload more than of the tree, and the fixed weight would let a few lucky trees of a
        rarely drafted budget decide where the workload's requests are alike."""
        if not self.own_weight_from_spread:
            return self.own_weight
        low, high = self.own_weight_bounds
        # A level's rate is blended as a beta prior, whose strength is one less than the ratio (beta-binomial).
        spread = self.spreads.get(budget)
        weight = None if spread is None else spread.weight(self.spread_requests, low, high,
                                                            prior_strength=budget is None)
        if weight is None and budget is not None:
            most = max((spread for key, spread in self.spreads.items() if key is not None),
                       key=lambda spread: spread.requests, default=None)
            weight = None if most is None else most.weight(self.spread_requests, low, high)
        return self.own_weight if weight is None else weight

    def record(self, budget: DraftBudget, accepted: int) -> None:
        s = self.totals.setdefault(budget, [0.0, 0.0])
        s[0] = self.DECAY * s[0] + accepted
        s[1] = self.DECAY * s[1] + 1.0

    def chain_expected(self, steps: int, own: LevelRates | None) -> float | None:
        """Expected accepted tokens of a chain `steps` deep for a request with these level rates (None:
        the global figure); None until some main path has been recorded. See chain_expectations."""
        out = self.chain_expectations([steps], [own])
        return None if out is None else out[0][0]

    def chain_expectations(self, depths: list[int], owns: list[LevelRates | None]) -> list[list[float]] | None:
        """For each request's level rates in `owns`, the expected accepted tokens of a chain of each
        depth in `depths`: the sum over levels k <= depth of the product of levels 1..k's rates. A
        level's global rate is (accepted + 0.5) / (reached + 1); a request's is its own counts blended
        with the global rate as `own_weight` paths. A level no path reached takes the rate of the
        deepest one measured. None until some main path has been recorded. (One pass per request for
        every depth: search_budgets asks for every auto request at every step.)

        Why levels and not the chain's own trees: a deep chain is only measured by its own trees, and
        two that missed early (3 then 0 accepted, on the H200 scale track at 0.8) set its figure so low
        that it was never drafted again, while every verified tree measures the levels it reaches."""
        book = self.levels.levels
        if not book:
            return None
        deepest = max(depths, default=0)
        rates, rate = [], 0.0
        for k in range(deepest):
            if k < len(book):
                accepted, reached = book[k]
                rate = (accepted + 0.5) / (reached + 1.0)
            rates.append(rate)
        shared: list[float] | None = None  # the global figures, for every request without levels of its own
        own_weight = self.own_weight_for(None)
        weighted = [rate * own_weight for rate in rates]  # each level's global rate as own_weight paths
        out = []
        for own in owns:
            mine = own.levels if own is not None else []
            if not mine and shared is not None:
                out.append(shared)
                continue
            totals, total, reach = [], 0.0, 1.0
            for (accepted, reached), prior in zip(mine, weighted):  # the levels the request has measured
                reach *= (accepted + prior) / (reached + own_weight)
                total += reach
                totals.append(total)
            for rate in rates[len(totals):]:  # deeper: the global rates alone
                reach *= rate
                total += reach
                totals.append(total)
            figures = [totals[d - 1] if d > 0 else 0.0 for d in depths]
            if not mine:
                shared = figures
            out.append(figures)
        return out

    def optimistic(self, budget: DraftBudget, own: tuple[float, float] | None) -> float:
        """`expected` plus an upper-confidence bonus, the most a budget may plausibly accept: what
        exploration ranks by. The bonus is UCB1's, on acceptance's range (0 to the budget's depth):
        depth x sqrt(2 ln N / n), n the budget's recent trees plus the prior's weight, N the same
        over all budgets. It shrinks as a budget is tried and grows, slowly, as the others are, so
        no budget goes untried for good.

        (Ranked by `expected`, an untried wide tree's prior outranked a chain whose three trees at
        the hardest positions had accepted nothing; the tree was explored 16 times, accepted 2.1 on
        average, did not pay at that, and the chain, which pays from 0.94, was never tried again.
        With two standard errors of doubt, depth / sqrt(n), a 5/4/8 tree that had accepted 2 and 3
        kept its upside at its depth while the chain's three misses held the chain's at 1.9, so
        exploration drafted the tree, which did not pay at that; 8 trees were drafted in 3 lone
        requests of 128 tokens, where runs that kept the chain drafted about 120 at about 2.0
        accepted a tree: demo pair, emulated-cost CI track, tests/test_gateway_auto_phases.py,
        2026-12-02.)"""
        weight = self.totals.get(budget, [0.0, 0.0])[1] + self.prior_weight
        everyone = sum(s[1] for s in self.totals.values()) + self.prior_weight
        bonus = budget.steps * math.sqrt(2.0 * math.log(everyone) / weight)
        return min(self.expected(budget, own) + bonus, float(budget.steps))

    def evidence_is_thin(self) -> bool:
        """Whether the book holds fewer recent trees than `thin_evidence`."""
        return sum(s[1] for s in self.totals.values()) < self.thin_evidence

    def expected(self, budget: DraftBudget, own: tuple[float, float] | None) -> float:
        """Expected accepted drafted tokens for a request: its own decayed mean blended with
        the global mean, which is in turn blended with the prior."""
        return self.expectations(budget, [own])[0]

    def expectations(self, budget: DraftBudget, owns: list[tuple[float, float] | None]) -> list[float]:
        """`expected` for each request's own figure in `owns`, the global one worked out once (search_budgets
        asks for every auto request under every option at every step)."""
        s = self.totals.get(budget, [0.0, 0.0])
        prior = self.prior_share * budget.steps
        glob = (s[0] + prior * self.prior_weight) / (s[1] + self.prior_weight)
        weight = self.own_weight_for(budget)
        return [glob if own is None else (own[0] * own[1] + glob * weight) / (own[1] + weight) for own in owns]

