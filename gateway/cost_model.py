"""What a step costs: a profiled linear model of the target's and the draft's step times, corrected online per
batch bucket (and per tree option) by what steps measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_service.types import DraftBudget


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

