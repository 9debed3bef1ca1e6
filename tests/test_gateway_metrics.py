"""The gateway's batched metric updates read as the one-at-a-time updates they replace."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.metrics import LATENCY_BUCKETS, GatewayMetrics, observe_times


def exposition(registry: CollectorRegistry, prefix: str) -> list[str]:
    """The registry's sample lines under `prefix`, creation timestamps left out."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith(prefix) and "_created" not in line]


def test_a_gap_observed_for_each_of_a_steps_tokens_reads_as_that_many_observations():
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    looped = Histogram("itl_seconds", "gaps", buckets=LATENCY_BUCKETS, registry=one_by_one)
    counted = Histogram("itl_seconds", "gaps", buckets=LATENCY_BUCKETS, registry=batched)
    # On a bound (a bucket takes values up to and including it), between bounds, above the last
    # bound (+Inf), zero, and no tokens at all.
    for gap, tokens in [(0.005, 3), (0.0042, 7), (100.0, 2), (0.0, 1), (0.02, 0), (0.005, 1)]:
        for _ in range(tokens):
            looped.observe(gap)
        observe_times(counted, gap, tokens)
    lines = exposition(one_by_one, "itl_seconds")
    assert lines == exposition(batched, "itl_seconds")
    assert 'itl_seconds_bucket{le="0.005"} 12.0' in lines and "itl_seconds_count 14.0" in lines


def test_a_steps_verified_trees_count_as_each_tree_would_alone():
    """One call per step with every tree's (drafted, accepted): the vLLM-named counters, the
    per-position acceptance among them, read as one call per tree."""
    trees = [(8, 3), (8, 0), (6, 5), (11, 3), (8, 1)]
    per_tree, per_step = GatewayMetrics(), GatewayMetrics()
    for tree in trees:
        per_tree.record_verifies("m", [tree])
    per_step.record_verifies("m", trees)
    per_step.record_verifies("m", [])  # a step without trees moves nothing
    for prefix in ("tandem_spec_decode", "vllm:spec_decode"):
        lines = exposition(per_tree.registry, prefix)
        assert lines and lines == exposition(per_step.registry, prefix)
    accepted_at = [line for line in exposition(per_step.registry, "vllm:spec_decode_num_accepted_tokens_per_pos")]
    assert any('position="0"' in line and line.endswith(" 4.0") for line in accepted_at)
    assert any('position="4"' in line and line.endswith(" 1.0") for line in accepted_at)
