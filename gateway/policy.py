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

import enum
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from draft_service.types import MAX_STEPS, DraftBudget

NO_SPEC = DraftBudget(0, 0, 0)


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = "auto"
    steps: int = 5
    topk: int = 4
    draft_tokens: int = 8
    # `auto` drafts an option other than the configured tree only where its predicted goodput beats the
    # configured tree's by this share (0: the best prediction wins). Why: the options' predictions are
    # noisy, and the highest of several noisy figures is the likeliest to be too high. On the H200 scale
    # track (2026-12-04, 0.8, 2 and 8 requests) auto switched among 5/4/8, 5/1/6, 6/8/16 and 10/1/11 from
    # step to step; each delivered within a few percent of the others or less (the 10-level chain at 8
    # requests: 1770 tok/s against 5/4/8's 1957), and auto's tree steps took 0.7-2 ms more than
    # `always`'s for as many tokens. With 0.05 (same track, the forced draws common to the modes, two
    # serves back to back) auto / max at two requests read 0.98-1.00 a round, against 0.94-0.98 with 0
    # in two serves; at one request about 1.00 both ways (BENCHMARKS.md, "Common draws").
    option_margin: float = 0.05
    # How many of a request's own trees the book's figures weigh as (AcceptanceBook.own_weight), or, with
    # own_weight_from_spread, estimated from how far ended requests differed (`--spec-own-weight auto`).
    own_weight: float = 2.0
    own_weight_from_spread: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("never", "always", "auto"):
            raise ValueError(f"speculation mode must be never, always or auto, got {self.mode!r}")
        if self.steps < 1 or self.topk < 1 or self.draft_tokens < 2:
            raise ValueError("--spec-steps and --spec-topk must be >= 1 and --spec-draft-tokens >= 2")
        if not 0.0 <= self.option_margin <= 1.0:
            raise ValueError(f"--spec-option-margin must be in [0, 1], got {self.option_margin}")
        if not (math.isfinite(self.own_weight) and self.own_weight >= 0.0):
            raise ValueError(f"--spec-own-weight must be at least 0 (or auto), got {self.own_weight}")

    @functools.cached_property
    def fixed_budget(self) -> DraftBudget:
        """The configured tree (made once: search_budgets asks for it a dozen times a step)."""
        return DraftBudget(self.steps, self.topk, self.draft_tokens)

    def auto_options(self) -> tuple[DraftBudget, ...]:
        """Budgets `auto` chooses among: the explored options, then the depth options (those of them
        that are not already explored ones)."""
        return self._options[0] + self._options[1]

    def explored_options(self) -> tuple[DraftBudget, ...]:
        """A short chain, the configured tree and a wider tree: each starts from an optimistic prior
        and is tried by exploration where the figures decline trees."""
        return self._options[0]

    def depth_options(self) -> tuple[DraftBudget, ...]:
        """A chain as deep as the configured tree and one twice as deep (those that are no explored
        option): priced from the acceptance measured per level of verified trees' main paths
        (AcceptanceBook.chain_expectations), never explored on a prior, and left out until some main
        path has been verified.

        Why: where a draft's best guess at each level is what gets accepted, a tree's side branches
        are verified for nothing and what pays is depth. On the H200 scale track (0.8 accepted per
        level of the main path) a round at one request took 11.1 ms for 3.6 tokens with 5/4/8, while
        a draft level costs about 0.25 ms (bench/draft_step.py at batch 1: 1.29 ms for 3/1/4, 1.90 for
        5/4/8), so a 10-token chain was predicted to commit about 4.6 tokens for about 1.2 ms more. An
        optimistic prior of half its depth would have every cold start explore the deep chain first.
        Measured there (BENCHMARKS.md, twenty-fifth session): auto at one and two requests came to
        0.98-0.99 of `always`, within the rounds' spread; the gain predicted did not show."""
        return self._options[1]

    @functools.cached_property
    def _options(self) -> tuple[tuple[DraftBudget, ...], tuple[DraftBudget, ...]]:
        """(explored options, depth options), made once: search_budgets asks for them every step."""
        explored = tuple(dict.fromkeys([DraftBudget(3, 1, 4), self.fixed_budget,
                                        DraftBudget(self.steps + 1, self.topk * 2, self.draft_tokens * 2)]))
        deep = min(2 * self.steps, MAX_STEPS)
        chains = [DraftBudget(self.steps, 1, self.steps + 1), DraftBudget(deep, 1, deep + 1)]
        return explored, tuple(o for o in dict.fromkeys(chains) if o not in explored)


def bucket_range(bucket: int) -> str:
    """The sequence counts a batch bucket holds, as "lo-hi"."""
    return f"{1 << (bucket - 1)}-{(1 << bucket) - 1}"


def batch_bucket(seqs: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share a correction factor."""
    return max(seqs, 1).bit_length()


@dataclass
class CostModel:
    """Predicted wall time of a step, in seconds, from profiled linear fits.

    target: base + per_token * tokens + per_seq * sequences
    draft:  base + per_level * deepest tree + per_expansion * sum(steps * topk)

    The profile sees each service alone, and on a busy host through noise (on
    the 2-core CI machine one start-up put the draft call's fixed cost at 38 ms,
    others at 5-18 ms; with it `auto` decoded a lone request plainly, at 0.66x
    the speed its trees measured), and it misses what grows with the load (a
    draft call at 64 requests ingests and catches up 64 requests). So decode
    steps correct it at every load: `ratios` holds measured over profiled wall
    time per batch bucket, for steps with trees and without, and scales what
    `step_time` predicts. A step's measured time is its whole round (see
    GatewayCore._record). From LoadGate.min_batch on, the gate decides on
    measured goodput; the corrected model still chooses the trees.
    """

    target_base: float = 5e-3
    target_per_token: float = 2e-4
    target_per_seq: float = 1e-4
    draft_base: float = 2e-3
    draft_per_level: float = 1e-3
    draft_per_expansion: float = 5e-5
    ratios: dict[tuple[int, bool], float] = field(default_factory=dict)  # (batch bucket, trees?) -> ratio
    # Plain steps that fed the drafts (awake auto requests: features out, no grant), measured over
    # profiled wall time per batch bucket: what a plain step costs before its requests go dormant.
    fed_ratios: dict[int, float] = field(default_factory=dict)
    # Per (batch bucket, tree option): the ratio learned from steps whose trees all have that budget, which
    # prices that option in place of the bucket's tree ratio (learned from every step with trees, and what
    # prices an option not measured alone yet). The profile's linear fit misses what a tree's shape costs
    # beyond its tokens and expansions (the verify's nodes bucket, the tree's export and parse): on the H200
    # scale track at one request a 5/4/8 round took 0.6 ms more than a 5/1/6 one where the fit put
    # 0.05 ms, and a 10/1/11 chain 2.0-2.5 ms more where it put 1.8 (2026-12-04).
    option_ratios: dict[tuple[int, DraftBudget], float] = field(default_factory=dict)
    # Per (batch bucket, tree shape): a round of that shape at the bucket's smallest batch (a Draft call,
    # then the verify of its trees), timed at start-up on a CUDA draft (gateway.profiling.price_rounds),
    # over what the linear fits put it at. profiled_time scales by it, so the ratios learned online are
    # what serving adds to any shape alike, and an option not yet drafted alone at a load is priced by its
    # own shape. The fits see the draft at one and four requests only: on an H100 (scale track, 0.8,
    # 2026-12-05) a 10/1/11 chain's round, priced from 5/4/8's learned ratio, was put at 17.0 and 20.0 ms at
    # 4 and 16 requests and took 24.7 and 30.8 (its draft phase at 16: 16.1 ms against 5/4/8's 7.0). Timed on
    # 32-token prompts the same chain was still priced at 18.3-21.8 ms against 23.4 at 16 requests (BENCHMARKS.md,
    # forty-sixth session); what they did correct was a start-up whose fit put a token at twice its cost. The
    # rounds' context is the gateway's --profile-context; at the scale track's 1,088 tokens the chain's factor
    # over 5/4/8's at 16-31 requests fell (1.15 to 1.04; forty-seventh session), so context does not explain it.
    shape_factors: dict[tuple[int, tuple[int, int]], float] = field(default_factory=dict)
    # Measurements behind each learned ratio (keys of `ratios`, and ("fed", bucket) for `fed_ratios`):
    # _moved_ratio weighs the first three more than later ones where they read below the ratio.
    observed: dict[tuple, int] = field(default_factory=dict)

    def target_time(self, tokens: int, seqs: int) -> float:
        return self.target_base + self.target_per_token * tokens + self.target_per_seq * seqs

    def draft_time(self, budgets: list[DraftBudget]) -> float:
        live = [b for b in budgets if not b.empty]
        if not live:
            return 0.0
        return self._draft_time(max(b.steps for b in live), sum(b.steps * b.topk for b in live))

    def _draft_time(self, levels: int, expansions: int) -> float:
        return self.draft_base + self.draft_per_level * levels + self.draft_per_expansion * expansions

    def profiled_time(self, tokens: int, seqs: int, budgets: list[DraftBudget]) -> float:
        return (self.target_time(tokens, seqs) + self.draft_time(budgets)) * self.shape_factor(seqs, budgets)

    def shape_factor(self, seqs: int, budgets: list[DraftBudget]) -> float:
        """The start-up rounds' factor for these trees at this load (1: none timed, or no tree). Trees of
        several shapes take the dearest shape's: the draft grows each shape as a group of its own."""
        if not self.shape_factors:
            return 1.0
        bucket = batch_bucket(seqs)
        shapes = {b.shape for b in budgets if not b.empty}
        return max((self.shape_factors.get((bucket, shape), 1.0) for shape in shapes), default=1.0)

    def step_time(self, tokens: int, seqs: int, budgets: list[DraftBudget]) -> float:
        key = (batch_bucket(seqs), any(not b.empty for b in budgets))
        return self.profiled_time(tokens, seqs, budgets) * self._ratio(key, _single_option(budgets))

    def _ratio(self, key: tuple[int, bool], option: DraftBudget | None) -> float:
        """The learned ratio of a step at this (bucket, trees?): its option's where measured alone."""
        if option is not None and (key[0], option) in self.option_ratios:
            return self.option_ratios[(key[0], option)]
        return self.ratios.get(key, 1.0)

    def tree_step_time(self, tokens: int, seqs: int, levels: int, expansions: int) -> float:
        """step_time of a step with trees, from their deepest level and their summed expansions
        (steps x topk): what search_budgets asks for every (option, k) without building k budgets."""
        base, per_token, per_expansion = self.tree_step_line(seqs, levels)
        return base + per_token * tokens + per_expansion * expansions

    def tree_step_line(self, seqs: int, levels: int, option: DraftBudget | None = None) -> tuple[float, float, float]:
        """tree_step_time at this load and depth as (seconds, per token, per expansion): linear in both;
        `option`: the trees' budget, where they all share one (its own learned ratio applies)."""
        ratio = self._ratio((batch_bucket(seqs), True), option)
        if option is not None:
            ratio *= self.shape_factor(seqs, [option])
        base = self.target_time(0, seqs) + self._draft_time(levels, 0)
        return base * ratio, self.target_per_token * ratio, self.draft_per_expansion * ratio

    def fed_step_time(self, tokens: int, seqs: int) -> float | None:
        """Predicted wall time of a plain step that feeds the drafts (None: none measured at this load)."""
        ratio = self.fed_ratios.get(batch_bucket(seqs))
        return None if ratio is None else self.target_time(tokens, seqs) * ratio

    def observe_fed(self, tokens: int, seqs: int, seconds: float) -> None:
        """A plain decode step that fed the drafts took `seconds` (learned as `observe` learns)."""
        predicted = self.target_time(tokens, seqs)
        if predicted <= 0 or seconds <= 0:
            return
        b = batch_bucket(seqs)
        self.fed_ratios[b] = _moved_ratio(self.fed_ratios.get(b), seconds / predicted, self._count(("fed", b)))

    def observe(self, tokens: int, seqs: int, budgets: list[DraftBudget], seconds: float) -> None:
        """A decode step of `seqs` sequences and `tokens` fixed tokens, with these trees, took `seconds`."""
        predicted = self.profiled_time(tokens + sum(b.max_nodes for b in budgets), seqs, budgets)
        if predicted <= 0 or seconds <= 0:
            return
        key = (batch_bucket(seqs), any(not b.empty for b in budgets))
        option = _single_option(budgets)
        if option is not None:  # starts from the bucket's ratio as it stood
            shape = (key[0], option)
            self.option_ratios[shape] = _moved_ratio(self.option_ratios.get(shape, self.ratios.get(key, 1.0)),
                                                     seconds / predicted, self._count(shape))
        # Starts from the profile (ratio 1).
        self.ratios[key] = _moved_ratio(self.ratios.get(key, 1.0), seconds / predicted, self._count(key))

    def _count(self, key: tuple) -> int:
        """Measurements of `key`'s ratio before this one; counts this one."""
        seen = self.observed.get(key, 0)
        self.observed[key] = seen + 1
        return seen


