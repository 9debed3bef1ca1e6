"""The gateway core: owns every request and runs the step loop.

    while running:
        take new requests and aborts
        plan = schedule()                      # who runs, which tokens, how much each speculates
        trees = draft(plan)                    # one call per replica; failures -> plain decode
        for outcome in execute(plan, trees):   # one target step, or a grant of k plain steps
            update(outcome)                    # commit, emit, feed the draft, release the finished
            record(outcome)                    # metrics, cost model, load gate

One thread (the loop) owns request state, draft links included; draft replica
workers report back through a queue the loop drains at the top of each step.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from draft_service.types import DraftBudget, DraftTree, IngestItem
from gateway import tracing
from gateway.acceptance import AcceptanceBook, chains_would_accept, main_path
from gateway.clients import DraftClient, TargetClient, TargetUnavailable
from gateway.cost_model import CostModel, batch_bucket, bucket_range
from gateway.draft_pool import DraftPool, DraftReplica
from gateway.load_gate import HeldLoad, LoadGate
from gateway.metrics import GatewayMetrics, observe_times
from gateway.policy import NO_SPEC, BudgetSearch, Candidate, PolicyConfig, choose_budgets, search_budgets
from gateway.request import DraftLink, Phase, Request
from gateway.scheduler import PlannedItem, SchedulerConfig, StepPlan, blocks_for, plan_step
from gateway.types import DeltaSink, FinishReason, GenerationParams, SpecMode
from tandem import timeline
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from target_service.types import KvLoad, SamplingParams, SequenceResult, SequenceStep
from target_service.wire import GrantStops

log = logging.getLogger("tandem.gateway")

# While idle, how often the loop asks whether the target still serves (under load every step asks).
TARGET_PROBE_S = 1.0
# While idle, how many health checks in a row may go unanswered (2 s each) before the target counts as lost. A
# refusal or a NOT_SERVING answer counts at once; a check that times out is what a busy host does as well as a hung
# target, and one such miss on a loaded 2-core machine once turned a test's next request into a 503 (stop 53).
IDLE_TARGET_MISSES = 3
# Between health checks of a lost target: from the first to the longest.
TARGET_RETRY_S = (0.1, 1.0)


@dataclass
class WakeSchedule:
    """When auto's requests sleep and wake at one load (see GatewayCore._track_quiet)."""

    wake_every: int  # quiet steps from the last wake-up to the next
    quiet: int = 0  # consecutive steps in which auto chose no tree
    spell_start: int = 0  # the quiet count at which auto requests last woke (0: the first spell)
    # A wake-up's decode steps so far: [their seconds, the seconds as many granted plain steps would take]
    wake_cost: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # Plans made at this load since the gateway last came to it (_plain_extra_seconds): a lower bound of its
    # steps, since a grant's plan runs several.
    held_steps: int = 0
    # Dormant before QUIET_STEPS quiet steps: plain decoding won by a wide margin (GatewayCore._sleeps_at_once).
    # Until the next wake-up or tree.
    asleep: bool = False

    def speculating(self, wake_every: int) -> None:
        """Trees were chosen: awake from now, and the next wake-up as soon as any."""
        self.quiet, self.spell_start, self.wake_every = 0, 0, wake_every
        self.wake_cost = [0.0, 0.0]
        self.asleep = False


@dataclass(frozen=True, kw_only=True)
class CoreConfig:
    policy: PolicyConfig = PolicyConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    max_queue: int = 1024
    max_model_len: int | None = None
    profile: bool = True  # measure the cost model at start-up
    # Tokens of context each request holds in the start-up rounds of gateway.profiling.price_rounds: set near
    # the traffic's typical prompt plus output, since a round's attention reads it.
    profile_context: int = 32
    # Plain-decode steps granted to the target at once when a batch decodes plainly; 1 = one call
    # per step.
    grant_steps: int = 1
    # Grants for awake auto requests too (a fed grant: the target pushes each step's features to the
    # drafts), up to the next step at which the policy may draft or the requests go dormant. Off by
    # default: on the H200 no gain showed beyond the spread between serves (BENCHMARKS.md, "Fed
    # grants"), and with them on, a CI run of the emulated-cost phase test had a lone request speculate
    # in 26% of its steps (68-94% in seven other runs here), under the test's 50%. Not established why;
    # one candidate: fed steps that cost less price plain decoding higher while requests are awake.
    fed_grants: bool = False
    # Recorded steps by which a close first probe of trees is lengthened, judged on its mean (LoadGate's
    # close_probe_steps; 0: off). 16 by default: measured on the H200 (BENCHMARKS.md, "Common draws").
    gate_close_probe_steps: int = 16
    # Sequences' worth of weight the acceptance book's expectation of a tree step's tokens carries against the
    # tokens measured (LoadGate.expected_weight, see there for why; 0: the measured tokens alone).
    gate_expected_weight: float = LoadGate.expected_weight
    # Sequences from which the load gate measures the arms and decides (LoadGate.min_batch, see there for why
    # 1); below it the cost model's figures alone decide.
    gate_min_batch: int = LoadGate.min_batch
    # Plans, and seconds, for which the load gate keeps judging the highest load it met (HeldLoad, see there for
    # why; 1 plan: each plan at its own load).
    gate_load_hold_plans: int = HeldLoad.plans
    gate_load_hold_seconds: float = HeldLoad.seconds
    gate_load_quiet_hold_seconds: float = HeldLoad.quiet_seconds  # where no request joined lately
    # How long running requests wait for a lost target to return (then they end UNAVAILABLE).
    target_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.target_wait_s >= 0:
            raise ValueError(f"target wait must be >= 0 seconds, got {self.target_wait_s}")
        if self.grant_steps < 1:
            raise ValueError(f"grant steps must be >= 1, got {self.grant_steps}")
        if self.profile_context < 1:
            raise ValueError(f"the profile's context must be >= 1 token, got {self.profile_context}")
        if self.max_queue < 1:
            raise ValueError(f"max queue must be >= 1, got {self.max_queue}")
        if self.gate_close_probe_steps < 0:
            raise ValueError(f"gate close-probe steps must be >= 0, got {self.gate_close_probe_steps}")
        if not self.gate_expected_weight >= 0:
            raise ValueError(f"gate expected weight must be >= 0, got {self.gate_expected_weight}")
        if self.gate_min_batch < 1:
            raise ValueError(f"gate min batch must be >= 1, got {self.gate_min_batch}")
        if self.gate_load_hold_plans < 1:
            raise ValueError(f"gate load hold must be >= 1 plan, got {self.gate_load_hold_plans}")
        if not self.gate_load_hold_seconds >= 0:
            raise ValueError(f"gate load hold must be >= 0 seconds, got {self.gate_load_hold_seconds}")
        if not self.gate_load_quiet_hold_seconds >= 0:
            raise ValueError(f"gate load quiet hold must be >= 0 seconds, got {self.gate_load_quiet_hold_seconds}")


@dataclass(frozen=True, kw_only=True, eq=False)
class StepOutcome:
    """One target step as the gateway saw it."""

    items: list[PlannedItem]  # the planned items these results are for, in order
    results: list[SequenceResult]
    load: KvLoad
    seconds: float  # wall time at the gateway, from sending (or the previous reply) to this reply
    trees: dict[str, DraftTree]
    granted: int  # 0: a plain call; k >= 1: the k-th step of a grant
    held_features: bool = False  # the target kept the features asked for, for the replicas to read
    fed_draft: bool = False  # some request asked for features: not how plain decoding runs
    fed_prompt: bool = False  # some prompt's chunk asked for features (its request may be offered trees)


def _feature_rows(item: IngestItem) -> int:
    """Rows of features an ingest item brings, sent or held at the target."""
    return item.num_feature_rows or item.target_feature_rows


def _prompt_tokens(req: Request, item: IngestItem) -> int:
    """Tokens of req's prompt that an ingest item brings the draft."""
    return max(0, min(item.start_position + len(item.tokens), len(req.prompt)) - item.start_position)


def _step_kind(outcome: StepOutcome, decode: bool) -> str:
    """The kind of target step an outcome was (tandem_step_kind_seconds)."""
    if outcome.trees:
        return "trees"
    if not decode:
        return "prefill"
    if outcome.granted:
        return "granted"
    return "fed" if outcome.fed_draft else "plain"


def _expected_tokens(plan: StepPlan, outcome: StepOutcome, seqs: int) -> float | None:
    """A tree step's expected tokens for the load gate: a token a sequence, and what each tree was expected
    to accept (plan.expected_accepted); None for a plain step, or where a tree has no figure."""
    if not outcome.trees or any(rid not in plan.expected_accepted for rid in outcome.trees):
        return None
    return seqs + sum(plan.expected_accepted[rid] for rid in outcome.trees)


def _other_work(plan: StepPlan, cands: list[Candidate]) -> tuple[int, int]:
    """(tokens, sequences) of the plan's items that are not among `cands`."""
    keys = {c.key for c in cands}
    other = [it for it in plan.items if it.request.request_id not in keys]
    return sum(len(it.tokens) for it in other), len(other)


