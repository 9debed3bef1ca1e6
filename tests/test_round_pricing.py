"""Each tree shape's round timed at start-up (gateway/profiling.py: price_rounds), and how the cost model prices
with what it measured (CostModel.shape_factors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draft_service.types import DraftBudget, DraftTree
from gateway import profiling
from gateway.clients import DraftInfo, TargetInfo
from gateway.cost_model import CostModel, batch_bucket
from gateway.policy import PolicyConfig
from gateway.profiling import PREFILL_TOKENS, PREFIX, ROUND_BATCHES, ROUND_REPEATS, price_rounds
from target_service.types import KvLoad, SequenceResult

# A linear profile (seconds): what price_rounds measures the shapes against.
LINEAR = dict(target_base=5e-3, target_per_token=2e-5, target_per_seq=1e-4, draft_base=1e-3,
              draft_per_level=3e-4, draft_per_expansion=2e-6)


class Clock:
    """perf_counter for price_rounds: the fake services move it by what their calls cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def draft_seconds(budget: DraftBudget, batch: int) -> float:
    """A draft whose levels cost more as the batch grows, as a GPU's do past the profile's four requests."""
    return 1e-3 + budget.steps * 3e-4 * (1 + batch / 8)


def verify_seconds(nodes: int, batch: int) -> float:
    """A verify that costs a whole 16-node bucket whenever a tree holds more than 8 nodes."""
    return 5e-3 + batch * (16 if nodes > 8 else 8) * 2e-5


class FakeDraft:
    def __init__(self, clock: Clock, device: str = "cuda", free_blocks: int = 10_000, context: int = PREFIX):
        self.clock, self.device, self.free_blocks, self.context = clock, device, free_blocks, context
        self.ingest_calls: list[int] = []  # requests taken in per Ingest call
        self.ingested: list[str] = []
        self.released: list[str] = []
        self.calls: list[tuple[DraftBudget, int]] = []

    def info(self) -> DraftInfo:
        load = KvLoad(0, 16, self.free_blocks, self.free_blocks)
        return DraftInfo((1, 2, 3), 4096, 10, 8, 64, load, device=self.device, feature_width=12)

    def ingest(self, items, catch_up=False):
        assert catch_up and all(len(it.tokens) == self.context for it in items)
        self.ingest_calls.append(len(items))
        self.ingested += [it.request_id for it in items]

    def draft(self, ingest, items):
        assert not ingest and len({budget for _, budget, _ in items}) == 1
        budget = items[0][1]
        self.calls.append((budget, len(items)))
        self.clock.now += draft_seconds(budget, len(items))
        nodes = budget.max_nodes  # a chain below the draft's own last token
        trees = [DraftTree(rid, 7, n, tokens=list(range(100, 100 + nodes)), parents=list(range(-1, nodes - 1)))
                 for rid, _, n in items]
        return SimpleNamespace(trees=trees)

    def release(self, request_ids):
        self.released += request_ids


class FakeTarget:
    def __init__(self, clock: Clock, free_blocks: int = 10_000, context: int = PREFIX):
        self.clock, self.free_blocks, self.context = clock, free_blocks, context
        self.creates: list[int] = []  # requests created per Step call
        self.pending: dict[str, int] = {}
        self.released: list[str] = []

    def info(self) -> TargetInfo:
        return TargetInfo("fake", 1000, 64, 4096, (0,), (1, 2, 3), KvLoad(0, 16, self.free_blocks, self.free_blocks))

    def step(self, items, feature_layers):
        results = []
        for it in items:
            if it.create:
                assert len(it.tokens) == self.context
            else:  # a verify: the tree hangs below this sequence's pending token
                assert it.tokens[0] == self.pending[it.request_id] and it.num_fixed == 1
                assert it.parents[:2] == (-1, 0)
            self.pending[it.request_id] = 1 + len(self.pending) + int(self.clock.now * 1e6) % 500
            results.append(SequenceResult(it.request_id, [0], [self.pending[it.request_id]], [0.0], [], None, 1))
        if items[0].create:
            self.creates.append(len(items))
        else:
            self.clock.now += verify_seconds(len(items[0].tokens) - 1, len(items))
        return results, None, 0.0

    def release(self, request_ids):
        self.released += request_ids


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(profiling, "time", clock)
    return clock