def _single_option(budgets: list[DraftBudget]) -> DraftBudget | None:
    """The budget a step's trees share, depth aside: the deepest, where every tree has its top-k and size
    (None: no tree, or trees of several shapes). The draft grows trees that differ only in depth as one
    group, to the deepest (DraftEngine._grow), so such a step costs what the deepest option's would, and
    its measurement is that option's. Counted as no option, it taught the option nothing: on an H100 at 8
    requests (scale track, 0.8, 2026-12-05) a third of auto's 10/1/11 steps held some shorter chains, and
    the chain, priced at least 5% above 5/4/8, delivered 11% below it."""
    live = [b for b in budgets if not b.empty]
    if not live or any(b.shape != live[0].shape for b in live):
        return None
    return max(live, key=lambda b: b.steps)


OUTLIER_STEP = 1.5  # the most an established cost ratio takes one measurement for, as a multiple of itself


def _moved_ratio(old: float | None, measured: float, seen: int = 0) -> float:
    """A learned cost ratio after one more measurement, the `seen + 1`th since the starting value `old` (None:
    no starting value, the measurement is taken whole). A measurement moves it a fifth of the way, from
    a value clamped to [0.25, 4], so one step stalled by the host, or the slow first tree of a request,
    cannot swing it. But a host's noise only adds time: of the first three measurements, those that read
    below the ratio move it as a mean would (the start counting as one measurement: 1/2, 1/3, 1/4 of the
    way). A profile that a busy host had made too dear for trees otherwise stayed so, since trees it
    prices out run only as explorations, one or a few per quiet spell, each moving it a fifth. In a CI
    run of tests/test_gateway_auto_phases.py (2026-12-03) a lone request decoded plainly in 65% of its
    steps although its trees accepted 2.0 tokens each; on the dev machine a draft call priced at 38 ms
    (as one CI start-up had profiled it; the emulated call costs 5 ms) left 69-99% of the steps plain in
    three runs, and 5-9% in three runs with this rule. Too cheap a start corrects itself: the trees it
    chooses are measured.
    Too dear a ratio does not: an option priced out is not drafted, so nothing measures it again. Once a
    ratio rests on three measurements, one that reads over OUTLIER_STEP times it counts as that much. On
    an H100 (scale track, 0.8, 2026-12-05) the last two rounds of an `always` level at 2 requests took 25
    and 44 ms against 12-13 for the rest (a stall spread over their phases; no capture, no compile), and
    lifted 5/4/8's ratio at 2-3 sequences from 1.25 to 1.98 (the log replayed by bench/cost_replay.py, which
    cannot leave out the rounds the gateway does). The `auto` level that followed priced 5/4/8 for 2
    requests at 20.8 ms a round against the 12.7 that `always` had measured, drafted 6/8/16, 5/1/6 and
    10/1/11 instead (467-597 tok/s against 5/4/8's 585), and read 0.92 of `always`. Capped, the same two
    rounds lift it to 1.51. A real rise is followed all the same: the cap moves with the ratio, 10% a step
    at most until the measurements come within it."""
    measured = min(max(measured, 0.25), 4.0)
    if old is None:
        return measured
    if seen >= 3:
        measured = min(measured, OUTLIER_STEP * old)
    weight = max(1.0 / (seen + 2), 0.2) if measured < old else 0.2
    return (1 - weight) * old + weight * measured


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


@dataclass(frozen=True)
class Candidate:
    """A decoding request the policy may give a tree to."""

    key: str
    own_stats: dict[DraftBudget, tuple[float, float] | None]  # the request's mean accepted per budget
    mode: str  # the request's effective mode
    levels: LevelRates | None = None  # the request's acceptance per level of main paths (depth options)


class Rates(NamedTuple):
    """A step's predicted goodput (committed tokens per second of step time) for its auto
    requests decoding plainly, with the best trees the figures give them, and with the configured
    tree for every one of them, as `always` drafts (None: no auto request could speculate).
    The last is the audit's like-for-like figure beside what `always` measures: the best trees
    may be another budget, or trees for some requests only (at 16 requests on the emulated-cost
    CPU track they were predicted at 2.9-3.2x what `always` delivered with 5/4/8 for all 16).

    Each arm's predicted step time in seconds comes with it (None where its rate is None), so that the
    audit can say whether a prediction that missed priced the step or its tokens wrongly: at 0.6 on the
    H200 scale track the configured tree read 1.17-1.20x `always` at 8-32 requests (2026-12-06), and a
    replay of the cost model alone could not tell which."""

    plain: float
    trees: float | None
    configured: float | None = None
    plain_seconds: float | None = None
    trees_seconds: float | None = None
    configured_seconds: float | None = None


class BudgetSearch(NamedTuple):
    """What search_budgets found for a step: choose_budgets decides from it, the audit reads `rates`."""

    out: dict[str, DraftBudget]  # the budgets of non-auto candidates (auto: NO_SPEC)
    auto: list[Candidate]
    best: tuple[DraftBudget, list[Candidate]] | None  # the best (option, requests); None: no tree pays
    single: tuple[float, DraftBudget, Candidate] | None  # exploration's one tree: (upside, option, request)
    every: tuple[float, DraftBudget] | None  # the best option given to every auto candidate
    rates: Rates
    ceiling: float | None  # the best goodput of any (option, k) were every drafted token accepted
    # Plain decoding's goodput from this step on as it would run: rates.plain (as `never` runs it) less
    # what awake requests pay until they go dormant (search_budgets' plain_extra_seconds). What a tree
    # must beat.
    plain_now: float


# While the figures choose trees, plain decoding must beat them by this share to stop them. A
# plain step between trees is no plain step as `never` runs it: the request stays awake, so the
# step feeds the draft and is not granted (9-10 ms against 4.7 on the H200 scale track at one
# request). Near a tie the choice flipped from step to step, and such mixed runs delivered
# 0.64-0.83x the better arm at one request. (Plain decoding is now priced with those steps, as
# BudgetSearch.plain_now; this margin stays against the figures' step-to-step noise.)
KEEP_TREES_WITHIN = 0.05


