"""Tree growth on the device equals the host rule it replaces, on every attention backend.

draft_service.device_tree grows a batch's trees in fixed shapes (one CUDA graph on a
GPU); draft_service.tree_growth.TreeGrowth is the per-request rule, kept as the
reference (tests/test_draft_tree.py checks it against brute force). Same history,
same budgets: the same nodes, parents, depths, in the same order, with the same scores.
"""

from __future__ import annotations

import random

import pytest
import torch

import draft_service.engine as draft_engine
from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from kernels.topk import top_k_ranked_reference
from kernels.tree_metadata import SEQ_INFO_FIELDS
from tests.tiny_draft import make_tiny_eagle3

BUDGETS = [DraftBudget(5, 4, 8), DraftBudget(3, 1, 4), DraftBudget(6, 8, 16), DraftBudget(2, 3, 30),
           DraftBudget(1, 4, 3)]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    target = tiny_llama("gqa")
    return target, make_tiny_eagle3(tmp_path_factory.mktemp("dev") / "d", target, draft_vocab_size=40, seed=31)


def drafted(model: Eagle3Draft, on_device: bool, monkeypatch, fused_levels: bool = False,
            budgets: list[DraftBudget] = BUDGETS, engines: list | None = None) -> list:
    grows_on_device = (lambda budget: not budget.empty) if on_device else (lambda budget: False)
    monkeypatch.setattr(draft_engine, "fits", grows_on_device)
    engine = DraftEngine(model, num_blocks=96, block_size=4, fused_levels=fused_levels)
    if engines is not None:
        engines.append(engine)
    rng = random.Random(7)
    for i in range(6):
        n = rng.randint(2, 19)
        gen = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, model.cfg.target_vocab_size, (n + 1,), generator=gen).tolist()
        feats = torch.randn(n, model.cfg.feature_width, generator=gen)
        engine.ingest([IngestItem(f"r{i}", 0, tuple(tokens), feats)], catch_up=True)
    items = [DraftItem(f"r{i}", budgets[i % len(budgets)]) for i in range(6)]
    return engine.draft(items)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend,fused_levels", [("torch", False), ("triton", False), ("triton", True)])
def test_device_growth_gives_the_host_rules_trees(pair, backend, fused_levels, monkeypatch):
    """On a GPU with triton the device growth replays a captured CUDA graph; fused_levels: each level's
    bookkeeping in one launch (kernels.tree_level)."""
    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend=backend, device=DEVICE)
    host = drafted(model, on_device=False, monkeypatch=monkeypatch)
    device = drafted(model, on_device=True, monkeypatch=monkeypatch, fused_levels=fused_levels)
    assert sum(len(t) for t in host) > 20
    for a, b in zip(host, device, strict=True):
        assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths), a.request_id
        assert b.scores == pytest.approx(a.scores, abs=1e-5) and b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


@pytest.mark.parametrize("backend,fused_levels", [("torch", False), ("triton", True)])
def test_trees_that_differ_only_in_depth_grow_together_and_keep_their_own_depths_nodes(
        pair, backend, fused_levels, monkeypatch):
    """The gateway shortens the trees of requests whose acceptance is poor: one call then holds trees of one
    top-k and size at several depths, grown as one group to the deepest. Each keeps the nodes its own depth
    grows, also where that depth holds fewer nodes than the group keeps (1/4/8: 4 of 7; 2/1/11: 2 of 10)."""
    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend=backend, device=DEVICE)
    budgets = [DraftBudget(5, 4, 8), DraftBudget(10, 1, 11), DraftBudget(2, 4, 8), DraftBudget(2, 1, 11),
               DraftBudget(1, 4, 8), DraftBudget(6, 1, 11)]
    host = drafted(model, on_device=False, monkeypatch=monkeypatch, budgets=budgets)
    engines: list[DraftEngine] = []
    device = drafted(model, on_device=True, monkeypatch=monkeypatch, fused_levels=fused_levels, budgets=budgets,
                     engines=engines)
    assert [len(t) for t in host] == [b.max_nodes for b in budgets] == [7, 10, 7, 2, 4, 6]
    for a, b in zip(host, device, strict=True):
        assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths), a.request_id
        assert b.scores == pytest.approx(a.scores, abs=1e-5) and b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    # One growth per top-k and size, at its deepest.
    assert {shape.budget for shape in engines[0]._growths} == {DraftBudget(5, 4, 8), DraftBudget(10, 1, 11)}


