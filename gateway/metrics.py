"""The gateway's Prometheus metrics. Names are a fixed interface (DESIGN.md section 4)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.load_gate import AuditArm, AuditRow
from tandem.service_metrics import LaneSpinCollector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def observe_times(histogram: Histogram, value: float, times: int) -> None:
    """`times` observations of one value: what `times` calls of `histogram.observe(value)` record, with
    one lock for the sum and one for the bucket instead of two per call. Why: the gateway observes each
    output token's inter-token gap, and a step of 8 requests with trees commits about 30 tokens (a
    profile of `bench/gateway_step.py` at 8 requests: metric updates were 22% of the gateway's step).
    Falls back to the calls where this prometheus-client keeps its buckets otherwise."""
    if times <= 0:
        return
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for _ in range(times):
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    total.inc(value * times)
    buckets[bisect.bisect_left(bounds, value)].inc(times)  # the first bucket whose bound >= value, as observe


class _VerifySeries:
    """One model's children of the vLLM-named verify counters, looked up once: record_verifies
    runs every step with trees, and each `.labels()` takes a lock and builds a key.
    Per-position children are made on first use, when `.labels()` would have made them."""

    def __init__(self, metrics: GatewayMetrics, model_name: str):
        self._labels = {"model_name": model_name, "engine": "0"}
        self.drafts = metrics.vllm_num_drafts.labels(**self._labels)
        self.draft_tokens = metrics.vllm_num_draft_tokens.labels(**self._labels)
        self.accepted_tokens = metrics.vllm_num_accepted_tokens.labels(**self._labels)
        self._per_position = metrics.vllm_accepted_per_pos
        self._accepted_at: dict[int, Counter] = {}

    def accepted_at(self, position: int) -> Counter:
        child = self._accepted_at.get(position)
        if child is None:
            child = self._accepted_at[position] = self._per_position.labels(**self._labels, position=str(position))
        return child


class _PolicyAudit:
    """auto's decisions against what followed, read from the load gate at each scrape, per batch
    bucket (`sequences`) and arm (trees, plain, or configured_tree: the configured tree for every
    auto request, as `always` drafts it, predicted only):

    - `tandem_policy_goodput_tokens_per_second{figure}`: the cost model's prediction and the
      gate's measurement (committed tokens per second of step time, each step as the bucket's lightest
      count of sequences would have run it: LoadGate.record), decayed means: now;
    - counters whose differences between two scrapes audit that interval (a `tandem bench`
      level, say): `tandem_policy_predictions_total` and `tandem_policy_predicted_goodput_total`
      (the predictions, summed: their mean is the second over the first), and
      `tandem_policy_arm_committed_tokens_total` and `tandem_policy_arm_step_seconds_total` (what
      the arm's steps committed and took: the measured goodput is the first over the second);
      `tandem_policy_predicted_step_seconds_total` and `tandem_policy_predicted_step_tokens_total`
      (the step each prediction priced, summed: over the predictions, the mean step's time and
      tokens, to set beside a mode's decode steps and tell a mispriced step from mispredicted tokens);
    - `tandem_policy_prompt_seconds_per_token{arm}` (trees or plain): what joining prompts add to each
      committed token's time under that arm, over all loads (PromptCharges; 0 until both arms have a
      charge). A decode-step rate r delivers 1 / (1 / r + this);
    - `tandem_policy_load_prompt_seconds_per_token{arm, sequences}`: the same as the gate charges it at
      that load (the load's own charges where it has both arms', else all loads')."""

    def __init__(self, audit: Callable[[], list[AuditRow]], prompt_charge: Callable[[bool], float] | None = None):
        self.audit = audit
        self.prompt_charge = prompt_charge

    def collect(self) -> Iterator[Metric]:
        labels = ["arm", "sequences"]
        now = GaugeMetricFamily("tandem_policy_goodput_tokens_per_second",
                                "auto's decisions against what followed: goodput per batch bucket and arm, "
                                "as the cost model predicted it and as the load gate measured it (decayed means)",
                                labels=[*labels, "figure"])
        predictions = CounterMetricFamily("tandem_policy_predictions", "Steps at which auto's cost model "
                                          "predicted this arm's goodput", labels=labels)
        predicted = CounterMetricFamily("tandem_policy_predicted_goodput", "auto's predictions of this arm's "
                                        "goodput (tok/s), summed over its predictions", labels=labels)
        committed = CounterMetricFamily("tandem_policy_arm_committed_tokens", "Tokens committed by the steps "
                                        "the load gate measured for this arm", labels=labels)
        seconds = CounterMetricFamily("tandem_policy_arm_step_seconds", "Wall time of the steps the load gate "
                                      "measured for this arm", labels=labels)
        step_seconds = CounterMetricFamily("tandem_policy_predicted_step_seconds", "The step times auto's cost "
                                           "model predicted for this arm, summed over its predictions",
                                           labels=labels)
        step_tokens = CounterMetricFamily("tandem_policy_predicted_step_tokens", "The tokens auto's cost model "
                                          "predicted a step of this arm commits, summed over its predictions",
                                          labels=labels)
        load_charge = GaugeMetricFamily("tandem_policy_load_prompt_seconds_per_token", "What joining prompts add "
                                        "to each committed token's time under this arm at this load, as the load "
                                        "gate charges it", labels=labels)
        for row in self.audit():
            key = [str(row.arm), row.sequences]
            for figure, value in (("predicted", row.predicted), ("measured", row.measured)):
                if value is not None:
                    now.add_metric([*key, figure], value)
            predictions.add_metric(key, row.predictions)
            predicted.add_metric(key, row.predicted_sum)
            committed.add_metric(key, row.committed_total)
            seconds.add_metric(key, row.seconds_total)
            step_seconds.add_metric(key, row.predicted_seconds_sum)
            step_tokens.add_metric(key, row.predicted_tokens_sum)
            if row.prompt_charge is not None:
                load_charge.add_metric(key, row.prompt_charge)
        yield from (now, predictions, predicted, committed, seconds, step_seconds, step_tokens, load_charge)
        if self.prompt_charge is not None:
            charge = GaugeMetricFamily("tandem_policy_prompt_seconds_per_token", "What joining prompts add to "
                                       "each committed token's time under this arm, over all loads (the load gate "
                                       "charges each load its own where it has both arms')", labels=["arm"])
            for arm, spec in ((AuditArm.TREES, True), (AuditArm.PLAIN, False)):
                charge.add_metric([str(arm)], self.prompt_charge(spec))
            yield charge


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        registry = self.registry
        registry.register(LaneSpinCollector())  # the gateway's own spinning reads (its waits for replies)
        self.requests_running = Gauge("tandem_requests_running", "Requests in the running batch", registry=registry)
        self.requests_waiting = Gauge("tandem_requests_waiting", "Requests queued for admission", registry=registry)
        self.gate_load = Gauge("tandem_policy_gate_load", "Requests the load gate judged at the last plan: the "
                               "most the gateway held over its last plans (tandem gateway --gate-load-hold-plans)",
                               registry=registry)
        self.num_drafts = Counter("tandem_spec_decode_num_drafts", "Token trees verified", registry=registry)
        self.num_draft_tokens = Counter("tandem_spec_decode_num_draft_tokens",
                                        "Drafted tokens sent for verification", registry=registry)
        self.num_accepted_tokens = Counter("tandem_spec_decode_num_accepted_tokens",
                                           "Drafted tokens the target accepted", registry=registry)
        self.plain_decode_steps = Counter("tandem_plain_decode_steps",
                                          "Per-request decode steps without a tree", registry=registry)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.kv_usage = Gauge("tandem_kv_cache_usage_ratio", "Share of KV blocks in use", ["service"],
                              registry=registry)
        self.step_seconds = Histogram("tandem_step_seconds", "Gateway step wall time",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.requests_total = Counter("tandem_requests", "Finished requests", ["finish_reason"], registry=registry)
        phases = Histogram("tandem_step_phase_seconds", "Gateway loop time by phase: schedule (plan and "
                           "budgets), draft (draft calls), execute (waiting for the target's step), update "
                           "(commit, emit, feed the draft), record (metrics, cost model, load gate)", ["phase"],
                           buckets=LATENCY_BUCKETS, registry=registry)
        self.step_phase = {p: phases.labels(phase=p) for p in ("schedule", "draft", "execute", "update", "record")}
        # Where a busy loop's time goes, step by step, as the policy weighs it (a planned step's whole
        # round, a granted step's gap between replies): auto's loss against `never` at a load where it
        # decodes plainly is in the steps that are not granted ones (fed, trees, probes).
        kinds = Histogram("tandem_step_kind_seconds", "Target steps by kind: granted (inside a plain-decode "
                          "grant), plain (planned alone, feeding no draft), fed (plain, feeding the drafts), "
                          "trees (verifying drafted trees), prefill (carrying prompt chunks); seconds as the "
                          "load gate counts them", ["kind"], buckets=LATENCY_BUCKETS, registry=registry)
        self.step_kind = {k: kinds.labels(kind=k) for k in ("granted", "plain", "fed", "trees", "prefill")}
        self.granted_steps = Counter("tandem_granted_steps", "Target steps run inside plain-decode grants "
                                     "(the target fed its own tokens forward)", registry=registry)
        # What each mode's decoding delivered at the gateway, per batch bucket: the audit's predictions are
        # for decode steps, while a client's rate after its first token also waits on the prompt chunks of
        # requests that join (at 64 requests on the H200, `never` delivered 0.65-0.75x the rate the load gate
        # measured for auto's plain decode steps in the same rounds, 2026-12-03), so `tandem bench` sets the
        # predictions beside these too.
        self.decode_step_seconds = Counter("tandem_decode_step_seconds", "Wall time of decode steps (no prompt "
                                           "chunk in them), every mode's, by batch bucket and arm (trees or "
                                           "plain)", ["arm", "sequences"], registry=registry)
        self.decode_step_committed = Counter("tandem_decode_step_committed_tokens", "Tokens committed by decode "
                                             "steps, every mode's, by batch bucket and arm (trees or plain)",
                                             ["arm", "sequences"], registry=registry)
        self.decode_steps = Counter("tandem_decode_steps", "Decode steps, every mode's, by batch bucket and arm "
                                    "(trees or plain)", ["arm", "sequences"], registry=registry)
        # Counted when a request finishes: output tokens per speculation mode (dashboards: tok/s by mode).
        self.generation_tokens = Counter("tandem_generation_tokens", "Output tokens of finished requests, by "
                                         "the request's speculation mode", ["speculation"], registry=registry)
        # The same speculation counters under vLLM's names and labels, where vLLM-aware dashboards
        # and benchmark clients look for them.
        labels = ["model_name", "engine"]
        self.vllm_num_drafts = Counter("vllm:spec_decode_num_drafts", "Token trees verified (vLLM's name)",
                                       labels, registry=registry)
        self.vllm_num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens sent for "
                                             "verification (vLLM's name)", labels, registry=registry)
        self.vllm_num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the "
                                                "target accepted (vLLM's name)", labels, registry=registry)
        self.vllm_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Verified trees "
                                             "whose drafted path was accepted past each position (vLLM's name)",
                                             [*labels, "position"], registry=registry)

        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests (vLLM's "
                                          "name)", labels, registry=registry)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Output tokens of finished requests "
                                              "(vLLM's name)", labels, registry=registry)
        self._verify_series: dict[str, _VerifySeries] = {}  # model name -> its children
        self._audit: _PolicyAudit | None = None

    def watch_policy(self, audit: Callable[[], list[AuditRow]],
                     prompt_charge: Callable[[bool], float] | None = None) -> None:
        """Export the policy's audit (LoadGate.audit, and PromptCharges.seconds_per_token) at every scrape;
        once per registry."""
        if self._audit is None:
            self._audit = _PolicyAudit(audit, prompt_charge)
            self.registry.register(self._audit)
        else:
            self._audit.audit, self._audit.prompt_charge = audit, prompt_charge

    def record_decode_step(self, sequences: str, trees: bool, committed: int, seconds: float) -> None:
        """One decode step of any mode: `sequences` is its batch bucket's label ("16-31")."""
        arm = "trees" if trees else "plain"
        self.decode_step_seconds.labels(arm=arm, sequences=sequences).inc(seconds)
        self.decode_step_committed.labels(arm=arm, sequences=sequences).inc(committed)
        self.decode_steps.labels(arm=arm, sequences=sequences).inc()

    def record_finished(self, model_name: str, prompt_tokens: int, completion_tokens: int) -> None:
        labels = {"model_name": model_name, "engine": "0"}
        self.vllm_prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.vllm_generation_tokens.labels(**labels).inc(completion_tokens)

    def record_verifies(self, model_name: str, trees: Iterable[tuple[int, int]]) -> None:
        """A step's verified trees, each (drafted nodes, accepted of them on the kept path): each counter
        moves once a step, not once a tree (and a position's once a step, not once a tree that reached it)."""
        trees = list(trees)
        if not trees:
            return
        drafted = sum(d for d, _ in trees)
        accepted = sum(a for _, a in trees)
        self.num_drafts.inc(len(trees))
        self.num_draft_tokens.inc(drafted)
        self.num_accepted_tokens.inc(accepted)
        series = self._verify_series.get(model_name)
        if series is None:
            series = self._verify_series[model_name] = _VerifySeries(self, model_name)
        series.drafts.inc(len(trees))
        series.draft_tokens.inc(drafted)
        series.accepted_tokens.inc(accepted)
        reached = sorted(a for _, a in trees)  # trees that accepted at position p: those with a > p
        for position in range(reached[-1]):
            series.accepted_at(position).inc(len(reached) - bisect.bisect_right(reached, position))