def search_budgets(cfg: PolicyConfig, costs: CostModel, book: AcceptanceBook, candidates: list[Candidate],
                   other_tokens: int, other_seqs: int, *, other_committed: float = 0.0,
                   plain_extra_seconds: float = 0.0) -> BudgetSearch:
    """Every (option, k best requests) for the auto candidates, by predicted goodput: the best
    choice (`best` is None when the figures alone give no tree), and the predicted rates.

    other_committed: the tokens the step's other items commit whatever the choice (a decode
    that cannot draft, the last chunk of a prefill): goodput is the whole step's, as the load
    gate measures it. (Counting the candidates' tokens alone priced plain decoding at 0.69x what
    the gate measured at 4 requests on the H200, where some requests were not ready to draft,
    and made a tree for one request of several look as if it sped up the whole step.)

    plain_extra_seconds: what a plain step costs on top of a granted one, averaged over the plain
    spell it would start (GatewayCore._plain_extra_seconds): the requests stay awake, feeding their
    drafts ungranted, until they go dormant. Trees are compared with plain decoding at that price
    (`plain_now`); `rates.plain` stays the granted figure, which the audit compares with `never`."""
    out = {c.key: NO_SPEC for c in candidates}
    auto = []
    for c in candidates:
        if c.mode == "always":
            out[c.key] = cfg.fixed_budget
        elif c.mode == "auto":
            auto.append(c)
    best_at: tuple[DraftBudget, list[int], int] | None = None  # the best (option, requests in order, k)
    single: tuple[float, DraftBudget, Candidate] | None = None
    every: tuple[float, DraftBudget] | None = None
    fixed = [b for b in out.values() if not b.empty]
    base_tokens = other_tokens + len(candidates) + sum(b.max_nodes for b in fixed)
    base_seqs = other_seqs + len(candidates)
    # + the fixed-budget requests' acceptance, the same for all choices
    base_committed = float(len(candidates)) + other_committed
    plain_seconds = costs.step_time(base_tokens, base_seqs, fixed) if candidates else 0.0
    plain_rate = base_committed / plain_seconds if candidates else 0.0
    plain_now = best_rate = base_committed / (plain_seconds + plain_extra_seconds) if candidates else 0.0
    top_tree_rate: float | None = None
    top_tree_seconds: float | None = None
    configured_rate: float | None = None
    configured_seconds: float | None = None
    configured_best: tuple[float, list[int], int] | None = None  # the configured tree's best (rate, order, k)
    ceiling: float | None = None
    live_fixed = [b for b in fixed if not b.empty]
    fixed_levels = max((b.steps for b in live_fixed), default=0)
    fixed_expansions = sum(b.steps * b.topk for b in live_fixed)
    explored, depth_options = cfg.explored_options(), cfg.depth_options()
    # Per auto request, what each depth option is expected to accept (None: no main path measured yet).
    by_depth = book.chain_expectations([o.steps for o in depth_options], [c.levels for c in auto]) if auto else None
    for o in cfg.auto_options() if auto else ():
        explorable = o in explored
        if explorable:
            expectations = book.expectations(o, [c.own_stats.get(o) for c in auto])
        elif by_depth is not None:
            column = depth_options.index(o)
            expectations = [figures[column] for figures in by_depth]
        else:
            continue  # a depth option before any main path was verified: nothing prices it
        # The requests by their expectation of o, best first (a stable sort: ties keep their order).
        order = sorted(range(len(auto)), key=expectations.__getitem__, reverse=True)
        # = costs.step_time(tokens, base_seqs, fixed + [o] * k), in constant time per k
        # (o's own ratio even beside `always` requests' trees of another budget: the step is mostly o's)
        step_base, per_token, per_expansion = costs.tree_step_line(base_seqs, max(fixed_levels, o.steps), o)
        nodes, tree_expansions = o.max_nodes, o.steps * o.topk
        configured = o == cfg.fixed_budget  # once per option: a budget's == is Python's, not the tuple's
        committed, tokens, expansions = base_committed, base_tokens, fixed_expansions
        rate = 0.0
        for k, i in enumerate(order, start=1):
            committed += expectations[i]
            tokens += nodes
            expansions += tree_expansions
            seconds = step_base + per_token * tokens + per_expansion * expansions
            rate = committed / seconds
            if top_tree_rate is None or rate > top_tree_rate:
                top_tree_rate, top_tree_seconds = rate, seconds
            # The ceiling over every k, not one tree alone: at two requests on the H200 one tree
            # could never pay where trees for both did (`always` 412 tok/s against `never`'s 395), so
            # figures that a cold start had set too low were never refreshed by an exploration.
            full = (base_committed + k * o.steps) / seconds
            if ceiling is None or full > ceiling:
                ceiling = full
            if k == 1 and explorable:
                # Exploration's pick: the option with the most plausible upside, for its likeliest
                # request (optimistic adds the same doubt to every request's expectation of o).
                likeliest = auto[order[0]]
                upside = (base_committed + book.optimistic(o, likeliest.own_stats.get(o))) / seconds
                if single is None or upside > single[0]:
                    single = (upside, o, likeliest)
            # (The requests are listed once the search is over: listing them at every better k was
            # quadratic in the requests.)
            if rate > best_rate * (1 + 1e-9):
                best_rate, best_at = rate, (o, order, k)
            if configured and rate > plain_now * (1 + 1e-9) and (
                    configured_best is None or rate > configured_best[0]):
                configured_best = (rate, order, k)
        # k = every auto request
        if every is None or rate > every[0]:
            every = (rate, o)
        if configured:
            configured_rate, configured_seconds = rate, seconds
    # Another option must beat the configured tree by cfg.option_margin (see there).
    margin = 1 + cfg.option_margin
    if best_at is not None and best_at[0] != cfg.fixed_budget and configured_best is not None \
            and best_rate < configured_best[0] * margin:
        best_at = (cfg.fixed_budget, *configured_best[1:])
    best = None if best_at is None else (best_at[0], [auto[i] for i in best_at[1][:best_at[2]]])
    if every is not None and every[1] != cfg.fixed_budget and configured_rate is not None \
            and every[0] < configured_rate * margin:
        every = (configured_rate, cfg.fixed_budget)
    rates = Rates(plain_rate, top_tree_rate, configured_rate, plain_seconds if candidates else None, top_tree_seconds,
                  configured_seconds)
    return BudgetSearch(out, auto, best, single, every, rates, ceiling, plain_now)


def choose_budgets(cfg: PolicyConfig, costs: CostModel, book: AcceptanceBook, candidates: list[Candidate],
                   other_tokens: int, other_seqs: int, probe: bool = False,
                   search: BudgetSearch | None = None, explore: bool = False, *,
                   other_committed: float = 0.0) -> dict[str, DraftBudget]:
    """Budget per candidate. other_tokens/other_seqs: prefill work already in the step.

    For `auto`, each option o is tried on the k requests expected to accept most
    under it, for every k; the (o, k) with the highest goodput wins. That is
    O(options * requests) per step, cheap enough to run every step at batch 256.
    Figures nothing refreshes go stale, so trees are sometimes drafted although
    the figures say they do not pay: every auto candidate gets the option that
    comes closest while the load gate measures trees at this load (`probe`: a
    probe the figures decline would measure nothing), and the best single tree
    is taken after `book.explore_after` steps without one, or now (`explore`: the
    caller's last chance to refresh the figures before nothing would) where some
    tree could pay were all its drafted tokens accepted. `search`: search_budgets'
    result for these very arguments, when the caller already has it. other_committed: as for
    search_budgets. `book.explored` says afterwards whether the auto trees were exploration.
    """
    search = search or search_budgets(cfg, costs, book, candidates, other_tokens, other_seqs,
                                      other_committed=other_committed)
    out, auto, best, single, every = search.out, search.auto, search.best, search.single, search.every
    speculating, book.speculating = book.speculating, best is not None
    book.explored = False
    if not auto:
        return out
    # `explore` only where acceptance could change the choice: were all its drafted tokens
    # accepted, the tree would beat plain decoding (with trees that cannot pay, as on costs
    # where a tree step takes many plain ones, the caller would draft one per wake-up for nothing).
    could_pay = search.ceiling is not None and search.ceiling > search.plain_now
    if best is None and probe and every is not None:
        best = (every[1], auto)
    elif (best is None and speculating and every is not None
          and every[0] >= (1 - KEEP_TREES_WITHIN) * search.plain_now):
        best = (every[1], auto)  # a near tie: keep speculating (see KEEP_TREES_WITHIN)
        book.speculating = True
    elif best is None and single is not None and (
            (explore and could_pay) or book.quiet_steps >= book.explore_after):
        best = (single[1], [single[2]])
        book.explored = True
    if best is not None:
        for c in best[1]:
            out[c.key] = best[0]
    book.quiet_steps = 0 if best is not None else book.quiet_steps + 1
    return out


TOKENS_WINDOW = 16  # recorded steps over which an arm's tokens a sequence are averaged (see Arm.tokens_per_seq)


@dataclass
class Arm:
    goodput: float = 0.0  # committed tokens per second of step wall time: tokens_per_seq x seq_rate
    seconds: float = 0.0  # wall time of a step (decayed mean)
    samples: int = 0
    # Committed tokens a sequence a step: a running mean over the first TOKENS_WINDOW recorded steps, then
    # decayed by 1/TOKENS_WINDOW. The goodput is this mean times seq_rate, and a single step is judged at
    # this mean, not at its own tokens (LoadGate.record): a tree step's cost is steady, its tokens are not.
    # On the H200 scale track (0.8, two sequences, 2026-12-04) 5/4/8 tree steps took 13.5-15 ms each and
    # committed 2 to 19 tokens; the goodput, then each step's rate decayed by 0.3 a step, rested on the last
    # three steps' luck and read 350-440 tok/s where the steps averaged about 540 and plain decoding ran at
    # 420, and a re-probe judged on its one recorded step ended on a step of 2 tokens: auto decoded plainly
    # at 0.82-0.91 of `always`.
    tokens_per_seq: float = 0.0
    # What the acceptance book expected of the same steps, averaged as tokens_per_seq is (a step whose
    # expectation is not known counts as expecting what it committed), and how many sequences' tokens the
    # window holds: the goodput judges tokens_per_seq shrunk towards the expectation (judged_tokens).
    expected_per_seq: float = 0.0
    measured_seqs: float = 0.0
    seq_rate: float = 0.0  # sequences stepped per second of step wall time (decayed mean): the cost side
    since: int = 0  # steps of this bucket since the arm was last measured
    predicted: float | None = None  # what the cost model predicted for this arm (decayed mean), for the audit
    # Running sums since start, for an audit over any interval (the difference of two scrapes):
    # the predictions and how many, and the committed tokens and wall seconds of every step of
    # this arm the gate was given (its warm-up steps included: what the arm really delivered).
    predicted_sum: float = 0.0
    predictions: int = 0
    # ... and the predicted steps' seconds and committed tokens, summed over the predictions that gave them
    # (Rates' *_seconds; every prediction the gateway makes does): the mean predicted step next to the
    # steps a mode ran.
    predicted_seconds_sum: float = 0.0
    predicted_tokens_sum: float = 0.0
    committed_total: int = 0
    seconds_total: float = 0.0

    def forget(self) -> None:
        """Drops what the arm measured (the audit's running sums and predictions stay)."""
        self.goodput = self.seconds = self.tokens_per_seq = self.seq_rate = 0.0
        self.expected_per_seq = self.measured_seqs = 0.0
        self.samples = self.since = 0

    def judged_tokens(self, expected_weight: float) -> float:
        """Committed tokens a sequence a step as the gate judges them: see LoadGate.expected_weight."""
        return shrunk(self.tokens_per_seq, self.expected_per_seq, self.measured_seqs, expected_weight)