def test_every_growths_depths_start_on_the_16_byte_boundary_that_the_warm_up_compiles_for(pair, monkeypatch):
    """Triton specialises the selection kernel on its depths pointer's alignment, and
    kernels.tree_level.warm_up compiles the aligned variant: a growth whose depths sat off that
    boundary compiled another while a served step waited (0.2 s on an H100)."""
    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend="torch", device=DEVICE)
    engines: list[DraftEngine] = []
    budgets = [DraftBudget(5, 4, 8), DraftBudget(3, 1, 4), DraftBudget(3, 8, 16), DraftBudget(2, 3, 30),
               DraftBudget(4, 1, 6), DraftBudget(7, 2, 12)]
    drafted(model, on_device=True, monkeypatch=monkeypatch, budgets=budgets, engines=engines)
    growths = list(engines[0]._growths.values())
    assert len(growths) >= 5
    for growth in growths:
        assert growth.depths.data_ptr() % 16 == 0, growth.shape
        assert growth.depths.numel() == growth.shape.batch


def test_a_growth_refuses_depths_beyond_its_own():
    from draft_service.device_tree import BatchTreeGrowth, GrowthShape

    growth = BatchTreeGrowth.__new__(BatchTreeGrowth)
    growth.shape = GrowthShape(batch=2, budget=DraftBudget(3, 2, 6))
    with pytest.raises(ValueError, match="depths 1..3"):
        growth.load([], [5], [0], 0, depths=[4])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_growths_inputs_after_calls_of_other_sizes_and_depths_are_those_a_fresh_growth_loads(pair, backend):
    """A growth keeps the layout of its last call in its host buffer and writes only what changed: after
    any sequence of calls, its inputs are those of a growth that never ran another call."""
    from draft_service.device_tree import BatchTreeGrowth, GrowthShape

    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend=backend, device=DEVICE)
    kv = DraftEngine(model, num_blocks=32, block_size=4).kv
    shape = GrowthShape(batch=4, budget=DraftBudget(4, 3, 9))
    kept = BatchTreeGrowth(model, kv, shape, capture=False)
    h = [torch.randn(model.cfg.hidden_size, device=model.device) for _ in range(4)]
    calls = [([7, 9], [1, 2], None), ([8, 10], [2, 1], [2, 4]), ([9, 11], [0, 3], None), ([5], [3], [3]),
             ([12, 13, 14, 15], [0, 1, 2, 3], None), ([6, 7], [2, 1], None), ([3, 4], [2, 1], [1, 1]),
             ([4, 5], [2, 1], [1, 1]), ([5, 6], [2, 1], None)]
    for lengths, rows, depths in calls:
        kept.load(h[: len(lengths)], lengths, rows, kv.block_table.padding_row, depths=depths)
        fresh = BatchTreeGrowth(model, kv, shape, capture=False)
        fresh.load(h[: len(lengths)], lengths, rows, kv.block_table.padding_row, depths=depths)
        assert torch.equal(kept.ints_in.host(), fresh.ints_in.host()), (lengths, depths)
        assert torch.equal(kept.ints, fresh.ints) and torch.equal(kept.root_h, fresh.root_h)
        info = kept.ints[: SEQ_INFO_FIELDS * shape.batch].view(shape.batch, SEQ_INFO_FIELDS)
        n = len(lengths)
        assert info[:n, 0].tolist() == lengths and info[:n, 3].tolist() == rows
        assert info[n:, 3].tolist() == [kv.block_table.padding_row] * (shape.batch - n)
        assert kept.depths.tolist() == (depths or [4] * n) + [4] * (shape.batch - n)


