"""The load gate: whether trees or plain decoding pay at the gateway's load, judged from each arm's measured
goodput per batch bucket, with the audit's rows (what each arm was predicted against what it delivered)."""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from gateway.cost_model import batch_bucket, bucket_range
from gateway.policy import Rates

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
                self._probing[b] = Probe(spec=key, steps_left=self.probe_steps, reprobe=False)
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