def shrunk(measured: float, expected: float, measured_weight: float, expected_weight: float) -> float:
    """`measured` pulled towards `expected` as a weighted mean: how far to trust a mean of few draws."""
    total = measured_weight + expected_weight
    return measured if total <= 0 else (measured_weight * measured + expected_weight * expected) / total


class AuditArm(enum.StrEnum):
    """What an audit row is about: the gate's two arms, and the configured tree for every auto
    request (predicted only: what `always` would deliver, to set beside what it measures)."""

    TREES = "trees"
    PLAIN = "plain"
    CONFIGURED_TREE = "configured_tree"


class AuditRow(NamedTuple):
    """One bucket's arm in LoadGate.audit."""

    sequences: str  # the bucket, as "lo-hi"
    arm: AuditArm
    predicted: float | None  # decayed mean of the cost model's predictions, tok/s
    measured: float | None  # the gate's decayed mean goodput, tok/s
    predicted_sum: float  # running sums: see Arm
    predictions: int
    committed_total: int
    seconds_total: float
    # What prompts add to each committed token's time under this arm at this load, as the gate charges it
    # (PromptCharges.seconds_per_token); None for the configured tree, which the gate does not judge.
    prompt_charge: float | None = None
    predicted_seconds_sum: float = 0.0  # the predicted steps' seconds and committed tokens: see Arm
    predicted_tokens_sum: float = 0.0


@dataclass
class PromptCharges:
    """What a joining prompt costs each arm, spread over the tokens the workload commits.

    The gate measures its arms on decode steps; what trees also cost comes with the prompts: a prompt
    taken in while trees may be chosen feeds its features to the draft (the target copies them out, the
    draft takes them in), one taken in under the plain verdict does not, and each stalls every decoding
    request for as long as its step lasts. On the H200 scale track (prefix 1024, 128 tokens, 0.8), at
    8 and 16 requests `always`'s decode steps matched or beat `never`'s (1651-1773 against 1556-1562
    tok/s, 2788-3060 against 2972-2975) while it delivered less (1275.6 against 1418.5, 2137.3 against
    2640.7): a gate that saw decode steps alone chose trees there and lost 14-20% (2026-12-03).

    Per arm: the seconds a prompt-carrying step took beyond what its decode items alone would (the cost
    model's price for them), per prompt token, decayed; a step counts for trees when some prompt in it
    fed a draft. Trees are also charged the rounds whose draft call waited on a replica taking in a
    joining prompt (its catch-up), which no arm records. And the workload's prompt tokens per committed
    token, decayed over steps. An arm's delivered rate is then 1 / (1 / decode-step rate + its charge
    per prompt token x prompt tokens per committed token). Until both arms have a charge neither is
    charged (as before): only the difference between them can turn a verdict, and one arm's charge
    alone would count the prompts' own forward against it.

    The charges are kept per load (the batch bucket of the prompt-carrying step) beside all loads
    together, and a load is charged its own where it has one for both arms, else the all-loads figure.
    What a prompt costs trees grows with the batch (a join under trees verifies every decoding request's
    tree beside the prompt: 128 tree rows at 16 requests), and the all-loads figure, decayed over the last
    few prompts, still weighed the lighter load before by about half at a new load's first probes.
    """

    decay: float = 0.8  # per prompt-carrying step of that arm (and load)
    workload_decay: float = 0.998  # per step: about the last 500 steps
    # arm (trees?) -> [decayed extra seconds, decayed prompt tokens], over all loads
    extra: dict[bool, list[float]] = field(default_factory=dict)
    # (batch bucket, arm) -> the same at that load
    by_bucket: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    prompt_tokens: float = 0.0  # decayed, every step
    committed: float = 0.0

    def observe_prompts(self, fed: bool, prompt_tokens: int, extra_seconds: float, bucket: int | None = None) -> None:
        """A step that carried `prompt_tokens` prompt tokens (fed to drafts or not) took `extra_seconds`
        beyond its decode items' price; `bucket`: its batch bucket (None: counted over all loads only).
        prompt_tokens 0: a round that waited on a draft taking in prompts counted before (their
        catch-up), added to the charge without a decay of its own."""
        if prompt_tokens <= 0 and extra_seconds <= 0:
            return
        decay = self.decay if prompt_tokens > 0 else 1.0
        sinks = [self.extra.setdefault(fed, [0.0, 0.0])]
        if bucket is not None:
            sinks.append(self.by_bucket.setdefault((bucket, fed), [0.0, 0.0]))
        for sums in sinks:
            sums[0] = decay * sums[0] + max(0.0, extra_seconds)
            sums[1] = decay * sums[1] + prompt_tokens

    def observe_step(self, prompt_tokens: int, committed: int) -> None:
        self.prompt_tokens = self.workload_decay * self.prompt_tokens + prompt_tokens
        self.committed = self.workload_decay * self.committed + committed

    def mix(self) -> float | None:
        """The workload's prompt tokens per committed token, decayed over steps (None before any commit)."""
        return self.prompt_tokens / self.committed if self.committed > 0 else None

    def forget(self, bucket: int) -> None:
        """Drops a load's own charges: it is charged the all-loads figure until it has both arms' again."""
        for spec in (True, False):
            self.by_bucket.pop((bucket, spec), None)

    def per_prompt_token(self, spec: bool, bucket: int | None = None) -> float | None:
        """An arm's charge per prompt token at this load (None: all loads), None where it has none."""
        sums = self.extra.get(spec) if bucket is None else self.by_bucket.get((bucket, spec))
        return None if sums is None or sums[1] <= 0 else sums[0] / sums[1]

    def seconds_per_token(self, spec: bool, bucket: int | None = None) -> float:
        """What prompts add to each committed token's time under this arm at this load (0 until both
        arms have a charge): the load's own charges where it has both, else those of all loads."""
        if bucket is not None and None in (self.per_prompt_token(True, bucket), self.per_prompt_token(False, bucket)):
            bucket = None
        own, other = self.per_prompt_token(spec, bucket), self.per_prompt_token(not spec, bucket)
        if own is None or other is None or self.committed <= 0:
            return 0.0
        return own * self.prompt_tokens / self.committed

    def delivered(self, spec: bool, rate: float, bucket: int | None = None) -> float:
        """A decode-step rate (tok/s) of this arm at this load as delivered, its prompts' charge included."""
        if rate <= 0:
            return rate
        return 1.0 / (1.0 / rate + self.seconds_per_token(spec, bucket))


@dataclass
class HeldLoad:
    """The load the gate judges: the most requests the gateway held at any of the last `plans` plans made in
    the last `seconds`, and at the plan before this one whenever it was made.

    A load that falls is believed only once it has stayed down that long. Between a request's end and its
    client's next request the gateway holds one request fewer for a plan or a few; where that crosses a
    bucket whose verdict differs (trees at 8-15 sequences, plain decoding at 16-31), each such dip woke the
    dormant requests, had their drafts catch up on the tokens they slept through and drafted trees on the
    joining prompts' steps. On the H200 scale track at 16 requests (0.8, 2026-12-05) the load dipped below 16
    in 7-10 spells a level, of 1 to 6 plans (8-200 ms) each; the dips' 24-27 steps took 17% of the levels'
    step time, and auto delivered 0.84 of `never` (bench/step_log.py --levels counts such steps). The time
    bound keeps a load that really fell from waiting out the plans of granted steps (8 steps each by default).
    A load that rises counts at once: the plan that meets it is judged at it. `plans` 1: every plan at its own
    load.
    Until 2026-12-06 the hold was 16 plans and 0.25 s. On an H100 (scale track, 0.8, 64 requests) a
    wave of `tandem bench`'s requests ended together and the gateway took their successors in over 0.4-0.65 s
    (one or two joined a plan, each plan about 10 ms): 16 plans later the load read 8-31, whose verdict was trees,
    and trees were drafted on the joining prompts' steps from 0.26 s to 0.65 s after the last full step (2-12
    such steps a level at 35-70 ms, 2.5-7% of its step time, where `never` at 64 requests beat `always` by 1.4x).
    A load that really falls keeps the heavier load's verdict that much longer: under a second of it.
    So the long hold is kept for a load that falls while requests still join: where none joined in the last
    `join_window` seconds, a fall is believed after `quiet_seconds` (the plans' bound still applies). On an H100
    (scale track, 0.8, 32 requests, outputs of 64-192 tokens, 2026-12-06) a level's last requests ended one by one
    with nothing joining, and its load fell from 32 to 5 sequences over 0.7 s, all judged at 32-63, where plain
    decoding had won: auto decoded plainly down to 5 sequences, where trees win 1.3x and more (0.93 of `always`
    over the level). A request's end and its client's next request are a dip of 8-200 ms, inside the short hold.
    """

    plans: int = 64
    seconds: float = 0.75
    quiet_seconds: float = 0.25
    join_window: float = 0.1
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, load) of the last plans
    last_join: float = -math.inf  # when a plan last took in a request

    def __post_init__(self) -> None:
        if self.plans < 1:
            raise ValueError(f"a load is held for at least 1 plan, got {self.plans}")
        if not (self.seconds >= 0 and self.quiet_seconds >= 0 and self.join_window >= 0):
            raise ValueError(f"a load is held for at least 0 seconds, got {self.seconds} and {self.quiet_seconds} "
                             f"(join window {self.join_window})")
        self.recent = deque(self.recent, maxlen=self.plans)

    def hold(self, load: int, now: float | None = None, joined: bool = True) -> int:
        """The load to judge at a plan made while the gateway holds `load` requests (`now`: time.monotonic()).
        joined: the plan took in a request. The plan before counts however long ago it was made: it may have been
        a long grant."""
        now = time.monotonic() if now is None else now
        if joined:
            self.last_join = now
        bound = self.seconds if now - self.last_join <= self.join_window else min(self.seconds, self.quiet_seconds)
        previous = self.recent[-1][1] if self.recent and self.plans > 1 else load
        self.recent.append((now, load))
        return max(previous, max(held for when, held in self.recent if now - when <= bound))