def test_the_top_k_reference_breaks_ties_towards_the_lower_index_like_a_stable_sort():
    rng = random.Random(1)
    for _ in range(200):
        width = rng.randint(1, 12)
        k = rng.randint(1, width)
        values = torch.tensor([float(rng.choice([0, -1, -2, -1e9])) for _ in range(width)]).expand(3, width)
        got_values, got_index = top_k_ranked_reference(values, k)
        want = torch.sort(values, dim=-1, descending=True, stable=True)
        assert torch.equal(got_index, want.indices[:, :k]) and torch.equal(got_values, want.values[:, :k])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fixed_width_catch_up_writes_what_the_eager_catch_up_writes(pair, backend):
    """After a verify each request brings a few positions with features: the fixed-width path
    (one graph on a GPU) leaves the same draft KV and hidden state as the eager one."""
    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend=backend, device=DEVICE)
    engines = {}
    for fixed in (False, True):
        engine = engines[fixed] = DraftEngine(model, num_blocks=96, block_size=4)
        engine.fixed_catch_up = fixed
        calls = []
        for i in range(5):
            gen = torch.Generator().manual_seed(40 + i)
            n = 6 + 3 * i
            tokens = torch.randint(0, model.cfg.target_vocab_size, (n + 1,), generator=gen).tolist()
            engine.ingest([IngestItem(f"r{i}", 0, tuple(tokens), torch.randn(n, model.cfg.feature_width,
                                                                                generator=gen))], catch_up=True)
            more = torch.randint(0, model.cfg.target_vocab_size, (i + 2,), generator=gen).tolist()
            calls.append(IngestItem(f"r{i}", n, (tokens[-1], *more), torch.randn(i + 2, model.cfg.feature_width,
                                                                                  generator=gen)))
        engine.ingest(calls, catch_up=True)  # 2..6 new positions each, all with features
    eager, fixed = engines[False], engines[True]
    assert fixed._catch_ups and not eager._catch_ups
    for i in range(5):
        rid = f"r{i}"
        assert fixed.computed(rid) == eager.computed(rid)
        n = eager.computed(rid)
        for got, want in zip(fixed.kv.read(0, fixed.kv.slots(rid, 0, n)), eager.kv.read(0, eager.kv.slots(rid, 0, n))):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fixed.requests[rid].last_h, eager.requests[rid].last_h, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_wake_up_gap_caught_up_fixed_width_writes_what_the_eager_catch_up_writes(pair, backend):
    """Requests waking from a dormant spell bring runs of tokens without features (short ones, exact one
    position at a time; long ones, an approximate head and an exact tail) and then a step's features: the
    fixed-width path, whose rows take the request's own h where features are missing, leaves the same draft
    KV and hidden state as the eager forwards, and takes over every segment of at most WIDTH positions."""
    from draft_service.catch_up import WIDTH

    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend=backend, device=DEVICE)
    gaps = [1, 3, 7, 8, 12, 30]  # below LONG_GAP, at it, a head within WIDTH, a head beyond it
    engines, replays = {}, {}
    for fixed in (False, True):
        engine = engines[fixed] = DraftEngine(model, num_blocks=128, block_size=4)
        engine.fixed_catch_up = engine.fixed_wake_ups = fixed
        real_fixed = engine._catch_up_fixed
        seen = replays[fixed] = []

        def counting_fixed(batch, real_fixed=real_fixed, seen=seen):
            seen.extend(b - a for _, a, b in batch)
            return real_fixed(batch)

        engine._catch_up_fixed = counting_fixed
        for i, gap in enumerate(gaps):
            gen = torch.Generator().manual_seed(70 + i)
            n = 5 + i
            tokens = torch.randint(0, model.cfg.target_vocab_size, (n + gap + 3,), generator=gen).tolist()
            feats = torch.randn(n + gap + 2, model.cfg.feature_width, generator=gen)
            engine.ingest([IngestItem(f"r{i}", 0, tuple(tokens[:n + 1]), feats[:n])], catch_up=True)
            # The gap's tokens (no features), then a fed step's two positions with features.
            engine.ingest([IngestItem(f"r{i}", n + 1, tuple(tokens[n + 1: n + gap + 1]), None)])
            engine.ingest([IngestItem(f"r{i}", n + gap + 1, tuple(tokens[n + gap + 1:]), feats[n + gap: n + gap + 2])])
        engine.catch_up([f"r{i}" for i in range(len(gaps))])
    eager, fixed = engines[False], engines[True]
    assert not replays[False] and replays[True] and max(replays[True]) <= WIDTH
    for i in range(len(gaps)):
        rid = f"r{i}"
        n = eager.computed(rid)
        assert fixed.computed(rid) == n
        for got, want in zip(fixed.kv.read(0, fixed.kv.slots(rid, 0, n)), eager.kv.read(0, eager.kv.slots(rid, 0, n))):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fixed.requests[rid].last_h, eager.requests[rid].last_h, atol=1e-4, rtol=1e-4)