class GatewayCore:
    def __init__(self, target: TargetClient, drafts: list[DraftClient], tokenizer, cfg: CoreConfig,
                 model_name: str, metrics: GatewayMetrics | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.cfg = cfg
        # cfg is frozen: the mode of requests that name none is fixed, and asked several times per step.
        self._default_mode = SpecMode(cfg.policy.mode)
        self.model_name = model_name
        self.metrics = metrics or GatewayMetrics()
        # A replica back from a loss reports its KV: where the last requests ended while it was away, the idle
        # refresh (_release_finished) found no healthy replica, and the gauge kept what it held before the loss
        # (a CI soak that killed the draft read it above 0 for 60 s after every request had ended).
        self.pool = DraftPool(drafts, on_lost=lambda _r: self._wake.set(),
                              on_back=self._refresh_draft_usage)
        self.costs = CostModel()
        self.book = AcceptanceBook(own_weight=cfg.policy.own_weight,
                                   own_weight_from_spread=cfg.policy.own_weight_from_spread)
        self.gate = LoadGate(close_probe_steps=cfg.gate_close_probe_steps, min_batch=cfg.gate_min_batch,
                             expected_weight=cfg.gate_expected_weight)
        self._held_load = HeldLoad(plans=cfg.gate_load_hold_plans, seconds=cfg.gate_load_hold_seconds,
                                   quiet_seconds=cfg.gate_load_quiet_hold_seconds)
        self.metrics.watch_policy(self.gate.audit, self.gate.prompts.seconds_per_token)
        self.max_model_len = 0
        self.feature_layers: tuple[int, ...] = ()
        self.eos_ids: frozenset[int] = frozenset()
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids: set[str] = set()
        self._reports: queue.SimpleQueue = queue.SimpleQueue()  # draft workers -> loop: caught-up links
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_blocks = 0
        self._block_size = 16
        self._vocab = 0
        self._ready = False
        self._draining = False
        self._target_down = False  # the target is unreachable: new requests are refused
        self._target_checked = 0.0  # when an idle loop last asked the target's health
        self._target_misses = 0  # idle health checks in a row that got no answer in time
        # Called with ready() whenever it changes (the gRPC health status follows it).
        self.on_readiness: Callable[[bool], None] | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.step_count = 0
        # When auto's requests sleep and wake, per batch bucket (see _track_quiet), and this step's load's.
        self._wake_schedules: dict[int, WakeSchedule] = {}
        self._dormancy = self._wake_schedule_for(1)
        self._dormant_plans = 0  # plans made while auto's requests slept (see _predict_while_dormant)
        self._explored = False  # this step's auto trees are exploration (see _explore_now)
        self._ramp_steps = 0  # tree steps in a row of the drafts' ramp (see RAMP_SHARE)
        # The load gate measured that plain decoding pays at this step's load: auto requests then
        # run as plain decoding really runs (dormant: no features, no ingest, grantable), so the
        # plain arm is measured as `never` would run and not taxed by feature traffic (issue 14).
        self._gate_plain = False
        self._gate_probing_trees = False  # the gate measures trees at this load: dormant requests wake for it
        self._configured_figures = ""  # the last plan's figures for the configured tree (DEBUG only)
        self._logged_own_weight: float | None = None  # the own weight last logged (--spec-own-weight auto)
        # The auto candidates for whom plain decoding would still win were their own acceptance faded
        # into the book's, as plain steps fade it: the only ones a fed grant may take (_grant_steps).
        self._plain_holds: frozenset[str] = frozenset()
        self._ingest_queue: dict[int, list[tuple[Request, IngestItem]]] = {}  # replica -> this step's ingests
        self._release_after_grant: list[Request] = []
        # Finished requests whose target release failed because the target was unreachable:
        # released when it answers again after the loss (if it never restarted, it holds them).
        self._unreleased: list[str] = []
        # Finished requests whose target release rides on the next step (PackedStep.release_request_ids)
        # while others still run: a Release call of its own stood on the round's critical path (0.4-1.6 ms
        # on the H200's host); their blocks show as free from that step's reply on.
        self._release_next: list[str] = []
        self._release_next_blocks = 0  # their blocks: free for the step that releases them, so planned as free
        # Their drafts' Release calls, per replica, sent behind the next round's draft calls: in the replica's
        # queue ahead of a call, a release made the call wait for its round trip.
        self._draft_releases_next: dict[int, list[str]] = {}
        self._trees_won_in_grant = False  # the load gate chose trees on a step of the grant under way
        # The granted plain steps of the plan under way, per (tokens, sequences, fed): [seconds, steps]. The cost
        # model learns a grant as one measurement, its steps' mean (_learn_grant).
        self._grant_costs: dict[tuple[int, int, bool], list[float]] = {}

    # --- lifecycle ----------------------------------------------------------
    def start(self, timeout: float = 300.0) -> None:
        from gateway.clients import wait_healthy

        wait_healthy(self.target.channel, timeout)
        answering = []
        for replica in self.pool.replicas:
            try:
                wait_healthy(replica.client.channel, timeout)
                answering.append(replica)
            except Unavailable as exc:
                log.warning("draft replica %s unavailable at start (%s): will retry", replica.client.address, exc)
        self.configure(answering)
        if self.cfg.profile:
            from gateway.profiling import profile_costs, warm_draft
            self.costs = profile_costs(self.target, self.pool.healthy()[:1], self.cfg.policy,
                                       self.cfg.grant_steps)
            for replica in self.pool.healthy():
                try:
                    t0 = time.perf_counter()
                    if calls := warm_draft(replica, self.cfg.policy, self.cfg.scheduler.max_running):
                        log.info("draft replica %s: %d warm-up calls in %.1f s (graphs for shapes new to it captured)",
                                 replica.client.address, calls, time.perf_counter() - t0)
                except Exception as exc:  # a graph not captured now is captured on first use
                    log.warning("draft replica %s: warm-up failed (%s)", replica.client.address, exc)
            self._price_rounds()
            log.info("cost model: %s", self.costs)
        for fn, name in ((self._loop, "step-loop"), (self.pool.probe_forever, "draft-probe")):
            thread = threading.Thread(target=fn, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self._ready = True
        self._readiness_changed()

    def _price_rounds(self) -> None:
        """Each tree shape's round timed at start-up, once the draft's graphs are captured (see
        gateway.profiling.price_rounds); a failure leaves the linear fits alone."""
        from gateway.profiling import price_rounds

        replica = next(iter(self.pool.healthy()), None)
        if replica is None:
            return
        try:
            t0 = time.perf_counter()
            if factors := price_rounds(self.target, replica, self.cfg.policy, self.costs,
                                       self.cfg.scheduler.max_running, context=self.cfg.profile_context):
                self.costs.shape_factors = factors
                log.info("priced %d rounds (batch bucket, tree shape) at %d tokens of context in %.1f s",
                         len(factors), self.cfg.profile_context, time.perf_counter() - t0)
        except Exception as exc:  # the linear fits price every shape alike
            log.warning("round pricing failed (%s); trees priced by the linear fits", exc)

    def configure(self, replicas: list[DraftReplica] | None = None) -> None:
        """Learn the model's facts from the target and the feature layers from `replicas`
        (default: all), marking those that answer healthy. start() does this; tests that
        drive the loop by hand call it."""
        info = self.target.info()
        self.max_model_len = min(self.cfg.max_model_len or info.max_model_len, info.max_model_len)
        self._free_blocks = info.load.free_blocks
        self._block_size = info.load.block_size
        eos = set(info.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self._vocab = info.vocab_size
        layers = set()
        for replica in self.pool.replicas if replicas is None else replicas:
            try:
                layers.add(replica.client.info().feature_layers)
                replica.healthy = True
            except Unavailable as exc:
                log.warning("draft replica %s unavailable at start (%s): will retry", replica.client.address, exc)
        if len(layers) > 1:
            raise InvalidArgument(f"draft replicas disagree on feature layers: {sorted(layers)}")
        self.feature_layers = layers.pop() if layers else info.default_feature_layers

    def ready(self) -> bool:
        return self._ready and not self._draining and not self._target_down

    def _readiness_changed(self) -> None:
        if self.on_readiness is not None:
            self.on_readiness(self.ready())

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish within `timeout`, abort the rest."""
        self._draining = True
        self._readiness_changed()
        deadline = time.monotonic() + timeout
        while (self.running or self.waiting or self._inbox) and time.monotonic() < deadline:
            time.sleep(0.05)
        for req in list(self.running) + list(self.waiting):
            self.abort(req.request_id)
        time.sleep(0.2)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self.pool.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        self.target.close()

    # --- API ------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: GenerationParams,
               sink: DeltaSink) -> None:
        if not self._ready:
            raise Unavailable("the gateway is still starting")
        if self._draining:
            raise Unavailable("the gateway is draining")
        if self._target_down:
            raise Unavailable("the target service is unreachable; the gateway is waiting for it to return")
        if not prompt_token_ids:
            raise InvalidArgument("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidArgument(f"the prompt has {len(prompt_token_ids)} tokens; this model allows at most "
                                  f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        bad = [t for t in prompt_token_ids if not 0 <= t < self._vocab]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is out of range")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self._vocab]
        if bad:
            raise InvalidArgument(f"logit_bias token id {bad[0]} is out of the vocabulary (0..{self._vocab - 1})",
                                  param="logit_bias")
        with self._lock:
            if request_id in self._ids:
                raise InvalidArgument(f"request id {request_id!r} is already in use")
            if len(self.waiting) + len(self._inbox) >= self.cfg.max_queue:
                raise ResourceExhausted(f"the queue is full ({self.cfg.max_queue} requests waiting)")
            self._ids.add(request_id)
            req = Request(request_id=request_id, prompt=list(prompt_token_ids), params=params, sink=sink,
                          eos_ids=self.eos_ids, tokenizer=self.tokenizer, max_model_len=self.max_model_len)
            req.span = tracing.start_request_span(req, self.model_name, str(self._mode(req)))  # None if tracing off
            self._inbox.append(req)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    # --- the loop ---------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take_inbox()
            if not self.running and not self.waiting:
                self._wake.wait(0.5)
                self._wake.clear()
                try:
                    self._check_idle_target()
                except Exception:  # the loop must outlive it: a dead loop thread leaves every request hanging
                    log.exception("checking an idle target failed")
                    time.sleep(0.5)
                continue
            try:
                with tracing.step_scope():  # ends the step's span, if step_serves opened one
                    self._step()
            except TargetUnavailable as exc:
                self._target_lost(str(exc))
            except Exception:
                log.exception("step failed; aborting the running requests")
                for req in list(self.running):
                    self._finish(req, FinishReason.ABORT)
                time.sleep(0.5)

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = set(self._aborts), deque()
        self.waiting.extend(new)
        if aborts:
            for req in list(self.running) + list(self.waiting):
                if req.request_id in aborts:
                    self._finish(req, FinishReason.ABORT)
        self.metrics.requests_waiting.set(len(self.waiting))

    def _step(self) -> None:
        """One round of the loop: schedule, draft, then execute/update/record per target step.
        Each phase's wall time goes to tandem_step_phase_seconds{phase} (where a round's time goes)."""
        phase = self.metrics.step_phase
        t0 = round_start = time.perf_counter()
        timeline.mark("gw.round")
        self._apply_reports()
        plan = self._schedule()
        if plan is None:
            return
        timeline.mark("gw.scheduled")
        tracing.step_serves(plan.items)  # the step's span, linked to its requests' (tracing on only)
        t1 = time.perf_counter()
        phase["schedule"].observe(t1 - t0)
        trees = self._draft(plan)
        t0 = time.perf_counter()
        phase["draft"].observe(t0 - t1)
        timeline.mark("gw.draft.end")
        # (schedule, draft): the round's first target step carries them, a grant's later steps none.
        before = (t1 - round_start, t0 - t1)
        for outcome in self._execute(plan, trees):
            t1 = time.perf_counter()
            executed = t1 - t0
            phase["execute"].observe(executed)
            timeline.mark("gw.execute.end")
            self._update(plan, outcome)
            t0 = time.perf_counter()
            timeline.mark("gw.update.end")
            phase["update"].observe(t0 - t1)
            self._record(plan, outcome, round_start, phases=(*before, executed, t0 - t1))
            before = (0.0, 0.0)
            t1, t0 = t0, time.perf_counter()
            phase["record"].observe(t0 - t1)
            timeline.mark("gw.record.end")
        self._learn_grant()

    # --- schedule ------------------------------------------------------------------
    def _schedule(self) -> StepPlan | None:
        """Who runs this step and how much each speculates; None when the round only preempted."""
        self._detach_lost_drafts()
        # A verified tree commits at most its depth: that bounds the KV a decode may need.
        max_depth = max(b.steps for b in [*self.cfg.policy.auto_options(), self.cfg.policy.fixed_budget])
        plan = plan_step(self.cfg.scheduler, self.running, self.waiting, self._plannable_blocks, max_depth)
        for req in plan.preempted:
            self._preempt(req)
        if plan.admitted:
            admitted = {id(req) for req in plan.admitted}
            self.waiting = [req for req in self.waiting if id(req) not in admitted]
            for req in plan.admitted:
                req.phase = Phase.RUNNING
                self.running.append(req)
                self._attach_draft(req)
        if not plan.items:
            if plan.preempted:
                return None
            raise RuntimeError(f"nothing schedulable: {len(self.running)} running, {len(self.waiting)} waiting, "
                               f"{self._plannable_blocks} KV blocks free")
        plan.load = self._held_load.hold(max(len(self.running) + len(self.waiting), len(plan.items)),
                                         joined=bool(plan.admitted))
        sched = self._wake_schedule_for(plan.load)
        if sched is not self._dormancy:
            sched.held_steps = 0
        sched.held_steps += 1
        self._dormancy = sched
        plan.budgets = self._budgets(plan)
        plan.expected_accepted = self._expected_accepted(plan)
        self._track_quiet(plan)
        if log.isEnabledFor(logging.DEBUG):
            spec = [f"{b.steps}/{b.topk}/{b.num_draft_tokens}" for b in plan.budgets.values() if not b.empty]
            log.debug("step %d: %d items, %d tokens, trees %s, %d drafts behind, gate %s%s", self.step_count,
                      len(plan.items), plan.num_tokens, spec, plan.drafts_behind, self.gate.describe(plan.load),
                      self._configured_figures)
        return plan

    def _mode(self, req: Request) -> SpecMode:
        return req.params.speculation or self._default_mode

    def _draft_ready(self, req: Request) -> bool:
        """Whether req's replica holds (or will hold before its next draft call) every token it was
        sent: it reported an ingest since the last gap, or nothing of req has left the gateway yet. The
        second is a request that just took in its prompt: its ingest is queued and goes out before the
        draft call, which then waits on it (that round is no arm step: plan.draft_prompt_tokens). Waiting
        for the report instead cost two or three plain steps that fed the draft, ungranted, before every
        request's first tree (7.7-11.5 ms each against 4.9 granted on the H200 scale track at one request,
        where the catch-up itself took 5 ms). A woken request's gap was flushed long before: it waits."""
        link = req.draft
        return (link is not None and self._replica(req) is not None and link.sent == req.num_tokens
                and (link.caught_up or not link.flushed))

    # Settled requests (their replica has taken in all they were sent) on one replica from which a request
    # that just took in its prompt waits a round for its first tree; see _without_joining_prompts.
    JOIN_BEHIND_SETTLED = 2

    def _without_joining_prompts(self, ready: list[Request]) -> list[Request]:
        """`ready` less the requests that just took in their prompts (their first ingest still queued) on a
        replica where at least JOIN_BEHIND_SETTLED settled requests are ready too. A replica applies its queue
        before a draft call, so a prompt's ingest sent ahead of the call holds up every tree of that call for
        the prompt's catch-up, which takes the draft's eager path: on the H200 scale track (0.8, 8 requests,
        2026-12-04) the rounds right after a prompt step had draft phases of 12-16 ms against 5-6 in the
        others, and the draft's catch-up Ingest calls took 6.8 ms on average. Waiting a round instead, the
        joining request decodes one token plainly and its prompt's catch-up runs after the call, while the
        target verifies (_draft). With a round of T seconds, a catch-up of W and a tokens accepted a tree,
        waiting pays for n settled requests when W (n a + 1) > T (a - 1): from n = 2 where W/T is above 0.32
        at a = 3.6 (about 0.4 on the H200 at 2 requests, 0.55 at 8). A request alone, or beside one other,
        still drafts behind its prompt."""
        settled: dict[int, int] = {}
        for req in ready:
            if req.draft.flushed:
                settled[req.draft.replica] = settled.get(req.draft.replica, 0) + 1
        return [req for req in ready
                if req.draft.flushed or settled.get(req.draft.replica, 0) < self.JOIN_BEHIND_SETTLED]

    def _replica(self, req: Request) -> DraftReplica | None:
        if req.draft is None:
            return None
        replica = self.pool.replicas[req.draft.replica]
        return replica if replica.healthy else None

    def _draft_room(self, req: Request) -> int:
        """Deepest tree worth drafting: the bonus token takes one of the tokens still allowed."""
        return min(self.max_model_len - req.num_tokens, req.params.max_tokens - len(req.output)) - 1

    def _budgets(self, plan: StepPlan) -> dict[str, DraftBudget]:
        able = [it.request for it in plan.items
                if it.is_decode and self._mode(it.request) != SpecMode.NEVER and self._replica(it.request) is not None
                and self._draft_room(it.request) >= 1]
        cands = [self._candidate(req) for req in self._without_joining_prompts(
            [req for req in able if self._draft_ready(req)])]
        plan.drafts_behind = len(able) - len(cands)

        # What the step's other items commit whatever the policy chooses: one token each that
        # reaches its end (a decode, a prompt's last chunk). Candidates all decode.
        ending = sum(1 for it in plan.items if it.reaches_end)

        # One search of the figures per step: the audit's prediction, the gate's first guess at a new
        # load and the budgets all read it (unless the gate takes the auto requests out).
        spread_extra = self._plain_extra_seconds(plan, cands)
        search = search_budgets(self.cfg.policy, self.costs, self.book, cands, *_other_work(plan, cands),
                                other_committed=ending - len(cands), plain_extra_seconds=spread_extra)
        # Asleep at once only where the book's figures agree (a request whose own first trees missed would
        # otherwise sleep through the steps that fade its figures into the book's), and only on a step that
        # decodes alone with every draft ready: a joining prompt's tokens, priced into both arms, made a tree for
        # the one request decoding beside three prompts look 20% dearer than it is. On an H100 (scale track,
        # 0.6, 4 requests, 2026-12-06) such a step put a level's requests to sleep for 128 steps where trees won
        # (auto 0.91x `always`).
        decodes_only = all(it.is_decode for it in plan.items)
        sleep_now = (not plan.drafts_behind and decodes_only and self._sleeps_at_once(search)
                     and self._sleeps_at_once(self._faded_search(plan, cands, ending, 0.0)))
        if sleep_now and spread_extra:  # no spell to pay for: plain decoding at the granted price
            search = search_budgets(self.cfg.policy, self.costs, self.book, cands, *_other_work(plan, cands),
                                    other_committed=ending - len(cands))
        faded: BudgetSearch | None = None
        if search.best is None and search.auto and not sleep_now and (
                whole_extra := self._plain_extra_seconds(plan, cands, spell_breaks=True)) > spread_extra:
            # The figures decline trees; if they would choose them again once plain steps have faded the
            # requests' own acceptance into the book's, the plain spell ends there, still awake: each of
            # its steps feeds the draft ungranted at the full fed price, with no granted steps to spread it
            # over. On the H200 scale track at one request and acceptance 0.6 (a tie of the two arms), a
            # lone request left its trees after a few that accepted little, took 14 fed steps (8.5 ms
            # against 5.0 granted) and drafted again or slept: auto 0.91-0.95x the better arm.
            faded = self._faded_search(plan, cands, ending, spread_extra)
            if faded.best is not None:
                search = search_budgets(self.cfg.policy, self.costs, self.book, cands, *_other_work(plan, cands),
                                        other_committed=ending - len(cands), plain_extra_seconds=whole_extra)
        # The audit: what the figures predict for each arm, at steps that only decode, as the gate measures
        # its arms (a step carrying a prompt's chunk priced the chunk into both arms: at 64 requests on the
        # H200 the mean predictions read 0.3x what `never` and `always` delivered, 2026-12-03), and kept under
        # the load the gate judges (plan.load), beside its measurements.
        if decodes_only and search.auto:
            self.gate.predict(plan.load, search.rates)
        elif decodes_only:
            self._predict_while_dormant(plan, cands, ending)
        if log.isEnabledFor(logging.DEBUG):
            self._configured_figures = self._describe_configured(search)
        # The gate is asked whenever auto requests could draft, ready or not: its plain verdict makes
        # them dormant, and a dormant request's draft is not ready until the gate asks for trees again.
        could_draft = any(it.is_decode and self._mode(it.request) == SpecMode.AUTO
                          and self._replica(it.request) is not None for it in plan.items)
        # A step of prompts alone asks the gate's standing answer: at a load where plain decoding won,
        # a batch's first prefill fed every prompt's features to the drafts (64 at once on the H200).
        # The gate judges the gateway's load, not the step's size: a burst of 32 requests takes its
        # prompts two a step, and judged by those steps' sizes (2, then 4-15 sequences as prompts finished)
        # it fed the prompts and drafted trees at loads where trees won, then stopped at 16-31. On the H200
        # scale track (0.8, 2026-12-04) auto's prompt steps at 32 requests took 1.2-1.9x the time of `never`'s so.
        gate_open = (self.gate.allow_spec(plan.load, lambda: search.best is not None, prompts_join=not decodes_only)
                     if could_draft else self.gate.would_allow_spec(plan.load))
        self._gate_plain = not gate_open
        while self.gate.remeasured:
            bucket, then, now = self.gate.remeasured.pop()
            log.info("load gate, %s sequences: the workload moved from %.1f to %.1f prompt tokens a committed token "
                     "since its verdict: measured afresh", bucket_range(bucket), then, now)
        probing_trees = gate_open and self.gate.probing_spec(plan.load, prompts_join=not decodes_only)
        self._gate_probing_trees = could_draft and probing_trees
        if self._gate_plain:
            cands = [c for c in cands if c.mode != SpecMode.AUTO]  # measured: plain decode pays at this load
            search = None
        probe = bool(cands) and probing_trees
        budgets = choose_budgets(self.cfg.policy, self.costs, self.book, cands, *_other_work(plan, cands), probe,
                                 search, self._explore_now(), other_committed=ending - len(cands))
        self._explored = self.book.explored
        if sleep_now and search is not None and all(budgets.get(c.key, NO_SPEC).empty for c in search.auto):
            self._dormancy.asleep = True
        self._plain_holds = frozenset()
        if self.cfg.fed_grants and search is not None and search.auto and not any(
                not budgets.get(c.key, NO_SPEC).empty for c in search.auto):
            # Each plain step fades a request's own figures into the book's; a grant must not outlast a
            # choice that fading would flip, so it is made only where the faded figures decline trees too.
            if (faded or self._faded_search(plan, cands, ending, spread_extra)).best is None:
                self._plain_holds = frozenset(c.key for c in search.auto)
        # Never draft past the model's length or the request's max_tokens.
        by_id = {it.request.request_id: it.request for it in plan.items}
        for rid, budget in list(budgets.items()):
            room = self._draft_room(by_id[rid])
            if not budget.empty and budget.steps > room:
                budgets[rid] = budget.cut(room) if room >= 1 else NO_SPEC
        return budgets

    def _expected_accepted(self, plan: StepPlan) -> dict[str, float]:
        """Per request given a tree, the drafted tokens the acceptance book expects it to accept (its own figures
        blended in, as search_budgets prices an option): what the load gate sets a tree step's measured tokens
        against (LoadGate.expected_weight). Empty while the book's evidence is thin: its figure is then mostly
        its prior, which is optimistic on purpose."""
        if self.book.evidence_is_thin() or not any(self._mode(it.request) == SpecMode.AUTO for it in plan.items):
            return {}  # (the gate records only steps that hold auto requests: none for `always` alone)
        explored = self.cfg.policy.explored_options()
        trees = [(it.request, budget) for it in plan.items
                 if not (budget := plan.budgets.get(it.request.request_id, NO_SPEC)).empty]
        # The chains (depth options) by the levels of main paths, in one pass for every request, as search_budgets
        # prices them: with 10-level chains for 128 requests (dev machine, fake services) a book.chain_expected
        # a request took 119 us a step, this 79.
        chains = [(req, budget) for req, budget in trees if budget not in explored]
        depths = sorted({budget.steps for _, budget in chains})
        by_depth = self.book.chain_expectations(depths, [req.acceptance.levels for req, _ in chains])
        expected = {} if by_depth is None else {
            req.request_id: figures[depths.index(budget.steps)] for (req, budget), figures in zip(chains, by_depth)}
        for req, budget in trees:
            if req.request_id not in expected:  # an explored option, or a chain before any main path was measured
                expected[req.request_id] = self.book.expected(budget, req.acceptance.mean(budget))
        return expected

    # When `auto` stops speculating (under load, or wherever trees do not pay), feeding
    # every request's features to the draft would cost target output, gateway work and
    # draft compute for nothing (fed grants, _grant_steps, spare the awake steps the round trips, not
    # the feeding). After QUIET_STEPS steps without a tree, auto requests
    # go dormant (no features, no ingest); WAKE_EVERY steps after they last woke they wake for
    # QUIET_STEPS steps, catch up from their tokens and are offered to the policy again. At any
    # load: on a GPU, with grants, features cost a plain step about half its speed (issue 14).
    # Each wake-up that ends with trees still declined doubles the wait for the next, and waits at
    # least as long as keeps what the wake-up lost (its steps' time against as many granted plain
    # steps) within WAKE_BUDGET of the time between wake-ups, up to MAX_WAKE_EVERY; a tree the figures
    # choose brings it back to WAKE_EVERY. On the H200 at one or two requests where plain decoding
    # won, a wake-up every 128 steps (16 fed, ungranted steps of about twice a granted one's time, and
    # a tree) cost auto about 5% against `never`, and levels of 512 steps woke twice (0.91x at 0.6).
    # The schedule is kept per batch bucket, as the load gate's verdicts are: one for all loads was
    # reset by every tree at any load (a probe of trees at 4-7 requests), so on the H200 at 0.6 each
    # return to one request woke again and again from the start (auto 0.93x `never` there, 2026-12-03),
    # and where trees win at one request the schedule that slept through heavier loads would not wake.
    QUIET_STEPS = 16
    WAKE_EVERY = 128
    MAX_WAKE_EVERY = 4096
    WAKE_BUDGET = 0.02

    # A step with trees in which at least this share of the decoding requests had drafts still taking in their
    # tokens (plan.drafts_behind) measures the drafts' ramp, not trees: those requests decode a token each, at
    # a tree step's price. The load gate is not given it, up to RAMP_STEPS such steps in a row (a draft that
    # never keeps up is then measured as it is). On an H100 (scale track, 0.8, 32 requests, 2026-12-05) the
    # first probe of trees at 32-63 sequences fell as the level's 32 requests joined: four of its six
    # recorded steps carried 16-28 trees for 32 requests, at 2,250-5,300 tok/s, and judged trees at 3,443
    # against plain's 4,712; a re-probe 2 s later read trees at 4,439 against 4,269, inside the margin that
    # keeps a verdict, and `always` delivered 1.05x `never` there (auto 0.87 of it). The step's time still
    # counts towards a probe's cost (LoadGate.spend), and the cost model, which prices a step by what it
    # carries, still learns it.
    # A first probe of trees waits for every draft: a load is met for the first time as requests join, and
    # while one draft still takes in a prompt, the replica's catch-ups hold up the others' calls. On an H100
    # (same track, 16 requests, with the share alone) the first probe at 16-31 recorded steps with 14 trees of
    # 16 and draft phases of 14 and 7.6 ms against 5 once all had caught up; it judged trees at 2,530 tok/s
    # against plain's 2,514 (prompts charged: plain), and a re-probe 0.5 s later read trees at 3,544. Later
    # steps keep the share: joins at a steady load cost trees what they cost `always`.
    RAMP_SHARE = 0.25
    RAMP_STEPS = 8

    def _wake_schedule_for(self, seqs: int) -> WakeSchedule:
        """The wake schedule of this load's batch bucket, new (awake) at a load not met before."""
        return self._wake_schedules.setdefault(batch_bucket(seqs), WakeSchedule(wake_every=self.WAKE_EVERY))

    def _track_quiet(self, plan: StepPlan) -> None:
        # An exploration tree is no choice to speculate: it counts as a quiet step, so a draft that
        # is never right still leaves its requests dormant (one tree per wake, not one per
        # QUIET_STEPS steps, and features flowing all the while). Trees the figures then choose reset it.
        # Only auto's own trees do: an `always` request's tree says nothing of whether trees pay, and
        # counting it woke every auto request of that load. On the H200 each `always` level of an
        # interleaved bench reset the lone request's schedule, so the next auto level began with 14-16
        # fed, ungranted steps and a wake-up 128 steps later (at 0.6: 8.4-11.6 ms a fed step against
        # 4.8-5.2 granted, 6% of the level; 2026-12-03), and a client asking for `always` would keep
        # every auto request beside it awake.
        sched = self._wake_schedule_for(plan.load)
        if not self._explored and any(
                self._mode(it.request) == SpecMode.AUTO and not plan.budgets.get(it.request.request_id, NO_SPEC).empty
                for it in plan.items):
            sched.speculating(self.WAKE_EVERY)
        elif sched.quiet >= self.QUIET_STEPS or sched.asleep or any(
                it.is_decode and self._mode(it.request) == SpecMode.AUTO and self._draft_ready(it.request)
                for it in plan.items):
            # A step counts once auto could have drafted and chose not to: drafts still taking in
            # the prompts of a filling batch are no verdict, and going dormant then (seen on the
            # CI machine) kept 48 requests from ever being offered a tree.
            sched.quiet += 1
            if sched.quiet == sched.spell_start + sched.wake_every:  # wake up; the next waits longer
                sched.spell_start = sched.quiet
                sched.wake_every = min(2 * sched.wake_every, self.MAX_WAKE_EVERY)
                sched.wake_cost = [0.0, 0.0]
                sched.asleep = False
            elif sched.spell_start and sched.quiet == sched.spell_start + self.QUIET_STEPS:  # asleep again
                spent, as_plain = sched.wake_cost
                plain_step = self.costs.step_time(len(plan.items), len(plan.items), [])
                if spent > as_plain and plain_step > 0:
                    affordable = (spent - as_plain) / (self.WAKE_BUDGET * plain_step)
                    sched.wake_every = min(max(sched.wake_every, math.ceil(affordable)), self.MAX_WAKE_EVERY)

    def _candidate(self, req: Request) -> Candidate:
        mode = self._mode(req)
        if mode != SpecMode.AUTO:  # an `always` request drafts the configured tree: its figures choose nothing
            return Candidate(req.request_id, {}, mode)
        return Candidate(req.request_id, {o: req.acceptance.mean(o) for o in self.cfg.policy.explored_options()},
                         mode, levels=req.acceptance.levels)

    # The dormant audit's search prices every auto request under every option: 0.2 / 0.36 / 0.65 ms a
    # plan at 16 / 32 / 64 requests on the 2-core dev machine (bench/gateway_step.py's fakes), against
    # 0.3-1.0 ms for the whole of `never`'s plan, and a plan waits on it between two grants. The audit
    # is a decayed mean: one plan in DORMANT_AUDIT_EVERY feeds it as well.
    DORMANT_AUDIT_EVERY = 16

    def _predict_while_dormant(self, plan: StepPlan, cands: list[Candidate], ending: int) -> None:
        """The audit's figures at a load where auto's requests are dormant (no draft ready, so no
        candidate): what trees would deliver were every decoding auto request to draft, and what its
        plain steps deliver, granted. Without them the audit was empty from the load where the gate
        chose plain decoding (16-64 requests on the H200), which is where the gate's verdict most
        needs checking. Nothing is chosen from these figures; one plan in DORMANT_AUDIT_EVERY asks."""
        known = {c.key for c in cands}
        sleepers = [it.request for it in plan.items
                    if it.is_decode and self._mode(it.request) == SpecMode.AUTO and it.request.request_id not in known
                    and self._draft_room(it.request) >= 1 and self._dormant(it.request)]
        if not sleepers:
            return
        self._dormant_plans += 1
        if self._dormant_plans % self.DORMANT_AUDIT_EVERY != 1:
            return
        asleep = [self._candidate(req) for req in sleepers]
        everyone = cands + asleep
        what_if = search_budgets(self.cfg.policy, self.costs, self.book, everyone, *_other_work(plan, everyone),
                                 other_committed=ending - len(everyone))
        self.gate.predict(plan.load, what_if.rates)

    # How far the granted plain rate must beat the best tree rate the figures give for auto's requests to go
    # dormant at once, without the awake spell of QUIET_STEPS fed steps (see _sleeps_at_once): above the 15%
    # within which the audit counts a prediction right, so that a tree priced that far wrong still runs. On
    # the demo track (H100, 2026-12-06, plain steps learned per grant) the arms read 1.30x apart at one and
    # two requests.
    SLEEP_AT_ONCE_MARGIN = 0.2

    def _describe_configured(self, search: BudgetSearch) -> str:
        """For the DEBUG plan line: the configured tree's predicted step (tokens, ms) for every auto candidate,
        the book's figure for it, and each candidate's own (mean accepted, weight): what the audit's 'cfg tok'
        averages, taken apart."""
        rates = search.rates
        if not search.auto or rates.configured is None or rates.configured_seconds is None:
            return ""
        fixed = self.cfg.policy.fixed_budget
        owns = " ".join("-" if (own := c.own_stats.get(fixed)) is None else f"{own[0]:.2f}/{own[1]:.1f}"
                        for c in search.auto)
        return (f"; configured tree: {rates.configured * rates.configured_seconds:.2f} tokens in "
                f"{1000 * rates.configured_seconds:.2f} ms, book {self.book.expected(fixed, None):.2f}, own {owns}")

    def _sleeps_at_once(self, search: BudgetSearch) -> bool:
        """Whether auto's requests go dormant on this plan, skipping the awake spell, since plain decoding,
        granted, beats every tree the figures give by SLEEP_AT_ONCE_MARGIN. Only in the first spell after
        trees (or at a load new to the schedule): a wake-up's awake steps are there to explore a tree. And
        only while the book holds enough trees: with thin evidence the spell explores.
        The spell's fed steps were charged to plain decoding spread over at most WAKE_EVERY steps
        (_plain_extra_seconds), though the requests that follow at a load start dormant: on an H100 (demo
        track, bf16, one request, 2026-12-06) the spell put 0.25 ms on a 0.5 ms plain step, plain decoding read
        1,310 tok/s against trees' 1,519 where, granted, it read 1,976, and auto drafted trees in 83-98% of
        the steps and delivered 0.74x `never`."""
        rates = search.rates
        sched = self._dormancy
        if not search.auto or rates.trees is None or sched.asleep or sched.spell_start:
            return False
        if sched.quiet >= self.QUIET_STEPS or self.book.evidence_is_thin():
            return False
        return rates.plain >= (1 + self.SLEEP_AT_ONCE_MARGIN) * rates.trees

    def _faded_search(self, plan: StepPlan, cands: list[Candidate], ending: int,
                      plain_extra_seconds: float) -> BudgetSearch:
        """The search with every candidate's own acceptance faded into the book's: what the policy
        chooses once plain steps (each fades it, _record) have run long enough. plain_extra_seconds:
        _plain_extra_seconds of these candidates (fading leaves their keys and modes as they are)."""
        faded = [Candidate(c.key, dict.fromkeys(c.own_stats), c.mode) for c in cands]
        return search_budgets(self.cfg.policy, self.costs, self.book, faded, *_other_work(plan, faded),
                              other_committed=ending - len(faded), plain_extra_seconds=plain_extra_seconds)

    def _plain_extra_seconds(self, plan: StepPlan, cands: list[Candidate], *, spell_breaks: bool = False) -> float:
        """What a plain step costs on top of a granted one, averaged over the plain spell it would
        start. Awake auto requests keep feeding their drafts, ungranted, until QUIET_STEPS quiet steps
        make them dormant; only then are plain steps granted. On the H200 scale track at one request
        a fed step took 9 ms against 5 for a granted one, and a lone request at acceptance 0.8 that
        left its trees for a step whenever a few had accepted little spent 22 of its 128 steps in such
        interludes (auto 0.83-0.87x `always`). The spell is as long as what the auto requests have
        left to generate, or, where longer, as long as this load has held so far (a load that has held
        is taken to hold as long again: the requests that follow at it start dormant, the schedule being
        the load's), at most the steps to the load's next wake-up (which then feeds them again; WAKE_EVERY
        in a first spell, longer after each wake-up that found trees declined). Bounded by the requests'
        own tokens alone, plain decoding looked dearer the nearer each request came to its end: on an
        H100 (demo track, bf16, 2026-12-05) a lone request drafted trees in 74-98% of its steps where
        `never` delivered 1.33x `always`. `spell_breaks`: the spell ends before dormancy (trees again),
        so every step of it pays the whole difference."""
        auto = {c.key for c in cands if c.mode == SpecMode.AUTO}
        if not auto:
            return 0.0
        fed = self.costs.fed_step_time(plan.num_tokens, len(plan.items))
        if fed is None:  # not measured yet at this load: priced as granted, as before any was
            return 0.0
        granted = self.costs.step_time(plan.num_tokens, len(plan.items), [])
        sched = self._dormancy
        awake_left = max(0, self.QUIET_STEPS - (sched.quiet - sched.spell_start))
        if spell_breaks:
            return max(0.0, fed - granted) if awake_left else 0.0
        left = [it.request.params.max_tokens - len(it.request.output) for it in plan.items
                if it.request.request_id in auto]
        spell = max(1.0, min(max(sum(left) / len(left), sched.held_steps),
                             float(sched.spell_start + sched.wake_every - sched.quiet)))
        return max(0.0, fed - granted) * min(awake_left, spell) / spell

    def _explore_now(self) -> bool:
        """Whether this step is the last but one before auto requests go dormant (see _dormant):
        then the policy drafts its best single tree even where the figures decline it (if any tree
        could pay at all), and on the step after, the figures know how it went. While the
        acceptance book's evidence is thin it also explores 2 and 6 steps into a quiet spell (and
        of a wake-up): a backoff, 3 trees per spell until the book holds a few trees, 1 after.

        A dormant request is no candidate, so once auto declines trees nothing refreshes the
        acceptance figures that made it decline, and the policy's own exploration (after
        AcceptanceBook.explore_after = 32 quiet steps with candidates) never comes: dormancy cuts
        the count at QUIET_STEPS = 16, and a wake-up adds at most 16 more. Below the gate's
        minimum batch, where the figures alone decide, a lone request on the emulated-cost CI
        track priced by whole rounds breaks even at 0.75 accepted per 3-token chain; the first
        prompt's trees at positions 2, 6 and 10 accept nothing (later ones 2 on average), the
        figures then fell to 0.6-0.75, and in some runs no tree came before dormancy: plain for
        the rest of the request and, through the global book, for the next ones. Since plain
        decoding is priced as `never` runs it (granted), the break-even is 0.94, and one tree per
        spell no longer sufficed: the CI run of 2026-11-30 drafted 5 trees in 3 requests of 128
        tokens (1 in 3 runs here), where luckier runs speculated in 83% of the steps at 2.1
        accepted per tree.
        """
        return self._explore_at(self._dormancy.quiet)

    def _explore_at(self, quiet: int) -> bool:
        """_explore_now for a plan made at `quiet` quiet steps (this spell's start unchanged)."""
        if self.QUIET_STEPS < 2:
            return False
        phase = quiet - self._dormancy.spell_start + 2  # steps into the spell, + 2
        if phase == self.QUIET_STEPS:
            return True
        backoff = 4 <= phase < self.QUIET_STEPS and phase & (phase - 1) == 0  # 4, 8, ...
        return backoff and self.book.evidence_is_thin()

    def _asleep_at(self, quiet: int) -> bool:
        """Whether auto requests are dormant at `quiet` quiet steps by the count alone (the gate aside), or
        went dormant at once (_sleeps_at_once) and `quiet` comes before their next wake-up."""
        sched = self._dormancy
        if sched.asleep and quiet < sched.spell_start + sched.wake_every:
            return True
        return quiet >= self.QUIET_STEPS and quiet - sched.spell_start >= self.QUIET_STEPS

    def _dormant(self, req: Request) -> bool:
        return self._mode(req) == SpecMode.AUTO and not self._gate_probing_trees and (
            self._gate_plain or self._asleep_at(self._dormancy.quiet))

    # --- draft -----------------------------------------------------------------------
    def _draft(self, plan: StepPlan) -> dict[str, DraftTree]:
        by_replica: dict[int, list[tuple[Request, DraftBudget]]] = {}
        for it in plan.items:
            budget = plan.budgets.get(it.request.request_id, NO_SPEC)
            if not budget.empty:
                by_replica.setdefault(it.request.draft.replica, []).append((it.request, budget))
        drafting = {req.request_id for items in by_replica.values() for req, _ in items}
        for req in self.running:  # deferred ingests of requests that do not draft now: send them off
            if req.draft is not None and req.draft.pending is not None and req.request_id not in drafting:
                self._send_ingest(req)
        # A replica applies its queue in order: what it must take in before its draft call goes first; the
        # ingests of its requests that do not draft now go after the call, so that their catch-up (a joining
        # prompt's, a woken request's gap) runs while the target verifies, not ahead of every tree of the call.
        after_calls: dict[int, list[tuple[Request, IngestItem]]] = {}
        for idx in by_replica:
            before_call = []
            for req, item in self._ingest_queue.pop(idx, ()):
                if req.request_id in drafting:
                    before_call.append((req, item))
                else:
                    after_calls.setdefault(idx, []).append((req, item))
            if before_call:
                self._ingest_queue[idx] = before_call
        if by_replica:
            # The call waits on any prompt queued ahead of it (a request joined since the last round, drafting
            # now), and the round pays for that prompt, not for its trees. On the H200 (scale track, 0.8) the
            # first recorded tree steps as 8 requests joined ran at 0.4x the rate `always`'s tree steps kept
            # at that load, and settled the load for plain decoding.
            plan.draft_prompt_tokens = sum(_prompt_tokens(req, item) for idx in by_replica
                                           for req, item in self._ingest_queue.get(idx, ()))
        self._flush_ingests()
        if not by_replica:
            self._flush_draft_releases()
            return {}
        futures = {}
        timeline.mark("gw.draft.submit")
        # One replica's call runs on this thread (where its queue is empty); several run side by side.
        alone = len(by_replica) == 1
        for idx, items in by_replica.items():
            replica = self.pool.replicas[idx]
            # The drafting requests' new tokens and features ride in the same call.
            ingest = [req.draft.pending for req, _ in items if req.draft.pending is not None]
            for req, _ in items:
                req.draft.pending = None
                req.draft.known = True
            calls = [(req.request_id, budget, req.num_tokens) for req, budget in items]
            run = replica.call if alone else replica.submit
            futures[idx] = run(lambda replica=replica, ingest=ingest, calls=calls: replica.client.draft(ingest, calls))
        for idx, held in after_calls.items():  # behind the calls in each replica's queue
            self._ingest_queue.setdefault(idx, []).extend(held)
        self._flush_ingests()
        self._flush_draft_releases()
        trees: dict[str, DraftTree] = {}
        for idx, fut in futures.items():
            try:
                reply = fut.result()
                for req, _ in by_replica[idx]:  # the replica applied every ingest queued before the call
                    req.draft.caught_up = True
                self._draft_usage(reply.load)
                plan.draft_captured |= reply.graphs_captured > 0
                for tree in reply.trees:
                    if tree.tokens:
                        trees[tree.request_id] = tree
            except (InvalidArgument, ResourceExhausted) as exc:
                log.warning("draft refused a call (%s); those requests decode plainly", exc)
                for req, _ in by_replica[idx]:
                    self._detach_draft(req, release=True)
            except Exception as exc:
                self.pool.mark_lost(self.pool.replicas[idx], str(exc))
        return trees

    # --- execute -------------------------------------------------------------------------
    def _sequence_step(self, it: PlannedItem, tree: DraftTree | None) -> SequenceStep:
        req = it.request
        p = req.params
        sampling = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)
        want_features = self._wants_features(req)
        if want_features:
            req.draft.known = True  # the target may push this step's features to the replica
        top = p.logprobs or 0
        if tree is not None:
            tokens, parents, num_fixed = tree.verify_tree()
            return SequenceStep(request_id=req.request_id, tokens=tuple(tokens), parents=tuple(parents),
                                num_fixed=num_fixed, create=False, sampling=sampling, top_logprobs=top,
                                return_features=want_features, controls=req.logits_controls,
                                sample_is_output=it.reaches_end)
        # reaches_end: the sample is the request's next token, which pushed features then carry to its draft.
        return SequenceStep.chain(req.request_id, it.tokens, create=not req.target_created, sampling=sampling,
                                  top_logprobs=top, return_features=want_features, controls=req.logits_controls,
                                  sample_is_output=it.reaches_end)

    def _wants_features(self, req: Request) -> bool:
        return self._replica(req) is not None and self._mode(req) != SpecMode.NEVER and not self._dormant(req)

    def _hold_features(self, plan: StepPlan, steps: list[SequenceStep]) -> bool:
        """Whether the target should keep this step's features for the replicas to read
        (never through the gateway): when every request that asks has a replica that reads."""
        asking = [it.request for it, step in zip(plan.items, steps, strict=True) if step.return_features]
        return bool(asking) and all((replica := self._replica(req)) is not None
                                    and replica.client.reads_target_features for req in asking)

    def _feature_sinks(self, plan: StepPlan, steps: list[SequenceStep]) -> list[str]:
        """Per item, the sink its replica takes pushed features under ("" for none): the rows
        then reach the replica as the step ends, not by a read before its next tree."""
        sinks = []
        for it, step in zip(plan.items, steps, strict=True):
            replica = self._replica(it.request) if step.return_features else None
            sinks.append(replica.client.feature_sink if replica is not None else "")
        return sinks

    def _execute(self, plan: StepPlan, trees: dict[str, DraftTree]) -> Iterator[StepOutcome]:
        """The target's step(s) for the plan: one call, or a grant of plain steps."""
        steps = [self._sequence_step(it, trees.get(it.request.request_id)) for it in plan.items]
        grant = self._grant_steps(plan, trees, steps)
        t0 = time.perf_counter()
        try:
            if grant <= 1:
                hold = self._hold_features(plan, steps)
                sinks = self._feature_sinks(plan, steps) if hold else None
                results, load, _ = self.target.step(steps, self.feature_layers, hold_features=hold,
                                                    feature_sinks=sinks, release=self._release_next)
                self._release_next, self._release_next_blocks = [], 0
                pairs = zip(plan.items, steps, strict=True)
                yield StepOutcome(items=plan.items, results=results, load=load,
                                  seconds=time.perf_counter() - t0, trees=trees, granted=0, held_features=hold,
                                  fed_draft=any(step.return_features for step in steps),
                                  fed_prompt=any(step.return_features for it, step in pairs if not it.is_decode))
                return
            yield from self._run_grant(plan, steps, grant, t0)
        except ResourceExhausted:
            # Our block estimate was off (another client, or fragmentation): free room and retry.
            if self.running:
                self._preempt(max(self.running, key=lambda req: req.arrival))
        finally:
            self._release_finished()

    def _grant_steps(self, plan: StepPlan, trees: dict[str, DraftTree], steps: list[SequenceStep]) -> int:
        """How many plain steps the target may run on its own for this plan (1: just this one).

        Only a batch that decodes plainly is granted, and only as many steps as the free KV
        covers for every request. Where requests feed their drafts, only awake auto requests
        whose drafts are ready and for whom plain decoding holds as their figures fade are (a
        fed grant; `always` drafts as soon as its draft has caught up), and only up to the next
        step at which the policy may explore a tree for them or they go dormant
        (_steps_to_next_choice)."""
        k = self.cfg.grant_steps
        if k <= 1 or trees:
            return 1
        if not all(it.is_decode for it in plan.items) or self._ingest_queue:
            return 1
        fed = [it.request for it, step in zip(plan.items, steps, strict=True) if step.return_features]
        if fed:
            if any(req.request_id not in self._plain_holds for req in fed):
                return 1
            k = min(k, self._steps_to_next_choice(k))
        bs = self._block_size
        while k > 1:
            need = sum(blocks_for(it.request.target_len + k, bs) - blocks_for(it.request.target_len, bs)
                       for it in plan.items)
            if need <= self._plannable_blocks:
                break
            k //= 2
        return k

    def _steps_to_next_choice(self, most: int) -> int:
        """How many steps a fed grant made now may run (at most `most`): it ends where the next
        plan would come at a quiet count at which the policy explores a tree (_explore_at) or the
        auto requests go dormant, so that a grant neither skips a choice nor feeds a dormant
        request's draft. Each granted step after the first counts one quiet step (_record), and
        this plan's own is counted already."""
        for steps in range(1, most + 1):
            quiet = self._dormancy.quiet + steps - 1  # the quiet count of the plan that follows a grant of `steps`
            if self._explore_at(quiet) or self._asleep_at(quiet):
                return steps
        return most

    def _run_grant(self, plan: StepPlan, steps: list[SequenceStep], k: int, t0: float) -> Iterator[StepOutcome]:
        reqs = [it.request for it in plan.items]
        stops = GrantStops(
            max_new_tokens=np.array([min(req.params.max_tokens - len(req.output), self.max_model_len - req.num_tokens)
                                     for req in reqs], dtype=np.int32),
            stop_token_ids=tuple(req.target_stop_ids for req in reqs))
        fed = any(step.return_features for step in steps)
        hold = fed and self._hold_features(plan, steps)
        sinks = self._feature_sinks(plan, steps) if hold else None
        grant = self.target.grant(steps, self.feature_layers, k, stops, hold_features=hold, feature_sinks=sinks,
                                  release=self._release_next)
        self._release_next, self._release_next_blocks = [], 0
        by_id = {it.request.request_id: it for it in plan.items}
        index = 0
        self._trees_won_in_grant = False
        try:
            for results, load, _ in grant:
                now = time.perf_counter()
                index += 1
                if results:
                    yield StepOutcome(items=[by_id[result.request_id] for result in results], results=results,
                                      load=load, seconds=now - t0, trees={}, granted=index, held_features=hold,
                                      fed_draft=fed)
                t0 = now
                if self._should_interrupt(reqs):
                    grant.interrupt()
        finally:
            grant.close()

    def _should_interrupt(self, granted: list[Request]) -> bool:
        """A new plan is due: an arrival, an abort, a request the target cannot know has ended, or a load
        gate verdict for trees taken on this grant's steps."""
        return (bool(self._inbox) or bool(self._aborts) or self._stop.is_set() or self._trees_won_in_grant
                or any(req.stopped_by_string for req in granted))

    # --- update ------------------------------------------------------------------------
    def _update(self, plan: StepPlan, outcome: StepOutcome) -> None:
        self._target_usage(outcome.load)
        verified: list[tuple[int, int]] = []  # (drafted, accepted) per tree: the metrics move once a step
        for it, result in zip(outcome.items, outcome.results, strict=True):
            self._apply(it, result, outcome.trees.get(result.request_id), plan.budgets.get(result.request_id, NO_SPEC),
                        outcome.held_features, verified)
        self.metrics.record_verifies(self.model_name, verified)
        if outcome.granted:  # the target still feeds the grant's requests: release them after it
            self._retire_finished()
        else:
            self._release_finished()
        # The ingests queued here go out with the next step's (one call per replica per step),
        # while the target runs that step; a fed grant's go now, while the target runs its next.
        if outcome.granted and outcome.fed_draft:
            self._flush_ingests()

    def _apply(self, it: PlannedItem, result: SequenceResult, tree: DraftTree | None, budget: DraftBudget,
               held: bool, verified: list[tuple[int, int]]) -> None:
        """One item's result lands in its request; a verified tree's (drafted, accepted) goes to `verified`."""
        req = it.request
        if req.phase == Phase.FINISHED:
            return
        old_len = req.target_len
        req.target_created = True
        req.target_len = result.num_committed
        if not it.reaches_end:  # a prefill chunk that is not the last: its sample is not output
            self._feed_draft(req, old_len, result, defer=False, held=held)
            return
        stats = req.stats
        if tree is not None:
            accepted = len(result.accepted_nodes)
            stats = stats.after_verify(len(tree.tokens), accepted)
            verified.append((len(tree.tokens), accepted))
            # Every tree teaches the global book; a request's own figures choose only an auto request's trees
            # (_candidate), so only an auto request keeps them.
            own = req.acceptance if self._mode(req) == SpecMode.AUTO else None
            self.book.record(budget, accepted)
            # The step's node 0 is the root token (DraftTree.verify_tree): the tree's node i is its i + 1.
            drafted_nodes = [node - 1 for node in result.accepted_nodes]
            path = main_path(tree.parents, tree.scores, drafted_nodes)
            if path is not None:
                self.book.levels.record(path)
            chains = chains_would_accept(path, self.cfg.policy.explored_options(), budget)
            for chain, chain_accepted in chains:
                self.book.record(chain, chain_accepted)
            if own is not None:
                own.record(budget, accepted)
                if path is not None:
                    own.record_path(path)
                for chain, chain_accepted in chains:
                    own.record(chain, chain_accepted)
                own.age([budget, *(chain for chain, _ in chains)])
        elif it.is_decode:
            stats = stats.after_plain()
            self.metrics.plain_decode_steps.inc()
            req.acceptance.fade(0.85)
        first = req.first_token_at is None
        prev_last = req.last_token_at
        delta = req.commit(result.tokens, result.logprobs, result.top_logprobs, result.num_committed, stats)
        now = time.monotonic()
        if first:
            self.metrics.ttft.observe(now - req.arrival)
        elif prev_last is not None and delta.token_ids:
            observe_times(self.metrics.itl, (now - prev_last) / len(delta.token_ids), len(delta.token_ids))
        self._emit(req, delta)
        if req.phase != Phase.FINISHED:
            self._feed_draft(req, old_len, result, defer=tree is not None, held=held)

    def _emit(self, req: Request, delta) -> None:
        try:
            req.sink(delta)
        except Exception:
            log.exception("delivering output of %s failed; aborting it", req.request_id)
            req.phase = Phase.FINISHED
            req.finish_reason = FinishReason.ABORT
        if delta.finish_reason:
            if self._mode(req) == SpecMode.AUTO:  # only auto requests keep figures of their own (_apply)
                self.book.request_ended(req.acceptance.raw, tuple(req.acceptance.first_level))
                self._log_own_weight()
            tracing.end_request_span(req, delta)
            self.metrics.e2e.observe(time.monotonic() - req.arrival)
            self.metrics.requests_total.labels(finish_reason=str(delta.finish_reason)).inc()
            self.metrics.generation_tokens.labels(speculation=str(self._mode(req))).inc(delta.completion_tokens)
            self.metrics.record_finished(self.model_name, delta.prompt_tokens, delta.completion_tokens)

    def _log_own_weight(self) -> None:
        """With --spec-own-weight auto, an INFO line where the configured tree's weight first leaves the fixed one
        or moves by half since the last line: what the policy now makes of a request's own trees."""
        if not self.book.own_weight_from_spread:
            return
        budget = self.cfg.policy.fixed_budget
        weight, last = self.book.own_weight_for(budget), self._logged_own_weight
        if last is None and weight == self.book.own_weight:
            return  # not estimated yet
        if last is not None and max(weight, last) < 1.5 * min(weight, last):
            return
        self._logged_own_weight = weight
        log.info("own weight: the book's figures weigh as %.1f of a request's own %d/%d/%d trees and %.1f of its "
                 "main paths (levels), from how far the last ended auto requests' acceptance differed", weight,
                 budget.steps, budget.topk, budget.num_draft_tokens, self.book.own_weight_for(None))

    # --- record --------------------------------------------------------------------------
    def _record(self, plan: StepPlan, outcome: StepOutcome, round_start: float,
                phases: tuple[float, ...] = ()) -> None:
        """Count the step, teach the cost model and the load gate. `phases`: the step's schedule, draft,
        execute and update seconds, for the DEBUG line."""
        self.step_count += 1
        if outcome.granted:
            self.metrics.granted_steps.inc()
        if outcome.granted > 1:
            self._track_quiet(plan)  # every granted step counts towards dormancy, as a planned one would
        self.metrics.requests_running.set(len(self.running))
        self.metrics.requests_waiting.set(len(self.waiting))
        self.metrics.gate_load.set(plan.load)
        self.metrics.step_seconds.observe(outcome.seconds)
        # What the step cost the loop, as the policy must weigh it: a planned step is charged its
        # whole round (schedule, the draft call, the target's step, the update), so a tree carries
        # its draft call; a granted step's time is already the gap between two replies, the update
        # of the one before included. (Charging trees only the target's step had the gate read 4x
        # the goodput `always` delivered at 16-64 requests on the H200, and speculate at a loss.)
        # A planned round's phases, when given, end where its update did: the same instant as the DEBUG line's.
        seconds = outcome.seconds if outcome.granted else (
            sum(phases) if phases else time.perf_counter() - round_start)
        # Only decode steps measure what the policy chooses between: prefill work in a step
        # belongs to neither arm, and taxed whichever arm the gate probed first as a batch filled.
        decode = all(it.is_decode for it in outcome.items)
        seqs, committed = len(outcome.items), sum(len(result.tokens) for result in outcome.results)
        # A plain step that fed the draft belongs to neither arm: plain decoding, as `never` runs it,
        # feeds nothing and is granted. (Such steps had the gate read plain decoding at 0.7x `never`;
        # and while the cost model learned from them too, it priced plain decoding at 0.38-0.56x of
        # what the gate measured in every bucket on the H200, so below the gate's minimum batch auto
        # speculated at 2 requests where `never` was faster: BENCHMARKS.md, issue 14.)
        # A round in which a replica captured a graph for a new shape (20-40 ms on the H200, once per
        # shape: the first tree of each batch bucket, and the depth-cut budgets near max_tokens) belongs
        # to neither arm either: one such round lifted the trees' cost ratio by a fifth, and auto at one
        # request then decoded plainly for the rest of the run (0.83x `always`, issue 14).
        # A round whose draft call waited on a joining prompt's ingest belongs to neither arm: it is what that
        # prompt costs trees (_charge_prompts).
        arm_step = (decode and (bool(outcome.trees) or not outcome.fed_draft) and not plan.draft_captured
                    and not plan.draft_prompt_tokens)
        self.metrics.step_kind[_step_kind(outcome, decode)].observe(seconds)
        if log.isEnabledFor(logging.DEBUG):  # one line per target step: where auto's time went, step by step
            log.debug("step %d done: %d seqs, %d trees, granted %d, fed draft %s, decode %s, %d committed, "
                      "%.2f ms, quiet %d, ingests queued %d, phases %s ms", self.step_count, seqs,
                      len(outcome.trees), outcome.granted, outcome.fed_draft, decode, committed, 1000 * seconds,
                      self._dormancy.quiet, sum(len(q) for q in self._ingest_queue.values()),
                      "/".join(f"{1000 * part:.2f}" for part in phases) or "-")
        if decode:
            self.metrics.record_decode_step(bucket_range(batch_bucket(seqs)), bool(outcome.trees), committed, seconds)
        self._charge_prompts(plan, outcome, seconds, committed)
        if not decode and any(self._mode(it.request) == SpecMode.AUTO for it in outcome.items
                              if it.request.request_id in outcome.trees):
            self.gate.drafted_on_joins(plan.load)  # a probe's tree step the gate cannot record (LoadGate._answer)
        if decode and outcome.fed_draft and not outcome.trees and not plan.draft_captured:
            if outcome.granted:
                self._add_grant_cost(outcome, seqs, seconds)
            else:
                self.costs.observe_fed(sum(len(it.tokens) for it in outcome.items), seqs, seconds)
        if arm_step and outcome.granted:
            self._add_grant_cost(outcome, seqs, seconds)
        elif arm_step:
            # At every load the cost model learns whole rounds, as the gate does. (Below the gate's
            # minimum batch it learned the target's step for a while, which left a tree's draft call
            # unpriced: trees looked ~23% cheaper on the emulated-cost track, and that hid how a lone
            # request could stop speculating for good after unlucky first trees; see _explore_now.)
            budgets = [plan.budgets[rid] for rid in outcome.trees]
            self.costs.observe(sum(len(it.tokens) for it in outcome.items), seqs, budgets, seconds)
        if decode and any(self._mode(it.request) == SpecMode.AUTO for it in outcome.items):
            # The gate's load: the step's sequences and the requests it did not carry (see _budgets).
            gate_load = seqs + plan.load - len(plan.items)
            self.gate.spend(gate_load, committed, seconds)  # a probe's whole cost, its unrecorded steps too
            sched = self._wake_schedule_for(plan.load)
            if sched.spell_start and sched.quiet - sched.spell_start < self.QUIET_STEPS:  # awake after a wake-up
                sched.wake_cost[0] += seconds
                sched.wake_cost[1] += committed / seqs * self.costs.step_time(seqs, seqs, [])
            verdict = (self.gate.record(seqs, bool(outcome.trees), committed, seconds, load=gate_load,
                                        lightest=self._lighter_step(plan, outcome, seconds),
                                        expected=_expected_tokens(plan, outcome, seqs))
                       if arm_step and not self._ramp(plan, outcome, seqs, gate_load) else None)
            if verdict is not None:
                overturned = bool(self.gate.overturned)
                self.gate.overturned.clear()
                log.info("load gate, %s: %s%s; %s", self.gate.describe(gate_load),
                         "speculating" if verdict else "decoding plainly",
                         " (the standing verdict's loser measured better outside a probe)" if overturned else "",
                         self.gate.outlook(gate_load))
                # A grant that measured plain decoding for the gate ends here where trees won: its other
                # steps would decode plainly for nothing. On an H100 (scale track, 0.8, 8 requests,
                # 2026-12-05) a re-probe settled on its third granted step and the grant ran five more,
                # 31 ms for 40 tokens that trees commit in about 22.
                self._trees_won_in_grant = bool(outcome.granted) and verdict

    def _lighter_step(self, plan: StepPlan, outcome: StepOutcome, seconds: float) -> Callable[[int], float]:
        """For the load gate (LoadGate.record): what this step would have taken with only its first n
        sequences, their trees as they were, the measured time scaled by the cost model's figures."""
        def lighter(n: int) -> float:
            items = outcome.items[:n]
            kept = {it.request.request_id for it in items}
            predicted = self.costs.step_time(*self._step_shape(plan, outcome.items, outcome.trees))
            return seconds * self.costs.step_time(*self._step_shape(plan, items, [rid for rid in outcome.trees
                                                                                  if rid in kept])) / predicted
        return lighter

    def _step_shape(self, plan: StepPlan, items: list[PlannedItem], trees: Iterable[str]
                    ) -> tuple[int, int, list[DraftBudget]]:
        """(tokens, sequences, trees' budgets) of a decode step, as CostModel.step_time takes them."""
        budgets = [plan.budgets[rid] for rid in trees]
        return sum(len(it.tokens) for it in items) + sum(b.max_nodes for b in budgets), len(items), budgets

    def _add_grant_cost(self, outcome: StepOutcome, seqs: int, seconds: float) -> None:
        key = (sum(len(it.tokens) for it in outcome.items), seqs, outcome.fed_draft)
        spent = self._grant_costs.setdefault(key, [0.0, 0])
        spent[0] += seconds
        spent[1] += 1

    def _learn_grant(self) -> None:
        """The cost model learns the plan's granted plain steps as one measurement per shape: their mean. A
        grant's first step carries the plan's round trip and the rest do not (on an H100, demo track, one
        request: 1.6-1.9 ms, then 0.40-0.47, 2026-12-06); learned a step at a time, the ratio that a plan reads
        had just taken in the cheap steps, and priced a plain step at 0.44 ms where the steps averaged 0.65
        (the log replayed: 0.64 learned per grant; on the H200 scale track 4.76 against 4.89, and 4.88)."""
        for (tokens, seqs, fed), (seconds, steps) in self._grant_costs.items():
            if fed:
                self.costs.observe_fed(tokens, seqs, seconds / steps)
            else:
                self.costs.observe(tokens, seqs, [], seconds / steps)
        self._grant_costs.clear()

    def _ramp(self, plan: StepPlan, outcome: StepOutcome, seqs: int, load: int) -> bool:
        """Whether this decode step is a tree step of the drafts' ramp, kept from the load gate (see RAMP_SHARE)."""
        if not outcome.trees:
            return False
        behind_enough = 1 if self.gate.first_probe_of_trees(load) else self.RAMP_SHARE * seqs
        if plan.drafts_behind < behind_enough:
            self._ramp_steps = 0
            return False
        self._ramp_steps += 1
        return self._ramp_steps <= self.RAMP_STEPS

    def _charge_prompts(self, plan: StepPlan, outcome: StepOutcome, seconds: float, committed: int) -> None:
        """What the prompts in this step cost beyond its decode items' price, for the load gate's prompt charges
        (PromptCharges): a step whose prompts fed the drafts is what trees cost, one whose prompts did not, plain;
        so is a round whose draft call waited on a replica taking in a prompt (that prompt's cost to trees)."""
        prompt_tokens = sum(len(it.tokens) for it in outcome.items if not it.is_decode)
        self.gate.prompts.observe_step(prompt_tokens, committed)
        catch_up = bool(plan.draft_prompt_tokens) and bool(outcome.trees)
        if not (prompt_tokens or catch_up) or plan.draft_captured:
            return
        decodes = [it for it in outcome.items if it.is_decode]
        budgets = [plan.budgets[rid] for rid in outcome.trees]
        price = 0.0
        if decodes:
            tokens = sum(len(it.tokens) for it in decodes) + sum(b.max_nodes for b in budgets)
            price = self.costs.step_time(tokens, len(decodes), budgets)
        self.gate.prompts.observe_prompts(outcome.fed_prompt or catch_up, prompt_tokens, seconds - price,
                                          bucket=batch_bucket(plan.load))

    # --- draft state ---------------------------------------------------------------
    def _apply_reports(self) -> None:
        """What draft workers reported since the last step (the loop owns the links)."""
        while True:
            try:
                link = self._reports.get_nowait()
            except queue.Empty:
                return
            link.caught_up = True

    def _attach_draft(self, req: Request) -> None:
        if self._mode(req) == SpecMode.NEVER or req.draft is not None:
            return
        replica = self.pool.least_loaded()
        if replica is None:
            return
        req.draft = DraftLink(replica=replica.index)
        replica.requests.add(req.request_id)

    def _detach_draft(self, req: Request, release: bool, batch: dict[int, list[str]] | None = None) -> None:
        """batch: where to collect the Release calls' ids per replica (one call each for many
        requests), instead of a call now."""
        link = req.draft
        if link is None:
            return
        replica = self.pool.replicas[link.replica]
        replica.requests.discard(req.request_id)
        if release and replica.healthy and link.known:
            if batch is None:
                replica.submit(lambda: replica.client.release([req.request_id]))
            else:
                batch.setdefault(replica.index, []).append(req.request_id)
        req.draft = None
        queued = self._ingest_queue.get(replica.index)
        if queued:
            self._ingest_queue[replica.index] = [(x, item) for x, item in queued if x is not req]

    def _detach_lost_drafts(self) -> None:
        for req in self.running:
            if req.draft is not None and not self.pool.replicas[req.draft.replica].healthy:
                self._detach_draft(req, release=False)
            if req.draft is None and req.phase == Phase.RUNNING and self._mode(req) != SpecMode.NEVER:
                self._attach_draft(req)

    def _feed_draft(self, req: Request, old_len: int, result: SequenceResult, defer: bool, held: bool = False) -> None:
        """Pass the request's new tokens (and features, or word that the target holds them) to
        its replica.

        defer: the request just drafted and will likely draft again, so the
        ingest waits to ride in its next draft call (one round trip, not two).
        Otherwise it goes now, without waiting: the replica's worker applies it
        before any later draft call, and the replica computes the KV while the
        target runs the next step.
        held: the step's features stayed at the target (hold_features); the
        replica reads the rows of the tokens the step committed from there.
        """
        link = req.draft
        if link is None or self._replica(req) is None or self._dormant(req):
            return
        # The draft learns committed tokens and the one after them, never more: a
        # position it computes without the target's features is only approximate.
        known_len = min(req.target_len + 1, req.num_tokens)
        feats = result.features
        held_rows = result.num_committed - old_len if held and feats is None else 0
        rows = held_rows or (0 if feats is None else int(feats.shape[0]))
        if rows and link.sent < old_len:
            # Tokens the replica was never sent (a dormant spell) go first, without features: an
            # item's features start where it starts, and these start at old_len. Requiring features
            # to continue the last ones sent left a request that had once been dormant feeding its
            # draft tokens alone from then on: every catch-up took the draft's featureless path, and a
            # real draft guessed its trees from its own states (on the CPU's emulated track auto's trees
            # at 4 requests then accepted 2.11 tokens a round, 3.71 after; whether this is why its tree
            # rounds there took 22-25 ms on the H200 against 15-16 for `always` is not yet measured).
            gap = tuple(req.token_slice(link.sent, old_len))
            if link.pending is None:
                link.pending = IngestItem(request_id=req.request_id, start_position=link.sent, tokens=gap)
            else:
                link.pending = replace(link.pending, tokens=link.pending.tokens + gap)
            link.sent = old_len
            # Not ready to draft until the replica has computed the gap (its report sets this):
            # otherwise the first tree waits behind that catch-up, and the round that pays for it
            # is what the load gate and the cost model learn trees cost.
            link.caught_up = False
        pending = link.pending
        if rows:
            start = old_len  # these features belong to positions old_len..
            # A deferred item whose features (of the same kind: sent, or held) end where these begin.
            joins = pending is not None and pending.start_position + _feature_rows(pending) == old_len and (
                (pending.features is not None and feats is not None) or (pending.target_feature_rows and held_rows))
            if joins:
                start = pending.start_position
                if feats is not None:
                    feats = torch.cat((pending.features, feats))
                held_rows += pending.target_feature_rows
            elif pending is not None:
                self._send_ingest(req)
        else:
            if pending is not None:
                self._send_ingest(req)
            start, feats, held_rows = link.sent, None, 0  # tokens only: the draft catches up from its own states
        link.pending = IngestItem(request_id=req.request_id, start_position=start,
                                  tokens=tuple(req.token_slice(start, known_len)), features=feats,
                                  target_feature_rows=held_rows)
        link.sent = known_len
        if not defer or not link.caught_up:
            self._send_ingest(req)

    def _send_ingest(self, req: Request) -> None:
        """Queue req's pending ingest; _flush_ingests sends a step's ingests to each replica together."""
        link = req.draft
        replica = self._replica(req)
        if link is None:
            return
        item, link.pending = link.pending, None
        if replica is None or item is None:
            return
        link.known = True
        self._ingest_queue.setdefault(replica.index, []).append((req, item))

    def _flush_ingests(self) -> None:
        """One Ingest call per replica (more only where a request has two items). With one RPC per
        request through the replica's queue, plain steps of 64 requests that still fed the draft
        read 202-207 tok/s to the load gate on CPU, and 257-269 with one call per replica."""
        queued, self._ingest_queue = self._ingest_queue, {}
        for idx, pairs in queued.items():
            replica = self.pool.replicas[idx]
            rounds: list[list[tuple[Request, IngestItem]]] = []
            seen: dict[str, int] = {}
            for req, item in pairs:  # the draft takes one item per request per call, in order
                n = seen[req.request_id] = seen.get(req.request_id, -1) + 1
                if n == len(rounds):
                    rounds.append([])
                rounds[n].append((req, item))
            for batch in rounds:
                links = [req.draft for req, _ in batch]
                for link in links:
                    link.flushed = True

                def send(replica=replica, batch=batch, links=links):
                    # catch_up: compute the draft KV now, while the target runs the next step.
                    self._draft_usage(replica.client.ingest([item for _, item in batch], catch_up=True))
                    for link in links:
                        self._reports.put(link)  # the loop marks them caught up

                fut = replica.submit(send)
                fut.add_done_callback(
                    lambda f, replica=replica: f.exception() and self._ingest_failed(replica, f.exception()))

    def _refresh_draft_usage(self, replica: DraftReplica) -> None:
        """The draft KV gauge from what the replica holds now, asked on its worker (after what is queued there)."""
        replica.submit(lambda: self._draft_usage(replica.client.info().load))

    def _draft_usage(self, load: KvLoad) -> None:
        self.metrics.kv_usage.labels(service="draft").set(1 - load.free_blocks / max(load.total_blocks, 1))

    def _flush_draft_releases(self) -> None:
        """One Release call per replica for the requests that finished on it, on its worker."""
        releases, self._draft_releases_next = self._draft_releases_next, {}
        for idx, rids in releases.items():
            replica = self.pool.replicas[idx]
            replica.submit(lambda replica=replica, rids=rids: replica.client.release(rids))

    @property
    def _plannable_blocks(self) -> int:
        """KV blocks the next step may use: the target's last free count and what it frees first."""
        return self._free_blocks + self._release_next_blocks

    def _target_usage(self, load: KvLoad) -> None:
        """The target's KV load as it last reported it: what the scheduler plans with, and the gauge."""
        self._free_blocks = load.free_blocks
        self.metrics.kv_usage.labels(service="target").set(1 - load.free_blocks / max(load.total_blocks, 1))

    def _ingest_failed(self, replica: DraftReplica, exc: BaseException) -> None:
        if isinstance(exc, (InvalidArgument, ResourceExhausted)):
            log.warning("draft %s refused an ingest: %s", replica.client.address, exc)
        self.pool.mark_lost(replica, str(exc))

    # --- finishing ----------------------------------------------------------------
    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req.phase != Phase.FINISHED:
            self._emit(req, req.finish(reason, error))
        req.phase = Phase.FINISHED
        self._release_finished()

    def _retire_finished(self) -> None:
        """Take finished requests out of the batch; their target KV is released later."""
        done = [req for req in self.running if req.phase == Phase.FINISHED]
        if done:
            self.running = [req for req in self.running if req.phase != Phase.FINISHED]
            self._release_after_grant.extend(done)

    def _release_finished(self) -> None:
        done = [req for req in self.running + self.waiting if req.phase == Phase.FINISHED]
        done += self._release_after_grant
        self._release_after_grant = []
        if not done:
            return
        self.running = [req for req in self.running if req.phase != Phase.FINISHED]
        self.waiting = [req for req in self.waiting if req.phase != Phase.FINISHED]
        ids = [req.request_id for req in done if req.target_created]
        if ids and self.running:  # a step follows: the release goes with it
            self._release_next += ids
            self._release_next_blocks += sum(blocks_for(req.target_len, self._block_size)
                                             for req in done if req.target_created)
        elif ids or self._release_next:  # nothing left to step with: free them now, for whoever arrives
            ids, self._release_next, self._release_next_blocks = self._release_next + ids, [], 0
            try:
                self._target_usage(self.target.release(ids))
            except TargetUnavailable as exc:
                self._unreleased += ids
                log.warning("target release failed: %s", exc)
            except Unavailable:
                log.exception("target release failed")
        # One Release call per replica: on the H200 at 64 requests a wave of 64 calls, each on a worker
        # thread of this process, slowed the prefill steps that admitted the next wave.
        releases: dict[int, list[str]] = {}
        for req in done:
            self._detach_draft(req, release=True, batch=releases)
            with self._lock:
                self._ids.discard(req.request_id)
        for idx, rids in releases.items():
            self._draft_releases_next.setdefault(idx, []).extend(rids)
        if not self.running:  # no draft call follows to send them behind
            self._flush_draft_releases()
        if not self.running and not self.waiting:  # idle: the draft gauge must not keep the last step's value
            for replica in self.pool.healthy():  # queued after the releases above, on the replica's FIFO worker
                self._refresh_draft_usage(replica)

    def _preempt(self, req: Request) -> None:
        """Out of KV: forget req everywhere; it resumes later from its tokens (recompute)."""
        log.info("preempting %s (%d tokens) to free KV", req.request_id, req.num_tokens)
        if req.target_created:
            self._free_blocks = self.target.release([req.request_id]).free_blocks
        self._detach_draft(req, release=True)
        req.reset_for_recompute()
        self.running = [other for other in self.running if other is not req]
        self.waiting.insert(0, req)

    # --- a lost target ---------------------------------------------------------------
    def _check_idle_target(self) -> None:
        """While idle, notice a target that went away, so that health reports it at once
        rather than when the next request fails."""
        now = time.monotonic()
        if not self._ready or now - self._target_checked < TARGET_PROBE_S:
            return
        serving = self.target.health()
        self._target_checked = time.monotonic()
        if serving is None:
            self._target_misses += 1
            if self._target_misses < IDLE_TARGET_MISSES:
                log.info("the target's health check got no answer in time (%d of %d in a row before it counts as "
                         "lost)", self._target_misses, IDLE_TARGET_MISSES)
                return
        self._target_misses = 0
        if not serving:
            self._target_lost("its health check failed" if serving is False else
                              f"{IDLE_TARGET_MISSES} health checks in a row got no answer")

    def _target_lost(self, why: str) -> None:
        """The target is unreachable: refuse new requests, keep the running ones, and once the
        target answers again (restarted at the same address) re-prefill them from their tokens.
        Past cfg.target_wait_s they end UNAVAILABLE; the gateway serves again when it returns."""
        log.warning("target %s unreachable (%s): not serving; %d request(s) wait up to %.0f s for it",
                    self.target.address, why, len(self.running) + len(self.waiting), self.cfg.target_wait_s)
        self._target_down = True
        self._readiness_changed()
        forget = self._requeue_for_recompute()
        deadline = time.monotonic() + self.cfg.target_wait_s
        while not self._stop.is_set():
            if self._wait_for_target(deadline):
                try:
                    self._target_back(forget)
                    return
                except TargetUnavailable as exc:  # gone again at once: keep waiting
                    log.warning("target lost again while resuming: %s", exc)
                    continue
            message = (f"the target service was unreachable for longer than {self.cfg.target_wait_s:g} s "
                       "(--target-wait); retry")
            log.warning("target still unreachable after %.0f s: ending %d request(s) as unavailable",
                        self.cfg.target_wait_s, len(self.running) + len(self.waiting))
            for req in list(self.running) + list(self.waiting):
                self._finish(req, FinishReason.ABORT, message)
            deadline = float("inf")  # keep waiting, with nothing held, to serve again once it is back

    def _requeue_for_recompute(self) -> list[str]:
        """Put every running request back in the queue, in arrival order, to re-prefill from its
        tokens (as preemption does); release its draft state. Returns the ids the target may still
        hold, should it not have restarted after all (a broken stream to a live target)."""
        held = self.running + self._release_after_grant  # finished ones included: none was released
        forget = [req.request_id for req in held if req.target_created] + self._unreleased + self._release_next
        self.running, self._release_after_grant, self._unreleased, self._release_next = [], [], [], []
        self._release_next_blocks = 0
        requeued = []
        for req in held:
            self._detach_draft(req, release=True)
            if req.phase == Phase.FINISHED:
                with self._lock:
                    self._ids.discard(req.request_id)
            else:
                req.reset_for_recompute()
                requeued.append(req)
        self.waiting = sorted(requeued + self.waiting, key=lambda req: req.arrival)
        self.metrics.requests_running.set(0)
        self.metrics.requests_waiting.set(len(self.waiting))
        return forget

    def _wait_for_target(self, deadline: float) -> bool:
        """Ask the target's health with a growing pause until it serves (True) or the deadline
        passes (False), handling arrivals and aborts meanwhile (a client may give up waiting)."""
        pause = TARGET_RETRY_S[0]
        while not self._stop.is_set():
            self._take_inbox()
            if self.target.healthy():
                return True
            if time.monotonic() >= deadline:
                return False
            self._wake.wait(min(pause, max(deadline - time.monotonic(), 0.0)))
            self._wake.clear()
            pause = min(pause * 2, TARGET_RETRY_S[1])
        return False

    def _target_back(self, forget: list[str]) -> None:
        if forget:
            try:
                self.target.release(forget)  # a target that did not restart still holds them
            except (InvalidArgument, ResourceExhausted) as exc:
                log.warning("releasing the lost requests on the target failed: %s", exc)
        self.target.reconnect()
        self._target_usage(self.target.info().load)
        self._target_down = False
        self._readiness_changed()
        log.info("target %s is back: serving; re-prefilling %d request(s)", self.target.address, len(self.waiting))