class Probe(NamedTuple):
    spec: bool  # the arm measured
    steps_left: int  # steps of that arm still to take
    reprobe: bool  # the arm had a figure before: the probe only asks whether it changed
    clear_losses: int = 0  # recorded steps in a row, the last ones, that each lost by `clear`
    second: bool = False  # a close first verdict's second measurement: judged afresh, not against the margin
    # The recorded steps' committed tokens and seconds so far, and whether the probe was lengthened
    # (LoadGate.close_probe_steps).
    committed: float = 0.0
    seconds: float = 0.0
    expected: float = 0.0  # ... what the acceptance book expected them to commit (see LoadGate.expected_weight)
    sequences: float = 0.0  # ... and the sequences they carried
    lengthened: bool = False
    joins: int = 0  # tree steps it drafted that carried a joining prompt's chunk (never recorded: LoadGate._answer)


@dataclass
class LoadGate:
    """Whether `auto` speculates at all at this load: measured, not predicted.

    Per load bucket (the requests in the gateway when a step is planned, whatever
    the step carries: GatewayCore._budgets) it keeps the goodput of recent steps with
    trees and without, as mean tokens times a decayed step rate (see Arm). Each arm is
    first measured for `probe_steps` steps; then the better arm is chosen, and then
    kept unless the other measures `margin` times better; where the two came within
    `margin` and trees won, plain decoding is measured once more in full `stale_after`
    steps later and the fresh figures decide again (a second opinion); the losing arm
    is measured again now and then (see `probe_budget`), so a change in load mix or
    acceptance is noticed.
    The verdict is taken when a probe ends and held until the next one: the
    first step after a switch pays for it (after plain steps the draft still
    works through the features it was fed; after trees, deferred feeds go
    out), so judging step by step flipped the arms back and forth, each flip
    charged to the arm switched to. For the same reason the first quarter of
    a probe is not recorded.
    Below `min_batch` sequences the gate stays open and the cost model's figures
    alone decide. The gate decides from one sequence by default: until 2026-12-04
    it did from four, and at two requests on the H200 scale track (0.6, where
    `never` beat `always` by 8-10%) the figures alone predicted trees at 384-394
    tok/s that measured 367-376, and auto read 0.89-0.91 of `never`; with the gate
    from two it read 0.96-1.00 (BENCHMARKS.md, "The gate from two sequences"). At
    one request the figures misprice plain decoding by the host's drift: a plain
    step is priced from the last grants measured, perhaps a level ago, while trees
    are measured as they run, and on an H100 the same granted plain step took
    0.61-0.93 ms from one level to the next (demo track, 2026-12-06). From two
    sequences a lone request on the demo track then drafted trees in 97.6% of its
    steps where `never` led `always` by 1.23x (auto 0.69 of `never`); from one,
    with _overturned, two serves drafted trees in at most 13 of a level's 2,000
    steps (the gate's probes) and decoded in granted plain steps as `never` does
    (BENCHMARKS.md, "The fifty-ninth session's figures"). `tandem gateway
    --gate-min-batch 2` restores the figures' rule at one sequence.
    The cost model still picks the trees inside the speculative arm; the gate
    catches what the model misses (gateway work, the draft's catch-up of fed
    features, contention between services on shared cores).
    """

    stale_after: int = 48
    probe_steps: int = 8
    margin: float = 1.1  # the other arm must measure this much better to overturn a standing verdict
    min_batch: int = 1
    # Probing a clearly losing arm is what a gate costs: on an H200 a step with trees
    # took 3-6x a plain one from 16 requests on (scale track), so 8 probe steps every 48
    # cost more than the probes could ever win. A probe of an arm that measures `clear`
    # times worse ends after `clear_steps` recorded steps. A re-probe only asks whether anything
    # changed: it ends after its first recorded step unless that step alone comes within
    # `margin` of the winner. The loser is re-probed once the time a re-probe loses (its
    # steps, at the loser's step time and shortfall) is `probe_budget` of the time since the
    # last one, and after at least `stale_after` and at most `max_stale_factor` times as
    # many steps (on emulated GPU-like costs at 16 requests, a 3-step re-probe of trees
    # every 117 steps cost auto 2-4% of never's throughput).
    # What a re-probe loses is measured, not only estimated from its recorded steps: a probe of trees
    # wakes dormant requests, which feed their drafts, ungranted, until the drafts have caught up on
    # the tokens they slept through (1-3 such steps before the first tree on the H200 scale track),
    # and its first steps are not recorded at all (see spend). The cap only bounds how stale a verdict
    # may get: 64 x 48 steps, about 20 s of plain decoding at 6 ms a step (with 8 x 48, each level of
    # 512 steps that `tandem bench` ran at 4-32 requests on the H200 held a re-probe of trees).
    clear: float = 1.5
    # A first probe ends early only after this many recorded steps in a row that each lost by `clear`:
    # one step can be an outlier (a joining prompt's chunk, a draft still catching up, a graph met for
    # the first time). On the H200 scale track (0.8) one recorded tree step settled 4-7 sequences at
    # 480.7 tok/s (predicted 680.2) against plain's 858.3, and 8-15 at 353.9 (predicted 1203.2)
    # against 1699.1, where `always`'s decode steps ran at 981-1108 and 1692-1937 tok/s and the
    # next probe of trees at 4-7 measured 1307.8 over 7 steps: auto read 0.84 of `always` at 4
    # requests. A re-probe still ends after one step: it only asks whether anything changed.
    clear_steps: int = 2
    probe_budget: float = 0.01
    max_stale_factor: float = 64.0
    # A verdict holds for the workload it was measured under. Where the workload's prompt tokens per
    # committed token (PromptCharges.mix) has since moved by this factor either way, the load is measured
    # afresh, as if met for the first time: on the H200 scale track (0.8, 2026-12-04) `tandem bench`'s
    # warm-up (16-token requests behind 1024-token prompts, 64 prompt tokens a committed token) settled
    # 4-7 sequences for plain decoding on two tree steps at 440 tok/s, charged 2.7 ms a token for
    # prompts; the levels then ran 128-token requests (8 a token), where `always` beat `never` by 16% at
    # 4 requests, and plain's verdict stood through all three rounds (auto 0.87 of `always`): a re-probe
    # of trees after plain steps is dear, so the gate spaces them far apart.
    mix_shift: float = 2.0
    # A first probe of trees that would end within `margin` of plain decoding runs this many recorded steps
    # more, and a first probe's arm is judged on the mean of all its recorded steps, not the decayed mean
    # (0: neither; `tandem gateway --gate-close-probe-steps`). On the H200 scale track (0.8, 4-7 sequences,
    # 2026-12-04) six recorded tree steps that committed 4 to 19 tokens each settled a verdict 1.6% apart
    # after the prompts' charges, for plain decoding, where `always` then delivered 1.12x `never`: a step's
    # acceptance varies that much, so six steps cannot tell arms a few percent apart. With 16 more steps
    # (same track, thirty-first session, off against on in one call) auto / max at 4 requests went from
    # 0.79-0.87 a round to 0.97-1.00; at 8, where the two modes were 2-6% apart, it read 0.94-0.99 without
    # and 0.86-0.97 with (BENCHMARKS.md, "Common draws").
    close_probe_steps: int = 16
    # A load without a verdict that was last met this many seconds ago is measured afresh when met again: its
    # figures, and a first probe left pending, belong to another workload. On an H100 (scale track, 0.8,
    # 2026-12-05) `tandem bench`'s warm-up burst (16-token requests) passed through 32-63 sequences, left plain
    # decoding there at 7,663 tok/s on six granted steps and a probe of trees pending; 81 s later the level of
    # 32 requests finished that probe against the warm-up's figure (plain: its own steps then read 4,787), and
    # `auto` decoded plainly where `always` delivered 1.02x `never` (0.96 of it).
    idle_forget_seconds: float = 5.0
    # A tree step's committed tokens are drawn: at one sequence and forced acceptance 0.6 a 5/4/8 tree
    # accepts 0-5 drafted tokens (mean 1.38, standard deviation 1.57), so six or eight recorded steps put
    # trees' goodput anywhere within +-25% of its mean. Where the caller gives a step's expected tokens (the
    # acceptance book's figures for its trees, which hold every tree verified), an arm's tokens a sequence
    # are judged as their mean over the measured sequences shrunk towards that expectation, which weighs
    # as this many sequences: 6 steps of one sequence weigh 6 / 22, 6 steps of 16 weigh 96 / 112. The step
    # time, what the gate is there to measure, is not shrunk. On an H100 (scale track, 0.6, one request,
    # 2026-12-07) the first probes of trees read 159, 147 and 139 tok/s on 6-8 steps, predicted 238-258,
    # against plain's 160; trees came back after 289-337 plain steps, over half of a level's 512 tokens, and
    # measured 195-225 tok/s from then on: auto read 0.75-0.77 of `always`. On the dev machine's CPU (demo pair
    # forced to 0.6, GPU-like costs emulated) 16 against 0 read 1.08-1.29 a round against 0.83-1.24 at one
    # request. 0: judged on the measured tokens alone.
    expected_weight: float = 16.0
    clock: Callable[[], float] = time.monotonic
    arms: dict[tuple[int, bool], Arm] = field(default_factory=dict)
    _probing: dict[int, Probe] = field(default_factory=dict)  # bucket -> the probe under way
    _verdict: dict[int, bool] = field(default_factory=dict)  # bucket -> speculate, as of the last probe
    # bucket -> [seconds, committed tokens] of every decode step at that load while its probe runs
    # (see spend), and what the last probe lost against the arm that won, in seconds.
    _probe_spent: dict[int, list[float]] = field(default_factory=dict)
    _probe_lost: dict[int, float] = field(default_factory=dict)
    # bucket -> [seconds, committed tokens] of the decode steps after a probe of plain decoding that trees
    # won, up to the first recorded tree step: the drafts catching up on the tokens the probe's granted
    # steps did not feed them, which is what that probe lost too (added to _probe_lost there). On the H200
    # scale track (0.8, 8 requests, 2026-12-04) each re-probe of plain, 8 granted steps, was followed by 4-6
    # plain steps that fed the drafts, at 8.7 ms each against 5.3 granted and 16-17 for a tree step of 29
    # tokens; the probe's own steps lost 6.5 ms, the catch-up about 25.
    _catch_up: dict[int, list[float]] = field(default_factory=dict)
    # bucket -> arm steps at that load since a first verdict that came within `margin` (see allow_spec).
    _unsettled: dict[int, int] = field(default_factory=dict)
    # bucket -> the predictions of the configured tree for every auto request (Rates.configured); an
    # Arm of which only the prediction fields are used: nothing runs it under auto.
    _configured: dict[int, Arm] = field(default_factory=dict)
    _verdict_mix: dict[int, float] = field(default_factory=dict)  # bucket -> PromptCharges.mix at its verdict
    # (bucket, mix at its verdict, mix now) of each load measured afresh since the caller last took them (for logs)
    remeasured: list[tuple[int, float, float]] = field(default_factory=list)
    # bucket -> the standing verdict's losing arm: its steps recorded outside a probe since the verdict (see
    # _overturned), and the buckets whose verdict those steps overturned since the caller last took them (for logs)
    _against: dict[int, int] = field(default_factory=dict)
    overturned: list[int] = field(default_factory=list)
    prompts: PromptCharges = field(default_factory=PromptCharges)
    _met: dict[int, float] = field(default_factory=dict)  # bucket -> when it was last met (clock seconds)

    def allow_spec(self, seqs: int, model_prefers_spec: Callable[[], bool] | None = None,
                   prompts_join: bool = False) -> bool:
        """Whether auto may speculate at this load. model_prefers_spec: whether the cost model gives
        any request a tree at this step, asked only when a bucket is met for the first time.
        prompts_join: the step carries a joining prompt's chunk (a re-probe of trees waits for one that
        only decodes: see _answer)."""
        if seqs < self.min_batch:
            return True
        b = batch_bucket(seqs)
        self._forget_if_idle(b)
        self._forget_if_moved(b)
        spec = self.arms.setdefault((b, True), Arm())
        plain = self.arms.setdefault((b, False), Arm())
        probe = self._probing.get(b)
        # Above a load where plain decoding won, trees are not even probed: they only cost more as
        # the batch grows, and a probe there is dear (every request's draft catches up from its
        # tokens first: on the H200 scale track a probe at 32-63 sequences took 27 steps that fed
        # the draft at 3x a granted step, then a 431 ms round; probes cost auto a third of `never`'s
        # throughput at 64 requests). Until 2026-12-03 this took a win by `clear` below; where trees
        # lost by 7-8% at 8-15 and 16-31 sequences (0.8), trees were then probed at 16-31, 32-63
        # and 64-127, levels whose worst rounds read 0.90, 0.89 and 0.93 of the better mode.
        # Where trees later win below, this bucket is new again.
        if self._trees_need_no_probe(b):
            if probe is not None:
                # A first probe left pending when its load passed (a burst of short requests met every
                # bucket before any had a verdict: `tandem bench`'s warm-up) is dropped, with the tree steps
                # it recorded, should this load be new again: on the H200 such probes ran 8 tree steps at
                # 8-15 and 16-31 sequences where 4-7 had measured trees at 0.6x. Where one had recorded a
                # tree step it used to run on: on the CPU's emulated track (2026-12-04) the warm-up's bursts,
                # judged at their loads, left such probes at 8-15 and 16-31, and each ran in a level's first
                # round (auto 0.93 of `never` at 16 requests, against 1.00 without).
                self._drop_probe(b)
                spec.forget()
            return False
        if probe is not None:
            return self._answer(probe, prompts_join)
        # A new bucket measures plain decoding first where the cost model predicts it wins: the
        # probe of trees, measured second, then ends after `clear_steps` recorded steps if they clearly
        # lose (probing trees first cost 8 tree steps at every new bucket of a loaded server).
        order = ((spec, True), (plain, False))
        if spec.samples == 0 and plain.samples == 0 and model_prefers_spec is not None and not model_prefers_spec():
            order = order[::-1]
        for arm, key in order:
            if arm.samples == 0:
                self._probing[b] = Probe(key, self.probe_steps, False)
                self._catch_up.pop(b, None)
                return key
        if b not in self._verdict:
            self._set_verdict(b, self._judge(b))
        spec_wins = self._verdict[b]
        loser = plain if spec_wins else spec
        # A first verdict within `margin` rests on two probes of six recorded steps, and the margin then
        # held it: on the H200 scale track (0.8) the probes at 16-31 sequences read trees 13% above plain
        # on decode steps (7% with prompts charged) where the level's decode steps came out even, and
        # `always` delivered 0.84x `never`; trees stood for the whole level (auto 0.81 of `never`). So where
        # trees won that close, plain decoding is measured again in full once trees have run a while, and
        # the two fresh figures decide without the margin (a second opinion; see record for why only then).
        # Counted in steps since the verdict: plain steps the cost model chose under trees kept plain's
        # figure fresh, and the re-probe never came. A re-probe due first is the second opinion.
        second = b in self._unsettled
        if (second and self._unsettled[b] >= self.stale_after) or loser.since >= self._stale_after(b, spec_wins):
            self._unsettled.pop(b, None)
            self._probing[b] = Probe(spec=not spec_wins, steps_left=self.probe_steps, reprobe=not second,
                                     second=second)
            self._catch_up.pop(b, None)
            return self._answer(self._probing[b], prompts_join)
        return spec_wins

    def _answer(self, probe: Probe, prompts_join: bool) -> bool:
        """The arm a step takes while this probe runs. A re-probe of trees waits for a step that only decodes
        (the step decodes plainly, as the standing verdict says): a step that carries a joining prompt's chunk
        is not recorded (see record), so trees drafted on it are paid for and measure nothing, and the probe
        runs on until enough steps that only decode come. On an H100 (scale track, 0.8, 2026-12-06) re-probes
        at 32-63 sequences fell due as a wave of `tandem bench`'s requests ended and the next joined: one drafted
        trees on 9 steps that carried the joining prompts (379 ms, 9% of the level's step time; plain steps
        with joins took 10-14 ms) before its one recorded step, and auto read 0.91 of `never` in that round of
        32 requests; another, at 64 requests, on 6 such steps (496 ms, 9%; 0.84 of `never`).
        A first probe still drafts on such steps, `probe_steps` of them at most (drafted_on_joins counts them), and
        then waits too: a load is first met while its requests join, and the drafts take the prompts in on those
        steps, but where every step carries a join (short outputs behind long prompts) a first probe would record
        nothing and draft trees on every step at that load, however much they lose. On an H100 `tandem bench`'s
        warm-up (16-token requests behind 1024-token prompts) had a first probe of trees at 32-63 sequences draft
        on 42 such steps (1.6 s) before its recorded ones (scale track, 0.8, 2026-12-06)."""
        if not (probe.spec and prompts_join):
            return probe.spec
        return not probe.reprobe and probe.joins < self.probe_steps

    def drafted_on_joins(self, seqs: int) -> None:
        """A step at this load drafted trees and carried a joining prompt's chunk (see _answer): call after it ran."""
        b = batch_bucket(seqs)
        probe = self._probing.get(b)
        if seqs >= self.min_batch and probe is not None and probe.spec:
            self._probing[b] = probe._replace(joins=probe.joins + 1)

    def would_allow_spec(self, seqs: int) -> bool:
        """allow_spec's standing answer at this load, without starting or dropping a probe: for a
        step in which no auto request could draft (all still take in their prompts), so that their
        prefill feeds the drafts only where trees may be chosen once they decode. A load whose workload
        mix moved is forgotten here too (see mix_shift): a stale plain verdict would keep prompts unfed."""
        if seqs < self.min_batch:
            return True
        b = batch_bucket(seqs)
        self._forget_if_idle(b)
        self._forget_if_moved(b)
        if self._trees_need_no_probe(b):
            return False
        probe = self._probing.get(b)
        return self._answer(probe, prompts_join=True) if probe is not None else self._verdict.get(b, True)

    def _set_verdict(self, b: int, spec: bool) -> None:
        self._verdict[b] = spec
        self._against[b] = 0
        mix = self.prompts.mix()
        if mix is not None:
            self._verdict_mix[b] = mix

    def _forget_if_moved(self, b: int) -> None:
        """This load is measured afresh where its verdict was taken under a workload mix that has since
        moved by `mix_shift` (see there): its verdict, arm figures and own prompt charges are dropped, the
        audit's running sums kept. Only the load asked about: a stale plain verdict at a lighter load still
        spares a heavier one its probe of trees (trees only cost more as the batch grows, whatever the
        mix), and where that lighter load, met again, finds trees winning, the heavier one is new again.
        Forgetting every load at once would have a server busy at 64 requests probe trees there, its
        dearest probe, the moment its traffic changed."""
        then, now = self._verdict_mix.get(b), self.prompts.mix()
        if then is None or now is None or max(then, now) <= self.mix_shift * min(then, now):
            return
        self.remeasured.append((b, then, now))
        self._forget_figures(b)
        for state in (self._verdict, self._verdict_mix, self._unsettled, self._probe_lost, self._catch_up,
                      self._against):
            state.pop(b, None)
        self.prompts.forget(b)

    def _forget_if_idle(self, b: int) -> None:
        """This load is measured afresh where it has no verdict and was last met over idle_forget_seconds ago
        (see there): its arms' figures and a pending first probe are dropped, the audit's running sums kept."""
        now = self.clock()
        last, self._met[b] = self._met.get(b), now
        if last is None or b in self._verdict or now - last <= self.idle_forget_seconds:
            return
        self._forget_figures(b)

    def _forget_figures(self, b: int) -> None:
        """Drops this load's arm figures (the audit's running sums stay) and a probe pending there."""
        for spec in (True, False):
            arm = self.arms.get((b, spec))
            if arm is not None:
                arm.forget()
        if b in self._probing:
            self._drop_probe(b)

    def _trees_need_no_probe(self, b: int) -> bool:
        """This load has no verdict (a first probe may be under way) and plain decoding won at a lighter one."""
        return b not in self._verdict and self._plain_won_below(b)

    def _drop_probe(self, b: int) -> None:
        del self._probing[b]
        self._probe_spent.pop(b, None)

    def _stale_after(self, b: int, spec_wins: bool) -> float:
        winner, loser = self.arms[(b, spec_wins)], self.arms[(b, not spec_wins)]
        if min(winner.goodput, loser.goodput, winner.seconds, loser.seconds) <= 0:
            return self.stale_after
        reprobe = self.probe_steps // 4 + 1  # unrecorded warm-up steps, then one recorded
        # As delivered, prompts charged, as the verdict was taken: on decode steps alone trees at 64-127 sequences
        # measured 8912 tok/s against plain's 8427 on an H100 (scale track, 0.8, 2026-12-05) where their prompts
        # made them lose; read raw, a re-probe lost nothing, and trees were probed again every 48 steps (9% of
        # auto's step time in the level went to tree steps; `always` delivered 0.9x `never` there).
        shortfall = 1.0 - self._delivered(b, not spec_wins) / self._delivered(b, spec_wins)
        lost = reprobe * loser.seconds * max(0.0, shortfall)
        lost = max(lost, self._probe_lost.get(b, 0.0))  # what the last probe here really lost
        steps = lost / (self.probe_budget * winner.seconds)
        return min(max(steps, self.stale_after), self.stale_after * self.max_stale_factor)

    def _judged_below(self, b: int) -> int | None:
        """The nearest smaller bucket that has a verdict (None: no such bucket)."""
        return max((x for x in self._verdict if x < b), default=None)

    def _plain_won_below(self, b: int) -> bool:
        """Whether the nearest smaller bucket with a verdict measured trees and decodes plainly."""
        below = self._judged_below(b)
        return below is not None and not self._verdict[below] and self.arms[(below, True)].samples > 0

    def _delivered(self, b: int, spec: bool, rate: float | None = None) -> float:
        """An arm's goodput at this load (or `rate`, one step of it) as delivered: its prompts' charge included."""
        return self.prompts.delivered(spec, self.arms[(b, spec)].goodput if rate is None else rate, b)

    def _judge(self, b: int, afresh: bool = False) -> bool:
        """Speculate? A load's first verdict (or, `afresh`, its second opinion) goes to the arm that
        measured better; a later one keeps the standing verdict unless the other arm measured `margin`
        times better (no flapping on noise). Keeping trees until plain decoding beat them by `margin`
        from the first verdict on chose trees at 8-15 sequences on the H200 where plain had measured 4%
        better (1,620 against 1,556 tok/s) and `always` delivered 0.8x `never`: auto read 0.84x `never` there."""
        spec, plain = self._delivered(b, True), self._delivered(b, False)
        standing = None if afresh else self._verdict.get(b)
        if standing is None:
            return spec >= plain
        return plain <= self.margin * spec if standing else spec > self.margin * plain

    def _close(self, b: int) -> bool:
        """Whether the arms' delivered figures at this load came within `margin` of each other."""
        spec, plain = self._delivered(b, True), self._delivered(b, False)
        return max(spec, plain) < self.margin * min(spec, plain)

    def probing_spec(self, seqs: int, prompts_join: bool = False) -> bool:
        """Whether this step measures trees at this load (ask after allow_spec, with its prompts_join): then
        the policy drafts them even where its acceptance figures say they do not pay, since those may be stale
        (a budget judged on two trees at the start of a request, then never tried again)."""
        probe = self._probing.get(batch_bucket(seqs))
        return seqs >= self.min_batch and probe is not None and self._answer(probe, prompts_join)

    def first_probe_of_trees(self, seqs: int) -> bool:
        """Whether this load's trees are being measured for the first time (a first probe, not a re-probe)."""
        probe = self._probing.get(batch_bucket(seqs))
        return probe is not None and probe.spec and not probe.reprobe and not probe.second

    def predict(self, seqs: int, rates: Rates) -> None:
        """Keeps what the cost model predicts for each arm at this load, next to what the arms
        measure (describe, audit): the policy's decisions can be checked against what followed."""
        b = batch_bucket(seqs)
        for rate, seconds, arms, key in ((rates.plain, rates.plain_seconds, self.arms, (b, False)),
                                         (rates.trees, rates.trees_seconds, self.arms, (b, True)),
                                         (rates.configured, rates.configured_seconds, self._configured, b)):
            if rate is None or rate <= 0:
                continue
            arm = arms.setdefault(key, Arm())
            arm.predicted = rate if arm.predicted is None else 0.7 * arm.predicted + 0.3 * rate
            arm.predicted_sum += rate
            arm.predictions += 1
            if seconds is not None:
                arm.predicted_seconds_sum += seconds
                arm.predicted_tokens_sum += rate * seconds

    def audit(self) -> list[AuditRow]:
        """Per bucket and arm seen so far, what was predicted and measured: decayed means (None where
        nothing was) and running sums (see Arm)."""
        arms = list(self.arms.items())  # one snapshot: the loop thread adds arms while a scrape reads
        rows = [AuditRow(bucket_range(b), AuditArm.TREES if spec else AuditArm.PLAIN, arm.predicted,
                         arm.goodput if arm.samples else None, arm.predicted_sum, arm.predictions,
                         arm.committed_total, arm.seconds_total, self.prompts.seconds_per_token(spec, b),
                         arm.predicted_seconds_sum, arm.predicted_tokens_sum)
                for (b, spec), arm in sorted(arms)]
        configured = list(self._configured.items())
        return rows + [AuditRow(bucket_range(b), AuditArm.CONFIGURED_TREE, arm.predicted, None, arm.predicted_sum,
                                arm.predictions, 0, 0.0, None, arm.predicted_seconds_sum, arm.predicted_tokens_sum)
                       for b, arm in sorted(configured)]

    def spend(self, seqs: int, committed: int, seconds: float) -> None:
        """Any decode step of auto requests, whether record is given it or not (a plain step that fed
        the drafts, a round that captured a graph): while a probe runs at its load, what the probe
        costs. Call before record, which may end the probe with this very step."""
        b = batch_bucket(seqs)
        spent = self._probe_spent.setdefault(b, [0.0, 0.0]) if b in self._probing else self._catch_up.get(b)
        if spent is not None:
            spent[0] += seconds
            spent[1] += committed

    def _end_probe(self, b: int) -> None:
        probe = self._probing.pop(b)
        seconds, committed = self._probe_spent.pop(b, (0.0, 0.0))
        winner = self.arms[(b, self._verdict[b])]
        if winner.goodput <= 0:
            return
        if not probe.spec and self._verdict[b]:
            # A probe of plain decoding where trees won, on its decode steps against trees' own: it saves none
            # of trees' prompt charge, since a prompt that joins meanwhile is fed to its draft when trees resume
            # (the catch-up after the probe). Charged as delivered, both arms' charges came off what it lost: on
            # an H100 (scale track, 0.8, 32 requests, 2026-12-06) the gate put a probe at 4-9 ms lost (trees
            # charged 34-60 us a token for prompts, plain 13), where its 8 granted steps and the 3 fed ones
            # after took 88 ms for 352 tokens that trees commit in about 60; re-probed every 48 steps, auto
            # read 0.94-0.97 of `always`, drafting as `always` drafts. The fed steps join in _end_catch_up.
            self._probe_lost[b] = max(0.0, seconds - committed / winner.goodput)
            self._catch_up[b] = [0.0, 0.0]
        else:
            # Any other probe, both sides as delivered (see _stale_after): a probe of trees feeds the prompts
            # that join it.
            charged = seconds + committed * self.prompts.seconds_per_token(probe.spec, b)
            self._probe_lost[b] = max(0.0, charged - committed / self._delivered(b, self._verdict[b]))

    def _end_catch_up(self, b: int, committed: int, seconds: float) -> None:
        """The first recorded tree step after a probe of plain decoding that trees won (its own seconds and
        tokens, already spent into the catch-up, are taken out): what the steps between lost joins what
        the probe lost."""
        spent = self._catch_up.pop(b)
        trees = self.arms[(b, True)]
        if trees.goodput > 0:
            tail_seconds, tail_committed = spent[0] - seconds, spent[1] - committed
            self._probe_lost[b] = (self._probe_lost.get(b, 0.0)
                                   + max(0.0, tail_seconds - tail_committed / trees.goodput))

    def record(self, seqs: int, spec: bool, committed: int, seconds: float, load: int | None = None,
               lightest: Callable[[int], float] | None = None, expected: float | None = None) -> bool | None:
        """Records a decode step of `seqs` sequences at `load` (requests in the gateway, the bucket judged;
        default seqs); returns the new verdict (speculate?) when this step ended a probe or, outside one,
        overturned the standing verdict (see _overturned). `expected`: the tokens the acceptance book expected
        the step to commit (None: not known; see expected_weight).

        `lightest(n)`: what the step would have taken with its first n sequences alone (the cost model's
        figure for that shape, scaled by what the step measured). A step heavier than its bucket's lightest
        count is recorded as that many sequences would have run, so that both arms are judged at one batch
        size: a bucket spans a doubling of the batch, over which a plain step's time barely grows. On an H100
        (scale track, 0.8, 2026-12-06) the tails of `tandem bench`'s 64-request levels (56-63 sequences,
        granted plain steps) measured plain decoding at 32-63 at 6,401 tok/s, trees were measured at 32
        requests, and `auto` decoded plainly there where `always` delivered 1.06x `never` (0.93 of it)."""
        if seconds <= 0:
            return None
        b = batch_bucket(seqs if load is None else load)
        lo = 1 << (b - 1)
        delivered = committed, seconds  # what the step really did: the audit's running sums
        expected = committed if expected is None else expected
        if lightest is not None and seqs > lo:
            committed, expected, seconds, seqs = committed * lo / seqs, expected * lo / seqs, lightest(lo), lo
            if seconds <= 0:
                return None
        if 2 * seqs < lo:
            # A step that carries under half its load's lightest count measures a lighter batch: the held
            # load (HeldLoad) still judged 64-127 while a `tandem bench` level's 64 requests ended and the
            # next ones were joining. On an H100 (scale track, 0.8, 2026-12-05) eight granted steps of 2
            # sequences there took plain decoding at 64-127 from 8386 to 778 tok/s: trees (5519) won the
            # verdict and were probed and drafted at 64 requests, where `always` delivered 0.73x `never`.
            return None
        if spec and b in self._catch_up:
            self._end_catch_up(b, committed, seconds)
        if b in self._unsettled:
            self._unsettled[b] += 1
        # Only steps of the probed arm count towards a probe: while trees are probed the cost
        # model may still choose none, and such a step says nothing about trees.
        probe = self._probing.get(b)
        probing = probe is not None and probe.spec == spec
        # A step lighter than its load's lightest count (but not under half, above) is this load's as a probe
        # measures it, where the load cannot fill its batch (a request waiting for KV), but it does not move a
        # standing arm's figures: they would mix batch sizes the other arm was not measured at. On an H100
        # (scale track, 0.6, 4 requests, 2026-12-05) a `tandem bench` level's last ten tree steps carried 3
        # and 2 sequences under the held load of 4-7; they took trees' figure from about 830 to 531 tok/s,
        # the re-probe of plain decoding that came at the next level's start measured 4 sequences at 648 and
        # won, and trees came back after a quarter of the level (auto 0.95 of `always`).
        lighter = seqs < lo
        recorded = not lighter if not probing else (
            probe.lengthened or probe.steps_left <= self.probe_steps - self.probe_steps // 4)
        this = self.arms.setdefault((b, spec), Arm())
        other = self.arms.setdefault((b, not spec), Arm())
        this.committed_total += delivered[0]
        this.seconds_total += delivered[1]
        rate = committed / seconds
        if recorded:
            weight = 1.0 / min(this.samples + 1, TOKENS_WINDOW)
            this.tokens_per_seq += weight * (committed / seqs - this.tokens_per_seq)
            this.expected_per_seq += weight * (expected / seqs - this.expected_per_seq)
            this.measured_seqs = min(this.samples + 1, TOKENS_WINDOW) * seqs
            this.seq_rate = seqs / seconds if this.samples == 0 else 0.7 * this.seq_rate + 0.3 * seqs / seconds
            tokens = this.judged_tokens(self.expected_weight)
            rate = tokens * seqs / seconds  # this step's cost at the arm's usual tokens (see Arm)
            this.goodput = tokens * this.seq_rate
            this.seconds = seconds if this.samples == 0 else 0.7 * this.seconds + 0.3 * seconds
            this.samples += 1
            this.since = 0
        other.since += 1
        if not probing:
            return self._overturned(b, spec) if recorded else None
        first_probe = not probe.reprobe and not probe.second
        if recorded:
            probe = probe._replace(committed=probe.committed + committed, seconds=probe.seconds + seconds,
                                   expected=probe.expected + expected, sequences=probe.sequences + seqs)
            if self.close_probe_steps and first_probe:  # see close_probe_steps, and expected_weight
                tokens = shrunk(probe.committed / probe.sequences, probe.expected / probe.sequences, probe.sequences,
                                self.expected_weight)
                this.goodput = tokens * probe.sequences / probe.seconds
        # Clearly losing on fresh figures settles it early (judging on the stale figure that started
        # the probe would end every probe at once, and re-probe on every step): a re-probe after one
        # recorded step, a first probe after `clear_steps` in a row.
        # Rates as delivered: see PromptCharges.
        others, step_rate = self._delivered(b, not spec), self._delivered(b, spec, rate)
        losses = probe.clear_losses + 1 if recorded and other.samples and others >= self.clear * step_rate else 0
        if probe.reprobe:
            settled = recorded and other.samples and (others >= self.clear * self._delivered(b, spec)
                                                      or others >= self.margin * step_rate)
        else:
            settled = losses >= self.clear_steps
        if probe.steps_left > 1 and not settled:
            self._probing[b] = probe._replace(steps_left=probe.steps_left - 1, clear_losses=losses)
            return None
        if not other.samples:
            self._drop_probe(b)
            return None
        if (self.close_probe_steps and spec and first_probe and not probe.lengthened and not settled
                and self._close(b)):
            self._probing[b] = probe._replace(steps_left=self.close_probe_steps, clear_losses=losses, lengthened=True)
            return None
        first = b not in self._verdict
        self._set_verdict(b, self._judge(b, afresh=probe.second))
        # A second opinion is due (see allow_spec) where trees won a close first verdict, not where plain
        # decoding did: measuring plain again costs a few plain steps, while measuring trees again after
        # plain steps first has every request's draft catch up on the tokens it slept through. On the H200
        # scale track (0.8, 16-31 sequences, 2026-12-04) plain won a first verdict by 9% with prompts charged,
        # `never` delivered 1.16x `always` there, and the second opinion only probed trees again to confirm it.
        if first and self._verdict[b] and self._close(b):
            self._unsettled[b] = 0
        self._end_probe(b)
        return self._verdict[b]

    def _overturned(self, b: int, spec: bool) -> bool | None:
        """A step of the standing verdict's losing arm, recorded outside any probe (the cost model chose it:
        a dormant request's granted plain steps under a verdict for trees): once `probe_steps` such steps have
        come since the verdict, the verdict is judged again on the arms' figures as they stand, with the margin,
        and overturned where the loser now measures `margin` times better. Returns the new verdict, else None.
        Why: a verdict was otherwise judged again only when a probe ended, and plain steps the cost model chose
        kept plain decoding's figure fresh, so its re-probe never fell due. On an H100 (demo track, bf16, one
        request, `--gate-min-batch 1`, 2026-12-06) the warm-up's six lucky tree steps (2,542 tok/s) set trees
        against one plain step; through the levels plain decoding then measured 2,643-3,488 tok/s over 254-637
        steps against trees' 1,186-1,841, the verdict stood, and auto read 0.77 of `never`."""
        verdict = self._verdict.get(b)
        if verdict is None or spec == verdict or b in self._probing:
            return None
        self._against[b] = self._against.get(b, 0) + 1
        if self._against[b] < self.probe_steps or self._judge(b) == verdict:
            return None
        self._unsettled.pop(b, None)
        self._set_verdict(b, spec)
        self.overturned.append(b)
        return spec

    def outlook(self, seqs: int) -> str:
        """When this load's losing arm is measured again, and what its last probe lost (the price a re-probe
        is spaced by, see probe_budget), for the log line of a verdict."""
        b = batch_bucket(seqs)
        if b not in self._verdict or (b, True) not in self.arms or (b, False) not in self.arms:
            return "no verdict"
        loser = "plain decoding" if self._verdict[b] else "trees"
        lost = self._probe_lost.get(b)
        # After a probe of plain decoding that trees won, what the drafts' catch-up costs joins it later.
        spent = "" if lost is None else f" (the last probe here lost {1e3 * lost:.1f} ms so far)"
        if b in self._unsettled:
            return f"{loser} measured again in {self.stale_after} steps, a second opinion{spent}"
        return f"{loser} measured again in {self._stale_after(b, self._verdict[b]):.0f} steps{spent}"

    def describe(self, seqs: int) -> str:
        """The arms of this load's bucket, measured and predicted, for logs."""
        b = batch_bucket(seqs)
        s, p = self.arms.get((b, True), Arm()), self.arms.get((b, False), Arm())

        def predicted(arm: Arm) -> str:
            return "" if arm.predicted is None else f", predicted {arm.predicted:.1f}"

        probe = self._probing.get(b)
        probing = "" if probe is None else (f", probing {'trees' if probe.spec else 'plain'}"
                                            f"{' again' if probe.second else ''} ({probe.steps_left} left)")
        if b in self._unsettled:
            probing += f", close: the loser measured again in {max(0, self.stale_after - self._unsettled[b])} steps"
        charges = ""
        trees_charge, plain_charge = self.prompts.seconds_per_token(True, b), self.prompts.seconds_per_token(False, b)
        if trees_charge or plain_charge:
            charges = (f", prompts add {1e6 * trees_charge:.0f} us a token to trees and {1e6 * plain_charge:.0f}"
                       " to plain")
        return (f"{bucket_range(b)} sequences: trees {s.goodput:.1f} tok/s ({s.samples} steps{predicted(s)}), "
                f"plain {p.goodput:.1f} tok/s ({p.samples} steps{predicted(p)}){probing}{charges}")
