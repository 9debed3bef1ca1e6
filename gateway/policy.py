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

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from draft_service.types import MAX_STEPS, DraftBudget
from gateway.acceptance import AcceptanceBook, LevelRates
from gateway.cost_model import CostModel

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
    rates = Rates(plain=plain_rate, trees=top_tree_rate, configured=configured_rate,
                  plain_seconds=plain_seconds if candidates else None, trees_seconds=top_tree_seconds,
                  configured_seconds=configured_seconds)
    return BudgetSearch(out=out, auto=auto, best=best, single=single, every=every, rates=rates, ceiling=ceiling,
                        plain_now=plain_now)


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