def test_each_option_is_priced_at_each_batch_bucket_by_its_own_timed_round(clock):
    cfg = PolicyConfig("auto")
    costs = CostModel(**LINEAR)
    target, draft = FakeTarget(clock), FakeDraft(clock)
    factors = price_rounds(target, SimpleNamespace(client=draft), cfg, costs, max_batch=256)
    assert set(factors) == {(batch_bucket(b), o.shape) for b in ROUND_BATCHES for o in cfg.auto_options()}
    for batch in ROUND_BATCHES:
        for option in cfg.auto_options():
            fitted = costs.target_time(batch * (1 + option.max_nodes), batch) + costs.draft_time([option] * batch)
            measured = draft_seconds(option, batch) + verify_seconds(option.max_nodes, batch)
            assert factors[(batch_bucket(batch), option.shape)] == pytest.approx(measured / fitted)
    # One untimed call, then the timed ones, for each (option, batch).
    assert len(draft.calls) == (1 + ROUND_REPEATS) * len(ROUND_BATCHES) * len(cfg.auto_options())
    # The throwaway requests leave both services.
    assert sorted(target.released) == sorted(draft.ingested) == sorted(draft.released)
    assert len(draft.ingested) == max(ROUND_BATCHES)
    # The fits price the 10-level chain at 16 requests too cheap here, and the 5/4/8 tree close.
    deep, tree = DraftBudget(10, 1, 11), DraftBudget(5, 4, 8)
    assert factors[(batch_bucket(16), deep.shape)] > 1.3 > factors[(batch_bucket(16), tree.shape)]