def test_a_replica_full_of_requests_refuses_more_as_out_of_capacity(pair):
    from draft_service.types import OutOfDraftCapacity

    target, draft = pair
    engine = DraftEngine(Eagle3Draft(draft, target), num_blocks=3, block_size=4)  # room for 3 requests
    engine.ingest([IngestItem(f"r{i}", 0, (1, 2)) for i in range(3)])
    with pytest.raises(OutOfDraftCapacity, match="room for 0 more"):
        engine.ingest([IngestItem("one-too-many", 0, (1, 2))])
    assert "one-too-many" not in engine.requests
    engine.release(["r0"])
    engine.ingest([IngestItem("one-too-many", 0, (1, 2))])


def test_fused_growth_levels_are_taken_only_where_attention_runs_on_triton(pair):
    target, draft = pair
    for backend, fused in (("torch", False), ("triton", True)):
        model = Eagle3Draft(draft, target, attention_backend=backend, device=DEVICE)
        assert DraftEngine(model, num_blocks=8, block_size=4, fused_levels=True).fused_levels is fused
        assert DraftEngine(model, num_blocks=8, block_size=4).fused_levels is fused  # on by default, where it can
        assert DraftEngine(model, num_blocks=8, block_size=4, fused_levels=False).fused_levels is False


def test_prompts_whose_features_pass_through_the_staging_buffer_leave_the_draft_state_of_a_direct_copy(
        pair, monkeypatch):
    """On a GPU an eager catch-up's host feature rows go through a pinned buffer, STAGED_FEATURE_ROWS at a
    time. Here a 5-row buffer on the CPU: prompts of 6-18 positions in chunks of 5 leave the same draft KV and
    hidden state as the rows stacked and projected at once."""
    target, draft = pair
    model = Eagle3Draft(draft, target, attention_backend="torch", device=DEVICE)
    monkeypatch.setattr(draft_engine, "STAGED_FEATURE_ROWS", 5)
    engines = {}
    for staged in (False, True):
        engine = engines[staged] = DraftEngine(model, num_blocks=96, block_size=4)
        engine.stage_host_features = staged
        engine.fixed_catch_up = False  # a joining prompt's catch-up: one eager forward (WIDTH is wider than these)
        prompts = []
        for i in range(3):
            gen = torch.Generator().manual_seed(60 + i)
            n = 6 + 6 * i
            tokens = torch.randint(0, model.cfg.target_vocab_size, (n + 1,), generator=gen).tolist()
            prompts.append(IngestItem(f"r{i}", 0, tuple(tokens), torch.randn(n, model.cfg.feature_width,
                                                                               generator=gen)))
        engine.ingest(prompts, catch_up=True)
    direct, staged = engines[False], engines[True]
    assert staged._feature_stage is not None and direct._feature_stage is None
    for i in range(3):
        rid = f"r{i}"
        n = direct.computed(rid)
        assert staged.computed(rid) == n > 0
        for got, want in zip(staged.kv.read(0, staged.kv.slots(rid, 0, n)),
                             direct.kv.read(0, direct.kv.slots(rid, 0, n))):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(staged.requests[rid].last_h, direct.requests[rid].last_h, atol=0, rtol=0)
