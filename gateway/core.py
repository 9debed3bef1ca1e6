"""The gateway core: owns every request and runs the step loop.

    while running:
        take new requests and aborts
        plan = plan_step(...)                 # who runs, which tokens (fresh object)
        budgets = choose_budgets(...)         # how much each decoding request speculates
        trees = draft(budgets)                # one call per replica; failures -> plain decode
        results = target.step(plan + trees)  # one call
        commit results to requests, emit deltas, feed the draft, release the finished
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from opentelemetry import trace

from draft_service.types import DraftBudget, DraftTree, IngestItem
from gateway.clients import DraftClient, TargetClient
from gateway.draft_pool import DraftPool, DraftReplica
from gateway.metrics import GatewayMetrics
from gateway.policy import (
    NO_SPEC,
    AcceptanceBook,
    Candidate,
    CostModel,
    LoadGate,
    PolicyConfig,
    choose_budgets,
    predicts_trees,
)
from gateway.request import Phase, Request
from gateway.scheduler import PlannedItem, SchedulerConfig, StepPlan, plan_step
from gateway.types import DeltaSink, GenerationParams, SpecStats
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from target_service.types import KvLoad, SamplingParams, SequenceResult, SequenceStep

log = logging.getLogger("tandem.gateway")
# A no-op tracer unless gateway.tracing installed a provider (--otlp-endpoint).
tracer = trace.get_tracer("tandem.gateway")


@dataclass(frozen=True)
class CoreConfig:
    policy: PolicyConfig = PolicyConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    max_queue: int = 1024
    max_model_len: int | None = None
    profile: bool = True  # measure the cost model at start-up


class GatewayCore:
    def __init__(self, target: TargetClient, drafts: list[DraftClient], tokenizer, cfg: CoreConfig,
                 model_name: str, metrics: GatewayMetrics | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.model_name = model_name
        self.metrics = metrics or GatewayMetrics()
        self.pool = DraftPool(drafts, on_lost=lambda _r: self._wake.set())
        self.costs = CostModel()
        self.book = AcceptanceBook()
        self.gate = LoadGate()
        self.max_model_len = 0
        self.feature_layers: tuple[int, ...] = ()
        self.eos_ids: frozenset[int] = frozenset()
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids: set[str] = set()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_blocks = 0
        self._vocab = 0
        self._ready = False
        self._draining = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.step_count = 0
        self._quiet = 0  # consecutive steps in which auto chose no tree
        self._ingest_queue: dict[int, list[tuple[Request, IngestItem]]] = {}  # replica -> this step's ingests

    # --- lifecycle ----------------------------------------------------------
    def start(self, timeout: float = 300.0) -> None:
        from gateway.clients import wait_healthy

        wait_healthy(self.target.channel, timeout)
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
        for r in self.pool.replicas:
            try:
                wait_healthy(r.client.channel, timeout)
                layers.add(r.client.info().feature_layers)
                r.healthy = True
            except Unavailable as exc:
                log.warning("draft replica %s unavailable at start (%s): will retry", r.client.address, exc)
        if len(layers) > 1:
            raise InvalidArgument(f"draft replicas disagree on feature layers: {sorted(layers)}")
        self.feature_layers = layers.pop() if layers else info.default_feature_layers
        if self.cfg.profile:
            from gateway.profiling import profile_costs
            self.costs = profile_costs(self.target, self.pool.healthy()[:1], self.cfg.policy)
            log.info("cost model: %s", self.costs)
        for fn, name in ((self._loop, "step-loop"), (self.pool.probe_forever, "draft-probe")):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self._ready = True

    def ready(self) -> bool:
        return self._ready and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish within `timeout`, abort the rest."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while (self.running or self.waiting or self._inbox) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in list(self.running) + list(self.waiting):
            self.abort(r.request_id)
        time.sleep(0.2)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self.pool.stop()
        for t in self._threads:
            t.join(timeout=5)
        self.target.close()

    # --- API ------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: GenerationParams,
               sink: DeltaSink) -> None:
        if not self._ready:
            raise Unavailable("the gateway is still starting")
        if self._draining:
            raise Unavailable("the gateway is draining")
        if not prompt_token_ids:
            raise InvalidArgument("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidArgument(f"the prompt has {len(prompt_token_ids)} tokens; this model allows at most "
                                  f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        bad = [t for t in prompt_token_ids if not 0 <= t < self._vocab]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is out of range")
        with self._lock:
            if request_id in self._ids:
                raise InvalidArgument(f"request id {request_id!r} is already in use")
            if len(self.waiting) + len(self._inbox) >= self.cfg.max_queue:
                raise ResourceExhausted(f"the queue is full ({self.cfg.max_queue} requests waiting)")
            self._ids.add(request_id)
            r = Request(request_id, list(prompt_token_ids), params, sink, self.eos_ids, self.tokenizer,
                        self.max_model_len)
            r.span = tracer.start_span("tandem.generate", attributes={
                "tandem.request_id": request_id, "tandem.prompt_tokens": len(prompt_token_ids),
                "tandem.max_tokens": params.max_tokens, "tandem.speculation": self._mode(r)})
            self._inbox.append(r)
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
                continue
            try:
                self._step()
            except Exception:
                log.exception("step failed; aborting the running requests")
                for r in list(self.running):
                    self._finish(r, "abort")
                time.sleep(0.5)

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = set(self._aborts), deque()
        self.waiting.extend(new)
        for r in list(self.running) + list(self.waiting):
            if r.request_id in aborts:
                self._finish(r, "abort")
        self.metrics.requests_waiting.set(len(self.waiting))

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._detach_lost_drafts()
        # A verified tree commits at most its depth: that bounds the KV a decode may need.
        max_depth = max(b.steps for b in [*self.cfg.policy.auto_options(), self.cfg.policy.fixed_budget])
        plan = plan_step(self.cfg.scheduler, self.running, self.waiting, self._free_blocks, max_depth)
        for r in plan.preempted:
            self._preempt(r)
        for r in plan.admitted:
            self.waiting.remove(r)
            r.phase = Phase.RUNNING
            self.running.append(r)
            self._attach_draft(r)
        if not plan.items:
            if plan.preempted:
                return
            raise RuntimeError(f"nothing schedulable: {len(self.running)} running, {len(self.waiting)} waiting, "
                               f"{self._free_blocks} KV blocks free")
        plan.budgets = self._budgets(plan)
        self._track_quiet(plan)
        if log.isEnabledFor(logging.DEBUG):
            spec = [f"{b.steps}/{b.topk}/{b.num_draft_tokens}" for b in plan.budgets.values() if not b.empty]
            log.debug("step %d: %d items, %d tokens, trees %s, gate %s", self.step_count,
                      len(plan.items), plan.num_tokens, spec, self.gate.arms)
        trees = self._draft(plan)
        steps = [self._sequence_step(it, trees.get(it.request.request_id)) for it in plan.items]
        try:
            results, load, _ = self.target.step(steps, self.feature_layers)
        except ResourceExhausted:
            # Our block estimate was off (another client, or fragmentation): free room and retry.
            self._preempt(max(self.running, key=lambda r: r.arrival))
            return
        self._free_blocks = load.free_blocks
        self.metrics.kv_usage.labels(service="target").set(1 - load.free_blocks / max(load.total_blocks, 1))
        for it, res in zip(plan.items, results, strict=True):
            rid = it.request.request_id
            self._apply(it, res, trees.get(rid), plan.budgets.get(rid, NO_SPEC))
        self._release_finished()
        self._flush_ingests()
        self.step_count += 1
        self.metrics.requests_running.set(len(self.running))
        self.metrics.requests_waiting.set(len(self.waiting))
        seconds = time.perf_counter() - t0
        self.metrics.step_seconds.observe(seconds)
        # Only decode steps measure what the policy chooses between: prefill work in a step
        # belongs to neither arm, and taxed whichever arm the gate probed first as a batch filled.
        decode = all(it.is_decode for it in plan.items)
        if decode and len(steps) < self.gate.min_batch:  # from min_batch on, the gate measures
            self.costs.observe(plan.num_tokens, len(steps), [plan.budgets[rid] for rid in trees], seconds)
        if decode and any(self._mode(it.request) == "auto" for it in plan.items):
            committed = sum(len(res.tokens) for it, res in zip(plan.items, results, strict=True) if it.is_decode)
            verdict = self.gate.record(len(steps), bool(trees), committed, seconds)
            if verdict is not None:
                log.info("load gate, %s: %s", self.gate.describe(len(steps)),
                         "speculating" if verdict else "decoding plainly")


    # --- speculation -------------------------------------------------------------
    def _mode(self, r: Request) -> str:
        return r.params.speculation or self.cfg.policy.mode

    def _draft_ready(self, r: Request) -> bool:
        rep = self._replica(r)
        return rep is not None and r.draft_len == len(r.tokens) and r.draft_caught_up

    def _replica(self, r: Request) -> DraftReplica | None:
        if r.draft_replica is None:
            return None
        rep = self.pool.replicas[r.draft_replica]
        return rep if rep.healthy else None

    def _draft_room(self, r: Request) -> int:
        """Deepest tree worth drafting: the bonus token takes one of the tokens still allowed."""
        return min(self.max_model_len - len(r.tokens), r.params.max_tokens - len(r.output)) - 1

    def _budgets(self, plan: StepPlan) -> dict[str, DraftBudget]:
        cands = []
        for it in plan.items:
            r = it.request
            if not it.is_decode or self._mode(r) == "never" or not self._draft_ready(r):
                continue
            if self._draft_room(r) < 1:
                continue
            cands.append(Candidate(r.request_id, {o: r.acceptance.mean(o) for o in self.cfg.policy.auto_options()},
                                   self._mode(r)))

        def other_work(cands: list[Candidate]) -> tuple[int, int]:
            keys = {c.key for c in cands}
            other = [it for it in plan.items if it.request.request_id not in keys]
            return sum(len(it.tokens) for it in other), len(other)

        def model_prefers_spec() -> bool:
            return predicts_trees(self.cfg.policy, self.costs, self.book, cands, *other_work(cands))

        if cands and not self.gate.allow_spec(len(plan.items), model_prefers_spec):
            cands = [c for c in cands if c.mode != "auto"]  # measured: plain decode pays at this load
        probe = bool(cands) and self.gate.probing_spec(len(plan.items))
        budgets = choose_budgets(self.cfg.policy, self.costs, self.book, cands, *other_work(cands), probe)
        # Never draft past the model's length or the request's max_tokens.
        by_id = {it.request.request_id: it.request for it in plan.items}
        for rid, b in list(budgets.items()):
            r = by_id[rid]
            room = self._draft_room(r)
            if not b.empty and b.steps > room:
                budgets[rid] = DraftBudget(room, b.topk, b.num_draft_tokens) if room >= 1 else NO_SPEC
        return budgets

    # Under load `auto` stops speculating; feeding every request's features to the
    # draft would then cost target output, gateway work and draft compute for
    # nothing. After QUIET_STEPS steps without a tree, auto requests go dormant (no
    # features, no ingest); every WAKE_EVERY steps they wake for QUIET_STEPS steps,
    # catch up from their tokens and are offered to the policy again.
    QUIET_STEPS = 16
    WAKE_EVERY = 128

    def _track_quiet(self, plan: StepPlan) -> None:
        if any(not b.empty for b in plan.budgets.values()) or len(plan.items) < self.gate.min_batch:
            self._quiet = 0  # speculating, or too light a load for feature traffic to matter
        elif self._quiet >= self.QUIET_STEPS or any(
                it.is_decode and self._mode(it.request) == "auto" and self._draft_ready(it.request)
                for it in plan.items):
            # A step counts once auto could have drafted and chose not to: drafts still taking in
            # the prompts of a filling batch are no verdict, and going dormant then (seen on the
            # CI machine) kept 48 requests from ever being offered a tree.
            self._quiet += 1

    def _dormant(self, r: Request) -> bool:
        q = self._quiet
        return self._mode(r) == "auto" and q >= self.QUIET_STEPS and q % self.WAKE_EVERY >= self.QUIET_STEPS

    def _draft(self, plan: StepPlan) -> dict[str, DraftTree]:
        by_replica: dict[int, list[tuple[Request, DraftBudget]]] = {}
        for it in plan.items:
            b = plan.budgets.get(it.request.request_id, NO_SPEC)
            if not b.empty:
                by_replica.setdefault(it.request.draft_replica, []).append((it.request, b))
        drafting = {r.request_id for items in by_replica.values() for r, _ in items}
        for r in self.running:  # deferred ingests of requests that do not draft now: send them off
            if r.pending_ingest is not None and r.request_id not in drafting:
                self._send_ingest(r)
        self._flush_ingests()  # before the draft calls: a replica applies its queue in order
        if not by_replica:
            return {}
        futures = {}
        for idx, items in by_replica.items():
            rep = self.pool.replicas[idx]
            # The drafting requests' new tokens and features ride in the same call.
            ingest = [r.pending_ingest for r, _ in items if r.pending_ingest is not None]
            for r, _ in items:
                r.pending_ingest = None
            calls = [(r.request_id, b, len(r.tokens)) for r, b in items]

            futures[idx] = rep.submit(lambda rep=rep, ingest=ingest, calls=calls: rep.client.draft(ingest, calls))
        trees: dict[str, DraftTree] = {}
        for idx, fut in futures.items():
            try:
                got, load = fut.result()
                self._draft_usage(load)
                for t in got:
                    if t.tokens:
                        trees[t.request_id] = t
            except (InvalidArgument, ResourceExhausted) as exc:
                log.warning("draft refused a call (%s); those requests decode plainly", exc)
                for r, _ in by_replica[idx]:
                    self._detach_draft(r, release=True)
            except Exception as exc:
                self.pool.mark_lost(self.pool.replicas[idx], str(exc))
        return trees

    # --- target step items and results ---------------------------------------------
    def _sequence_step(self, it: PlannedItem, tree: DraftTree | None) -> SequenceStep:
        r = it.request
        p = r.params
        sampling = SamplingParams(p.temperature, p.top_k, p.top_p, p.seed)
        want_features = self._replica(r) is not None and self._mode(r) != "never" and not self._dormant(r)
        top = p.logprobs or 0
        if tree is not None:
            tokens, parents, num_fixed = tree.verify_tree()
            return SequenceStep(r.request_id, tuple(tokens), tuple(parents), num_fixed, False, sampling, top,
                                want_features)
        step = SequenceStep.chain(r.request_id, it.tokens, create=not r.target_created, sampling=sampling,
                                  top_logprobs=top, return_features=want_features)
        return step

    def _apply(self, it: PlannedItem, res: SequenceResult, tree: DraftTree | None, budget: DraftBudget) -> None:
        r = it.request
        if r.phase == Phase.FINISHED:
            return
        old_len = r.target_len
        r.target_created = True
        r.target_len = res.num_committed
        if not it.reaches_end:  # a prefill chunk that is not the last: its sample is not output
            self._feed_draft(r, old_len, res, defer=False)
            return
        stats = r.stats
        if tree is not None:
            accepted = len(res.accepted_nodes)
            stats = SpecStats(stats.draft_tokens + len(tree.tokens), stats.accepted_tokens + accepted,
                              stats.verify_steps + 1, stats.plain_steps)
            self.metrics.num_drafts.inc()
            self.metrics.num_draft_tokens.inc(len(tree.tokens))
            self.metrics.num_accepted_tokens.inc(accepted)
            r.acceptance.record(budget, accepted)
            self.book.record(budget, accepted)
        elif it.is_decode:
            stats = SpecStats(stats.draft_tokens, stats.accepted_tokens, stats.verify_steps,
                              stats.plain_steps + 1)
            self.metrics.plain_decode_steps.inc()
            r.acceptance.fade(0.85)
        first = r.first_token_at is None
        prev_last = r.last_token_at
        delta = r.commit(res.tokens, res.logprobs, res.top_logprobs, res.num_committed, stats)
        now = time.monotonic()
        if first:
            self.metrics.ttft.observe(now - r.arrival)
        elif prev_last is not None and delta.token_ids:
            gap = (now - prev_last) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.metrics.itl.observe(gap)
        self._emit(r, delta)
        if r.phase != Phase.FINISHED:
            self._feed_draft(r, old_len, res, defer=tree is not None)

    def _emit(self, r: Request, delta) -> None:
        try:
            r.sink(delta)
        except Exception:
            log.exception("delivering output of %s failed; aborting it", r.request_id)
            r.phase = Phase.FINISHED
            r.finish_reason = "abort"
        if delta.finish_reason:
            if r.span is not None:
                r.span.set_attributes({"tandem.finish_reason": delta.finish_reason,
                                       "tandem.completion_tokens": len(r.output),
                                       **{f"tandem.spec.{k}": v for k, v in r.stats.as_dict().items()}})
                r.span.end()
                r.span = None
            self.metrics.e2e.observe(time.monotonic() - r.arrival)
            self.metrics.requests_total.labels(finish_reason=delta.finish_reason).inc()

    # --- draft state ---------------------------------------------------------------
    def _attach_draft(self, r: Request) -> None:
        if self._mode(r) == "never" or r.draft_replica is not None:
            return
        rep = self.pool.least_loaded()
        if rep is None:
            return
        r.draft_replica = rep.index
        r.draft_len = 0
        r.draft_feature_len = 0
        r.draft_caught_up = False
        rep.requests.add(r.request_id)

    def _detach_draft(self, r: Request, release: bool) -> None:
        if r.draft_replica is None:
            return
        rep = self.pool.replicas[r.draft_replica]
        rep.requests.discard(r.request_id)
        if release and rep.healthy:
            rep.submit(lambda: rep.client.release([r.request_id]))
        r.draft_replica = None
        r.draft_len = 0
        r.draft_feature_len = 0
        r.draft_caught_up = False
        r.pending_ingest = None
        queued = self._ingest_queue.get(rep.index)
        if queued:
            self._ingest_queue[rep.index] = [(x, item) for x, item in queued if x is not r]

    def _detach_lost_drafts(self) -> None:
        for r in self.running:
            if r.draft_replica is not None and not self.pool.replicas[r.draft_replica].healthy:
                self._detach_draft(r, release=False)
            if r.draft_replica is None and r.phase == Phase.RUNNING and self._mode(r) != "never":
                self._attach_draft(r)

    def _feed_draft(self, r: Request, old_len: int, res: SequenceResult, defer: bool) -> None:
        """Pass the request's new tokens (and features) to its replica.

        defer: the request just drafted and will likely draft again, so the
        ingest waits to ride in its next draft call (one round trip, not two).
        Otherwise it goes now, without waiting: the replica's worker applies it
        before any later draft call, and the replica computes the KV while the
        target runs the next step.
        """
        rep = self._replica(r)
        if rep is None or self._dormant(r):
            return
        # The draft learns committed tokens and the one after them, never more: a
        # position it computes without the target's features is only approximate.
        known = r.tokens[:r.target_len + 1]
        feats = res.features
        pending = r.pending_ingest
        if feats is not None and r.draft_feature_len == old_len and r.draft_len >= old_len:
            start = old_len  # contiguous: these features belong to positions old_len..
            r.draft_feature_len = old_len + feats.shape[0]
            if pending is not None and pending.features is not None and \
                    pending.start_position + pending.features.shape[0] == old_len:
                start, feats = pending.start_position, torch.cat((pending.features, feats))
            elif pending is not None:
                self._send_ingest(r)
        else:
            if pending is not None:
                self._send_ingest(r)
            start, feats = r.draft_len, None  # tokens only: the draft catches up from its own states
        r.pending_ingest = IngestItem(r.request_id, start, tuple(known[start:]), feats)
        r.draft_len = len(known)
        if not defer or not r.draft_caught_up:
            self._send_ingest(r)

    def _send_ingest(self, r: Request) -> None:
        """Queue r's pending ingest; _flush_ingests sends a step's ingests to each replica together."""
        rep = self._replica(r)
        item, r.pending_ingest = r.pending_ingest, None
        if rep is None or item is None:
            return
        self._ingest_queue.setdefault(rep.index, []).append((r, item))

    def _flush_ingests(self) -> None:
        """One Ingest call per replica (more only where a request has two items). With one RPC per
        request through the replica's queue, plain steps of 64 requests that still fed the draft
        read 202-207 tok/s to the load gate on CPU, and 257-269 with one call per replica."""
        queued, self._ingest_queue = self._ingest_queue, {}
        for idx, pairs in queued.items():
            rep = self.pool.replicas[idx]
            rounds: list[list[tuple[Request, IngestItem]]] = []
            seen: dict[str, int] = {}
            for r, item in pairs:  # the draft takes one item per request per call, in order
                n = seen[r.request_id] = seen.get(r.request_id, -1) + 1
                if n == len(rounds):
                    rounds.append([])
                rounds[n].append((r, item))
            for batch in rounds:
                def send(rep=rep, batch=batch):
                    # catch_up: compute the draft KV now, while the target runs the next step.
                    self._draft_usage(rep.client.ingest([item for _, item in batch], catch_up=True))
                    for r, _ in batch:
                        r.draft_caught_up = True  # a plain flag write; the loop reads it next step

                fut = rep.submit(send)
                fut.add_done_callback(lambda f, rep=rep: f.exception() and self._ingest_failed(rep, f.exception()))

    def _draft_usage(self, load: KvLoad) -> None:
        self.metrics.kv_usage.labels(service="draft").set(1 - load.free_blocks / max(load.total_blocks, 1))

    def _ingest_failed(self, rep: DraftReplica, exc: BaseException) -> None:
        if isinstance(exc, (InvalidArgument, ResourceExhausted)):
            log.warning("draft %s refused an ingest: %s", rep.client.address, exc)
        self.pool.mark_lost(rep, str(exc))

    # --- finishing ----------------------------------------------------------------
    def _finish(self, r: Request, reason: str) -> None:
        if r.phase != Phase.FINISHED:
            self._emit(r, r.finish(reason))
        r.phase = Phase.FINISHED
        self._release_finished()

    def _release_finished(self) -> None:
        done = [r for r in self.running + self.waiting if r.phase == Phase.FINISHED]
        if not done:
            return
        self.running = [r for r in self.running if r.phase != Phase.FINISHED]
        self.waiting = [r for r in self.waiting if r.phase != Phase.FINISHED]
        ids = [r.request_id for r in done if r.target_created]
        if ids:
            try:
                load = self.target.release(ids)
                self._free_blocks = load.free_blocks
                self.metrics.kv_usage.labels(service="target").set(1 - load.free_blocks / max(load.total_blocks, 1))
            except Unavailable:
                log.exception("target release failed")
        for r in done:
            self._detach_draft(r, release=True)
            with self._lock:
                self._ids.discard(r.request_id)
        if not self.running and not self.waiting:  # idle: the draft gauge must not keep the last step's value
            for rep in self.pool.healthy():  # queued after the releases above, on the replica's FIFO worker
                rep.submit(lambda rep=rep: self._draft_usage(rep.client.info().load))

    def _preempt(self, r: Request) -> None:
        """Out of KV: forget r everywhere; it resumes later from its tokens (recompute)."""
        log.info("preempting %s (%d tokens) to free KV", r.request_id, len(r.tokens))
        if r.target_created:
            self._free_blocks = self.target.release([r.request_id]).free_blocks
        self._detach_draft(r, release=True)
        r.reset_for_recompute()
        if r in self.running:
            self.running.remove(r)
        self.waiting.insert(0, r)