def test_rounds_stay_within_the_running_batch_and_both_services_free_kv(clock):
    cfg = PolicyConfig("auto")

    def batches(max_batch: int = 256, target_blocks: int = 10_000, draft_blocks: int = 10_000) -> set[int]:
        draft = FakeDraft(clock, free_blocks=draft_blocks)
        price_rounds(FakeTarget(clock, target_blocks), SimpleNamespace(client=draft), cfg, CostModel(**LINEAR),
                     max_batch)
        return {batch for _, batch in draft.calls}

    assert batches(max_batch=20) == {1, 2, 4, 8, 16}
    # Each request may keep, on the target, the prompt and every timed tree with its bonus token.
    target_tokens = PREFIX + ROUND_REPEATS * sum(o.max_nodes + 1 for o in cfg.auto_options())
    assert batches(target_blocks=9 * -(-target_tokens // 16)) == {1, 2, 4, 8}
    # On the draft, the prompt and the deepest tree: 32 + 16 tokens, 3 blocks.
    assert batches(draft_blocks=3 * 5) == {1, 2, 4}
    assert batches(draft_blocks=2) == set()


def test_rounds_run_on_prompts_of_the_profile_context_taken_in_a_few_requests_at_a_time(clock):
    """--profile-context: each throwaway request holds that many tokens, so a round reads a serve's context; its
    prompts reach each service in calls of at most PREFILL_TOKENS tokens, and KV room is counted with them."""
    cfg = PolicyConfig("auto")
    context = 1024
    target, draft = FakeTarget(clock, context=context), FakeDraft(clock, context=context)
    factors = price_rounds(target, SimpleNamespace(client=draft), cfg, CostModel(**LINEAR), 64, context=context)
    assert {batch for _, batch in draft.calls} == set(ROUND_BATCHES) and len(factors) == 35
    per_call = PREFILL_TOKENS // context
    assert draft.ingest_calls == target.creates == [per_call] * (64 // per_call)
    assert sorted(target.released) == sorted(draft.ingested) == sorted(draft.released)
    # Room on the draft: the context and the deepest tree per request.
    blocks = -(-(context + 16) // 16)
    draft = FakeDraft(clock, free_blocks=10 * blocks, context=context)
    price_rounds(FakeTarget(clock, context=context), SimpleNamespace(client=draft), cfg, CostModel(**LINEAR), 64,
                 context=context)
    assert {batch for _, batch in draft.calls} == {1, 2, 4, 8}
    with pytest.raises(ValueError, match="context"):
        price_rounds(target, SimpleNamespace(client=draft), cfg, CostModel(**LINEAR), 64, context=0)
    # A context past the model's length (4096 here) is cut to leave room for the timed trees.
    growth = ROUND_REPEATS * sum(o.max_nodes + 1 for o in cfg.auto_options())
    longest = FakeTarget(clock, context=4096 - growth)
    assert price_rounds(longest, SimpleNamespace(client=FakeDraft(clock, context=4096 - growth)), cfg,
                        CostModel(**LINEAR), 4, context=100_000)


def test_a_cpu_draft_or_a_fixed_mode_prices_no_rounds(clock):
    for device, mode in (("cpu", "auto"), ("cuda", "always"), ("cuda", "never")):
        draft = FakeDraft(clock, device=device)
        assert price_rounds(FakeTarget(clock), SimpleNamespace(client=draft), PolicyConfig(mode), CostModel(**LINEAR),
                            256) == {}
        assert not draft.calls and not draft.ingested


def test_a_shape_timed_at_start_up_is_priced_at_its_round_and_takes_the_ratio_another_shape_taught():
    """The ratios learned online are what serving adds to any shape alike: a bucket's ratio learned from 5/4/8
    rounds prices a 10/1/11 chain not yet drafted alone at its own timed round times that ratio."""
    costs = CostModel(**LINEAR)
    tree, deep = DraftBudget(5, 4, 8), DraftBudget(10, 1, 11)
    costs.shape_factors = {(batch_bucket(4), deep.shape): 1.45, (batch_bucket(4), tree.shape): 1.0}

    def linear(option: DraftBudget, seqs: int) -> float:
        return costs.target_time(seqs * (1 + option.max_nodes), seqs) + costs.draft_time([option] * seqs)

    def price(option: DraftBudget, seqs: int = 4) -> float:
        return costs.step_time(seqs * (1 + option.max_nodes), seqs, [option] * seqs)

    assert price(deep) == pytest.approx(1.45 * linear(deep, 4)) and price(tree) == pytest.approx(linear(tree, 4))
    assert price(deep, 7) == pytest.approx(1.45 * linear(deep, 7))  # the whole bucket
    assert price(deep, 8) == pytest.approx(linear(deep, 8))  # a bucket not timed: the fits alone
    for _ in range(30):
        costs.observe(4, 4, [tree] * 4, 1.3 * linear(tree, 4))
    assert costs.ratios[(batch_bucket(4), True)] == pytest.approx(1.3, rel=0.01)
    assert price(deep) == pytest.approx(1.3 * 1.45 * linear(deep, 4), rel=0.01)
    # What search_budgets prices the chain with is the same figure.
    base, per_token, per_expansion = costs.tree_step_line(4, deep.steps, deep)
    line = base + per_token * 4 * (1 + deep.max_nodes) + per_expansion * 4 * deep.steps * deep.topk
    assert line == pytest.approx(price(deep))
    # Drafted alone at its timed round times the same ratio, the chain's own ratio is that ratio.
    for _ in range(30):
        costs.observe(4, 4, [deep] * 4, 1.3 * 1.45 * linear(deep, 4))
    assert costs.option_ratios[(batch_bucket(4), deep)] == pytest.approx(1.3, rel=0.01)
    # Trees of both shapes in one step: the dearer shape's round.
    mixed = [tree] * 3 + [deep]
    assert costs.profiled_time(4 + 3 * tree.max_nodes + deep.max_nodes, 4, mixed) == pytest.approx(
        1.45 * (costs.target_time(4 + 3 * tree.max_nodes + deep.max_nodes, 4) + costs.draft_time(mixed)))


def test_the_profile_context_flag_reaches_the_gateway_config_and_a_bad_value_is_refused():
    from gateway.core import CoreConfig
    from gateway.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["--target", "t:1"]).profile_context == CoreConfig().profile_context == PREFIX
    assert parser.parse_args(["--target", "t:1", "--profile-context", "1024"]).profile_context == 1024
    assert "--profile-context TOKENS" in " ".join(parser.format_help().split())
    with pytest.raises(ValueError, match="context"):
        CoreConfig(profile_context=0)
