"""A growth level's bookkeeping in one launch equals the torch rule it replaces, ties included.

Runs interpreted on a CPU (tests/conftest.py sets TRITON_INTERPRET=1) and compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kernels.topk import top_k_ranked_reference
from kernels.tree_level import (
    Candidates,
    grow_level_reference,
    grow_level_triton,
    select_reference,
    select_triton,
    warm_up,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def level_case(batch: int, k: int, runs: int, run: int, seed: int):
    """A growth of `runs` runs part-way: candidates up to run `run`'s, its frontier, its children."""
    gen = torch.Generator().manual_seed(seed)
    C = k + runs * k * k
    created = k + run * k * k
    vocab = 50
    cand = Candidates(torch.randint(0, vocab, (batch, C), generator=gen),
                      torch.randint(-1, C, (batch, C), generator=gen),
                      torch.randint(0, runs, (batch, C), generator=gen), torch.randn(batch, C, generator=gen),
                      # Few distinct scores: most of the choice is made by ties between children.
                      torch.tensor([-1.0, -2.0, -0.5])[torch.randint(0, 3, (batch, C), generator=gen)].double())
    lo = 0 if run == 0 else created - k * k
    frontier = torch.stack([lo + torch.randperm(created - lo, generator=gen)[:k].sort().values
                            for _ in range(batch)])
    child_lp = torch.tensor([0.0, -0.25, -1.0, float("-inf")])[torch.randint(0, 4, (batch * k, k), generator=gen)]
    child_ids = torch.randint(0, vocab, (batch * k, k), generator=gen)
    d2t = torch.randperm(1000, generator=gen)[:vocab]
    lengths = torch.randint(1, 500, (batch,), generator=gen)
    words = torch.randint(0, 2**40, (batch, max(1, runs * k)), generator=gen)
    return cand, frontier, child_lp, child_ids, created, d2t, lengths, words


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_one_launch_records_the_children_and_picks_the_frontier_the_torch_rule_picks(k):
    runs = 3 if k <= 4 else 2
    for run in range(runs):
        for seed in range(3):
            case = level_case(3, k, runs, run, seed=100 * k + 10 * run + seed)
            cand, frontier, child_lp, child_ids, created, d2t, lengths, words = case
            has_next = run + 1 < runs
            want_cand, want_words = Candidates(*(t.clone() for t in cand)), words.clone()
            want = grow_level_reference(want_cand, frontier, child_lp, child_ids, created, run, d2t, lengths,
                                        want_words, has_next)
            got_cand = Candidates(*(t.clone().to(DEVICE) for t in cand))
            got_words = words.clone().to(DEVICE)
            got = grow_level_triton(got_cand, frontier.to(DEVICE), child_lp.to(DEVICE), child_ids.to(DEVICE),
                                    created, run, d2t.to(DEVICE), lengths.to(DEVICE), got_words, has_next)
            for name, a, b in zip(want._fields, want, got, strict=True):
                assert torch.equal(a, b.cpu()), (k, run, seed, name)
            for name, a, b in zip(Candidates._fields, want_cand, got_cand, strict=True):
                assert torch.equal(a, b.cpu()), (k, run, seed, name)  # the scores bitwise: float64 sums alike
            assert torch.equal(want_words, got_words.cpu()), (k, run, seed)
            if not has_next:  # the last run writes no words
                assert torch.equal(got_words.cpu(), words)


def test_the_next_frontier_is_in_creation_order_and_ties_go_to_the_earlier_child():
    # One request, k = 2, every child scoring alike: the first two children win, in order.
    cand = Candidates(torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long),
                      torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6), torch.zeros(1, 6, dtype=torch.float64))
    frontier = torch.tensor([[0, 1]])
    child_lp = torch.full((2, 2), -1.0)
    child_ids = torch.tensor([[7, 8], [9, 10]])
    words = torch.tensor([[1, 2, 0, 0]], device=DEVICE)
    got = grow_level_triton(Candidates(*(t.to(DEVICE) for t in cand)), frontier.to(DEVICE), child_lp.to(DEVICE),
                            child_ids.to(DEVICE), 2, 0, torch.arange(100, 111, device=DEVICE),
                            torch.tensor([40], device=DEVICE), words, True)
    assert got.frontier.tolist() == [[2, 3]] and got.parent.tolist() == [[0, 0]]
    assert got.token.tolist() == [[107, 108]] and got.positions.tolist() == [[41, 41]]
    assert words.tolist() == [[1, 2, 1 | 4, 1 | 8]]  # the parent's word plus each node's own bit


def test_warm_up_compiles_one_variant_per_block_of_lanes():
    # The selection: blocks of 16, 32, 64 and 128 candidates (up to 5/4/8's 68); a level: 16 lanes
    # (k <= 4), 32 (k = 5), 64 (k = 6..8).
    assert warm_up(DEVICE, 8, 68) == 4 + 3
    assert warm_up(DEVICE, 1, 5) == 1 + 1


@pytest.mark.parametrize("k,runs,kept", [(1, 3, 4), (4, 4, 8), (8, 5, 16), (3, 1, 2), (2, 3, 12)])
def test_one_launch_keeps_the_nodes_the_torch_rule_keeps(k, runs, kept):
    for seed in range(3):
        gen = torch.Generator().manual_seed(1000 * k + seed)
        C, batch = k + runs * k * k, 3
        # A grown tree's candidates: level 0's children of the root, then each run's k*k children of k
        # parents among the run before's, scores their parents' plus a log-prob from few values (ties).
        parent = torch.full((batch, C), -1)
        level = torch.zeros(batch, C, dtype=torch.long)
        lp = torch.tensor([0.0, -0.5, -2.0])[torch.randint(0, 3, (batch, C), generator=gen)]
        score = lp.double().clone()
        for run in range(runs):
            lo = 0 if run == 0 else k + (run - 1) * k * k
            hi = k + run * k * k
            for b in range(batch):
                parents = lo + torch.randperm(hi - lo, generator=gen)[:k].sort().values
                for i, node in enumerate(range(hi, hi + k * k)):
                    parent[b, node] = parents[i // k]
                    level[b, node] = run + 1
                    score[b, node] = score[b, parents[i // k]] + lp[b, node].double()
        cand = Candidates(torch.randint(0, 50, (batch, C), generator=gen), parent, level, lp, score)
        d2t = torch.randperm(1000, generator=gen)[:50]
        want = torch.zeros(batch, 5 * kept, dtype=torch.int32)
        select_reference(cand, kept, d2t, want, top_k=top_k_ranked_reference)
        got = torch.zeros(batch, 5 * kept, dtype=torch.int32, device=DEVICE)
        select_triton(Candidates(*(t.to(DEVICE) for t in cand)), kept, d2t.to(DEVICE), got)
        assert torch.equal(want, got.cpu()), (k, runs, kept, seed)
        assert bool((want.view(batch, 5, kept)[:, 1] < torch.arange(kept)).all())  # parents come first
        # Each request at a depth of its own (device_tree's shallower trees in a deeper group).
        depths = torch.randint(1, runs + 2, (batch,), generator=gen, dtype=torch.int32)
        select_reference(cand, kept, d2t, want, top_k=top_k_ranked_reference, depths=depths)
        select_triton(Candidates(*(t.to(DEVICE) for t in cand)), kept, d2t.to(DEVICE), got, depths.to(DEVICE))
        assert torch.equal(want, got.cpu()), (k, runs, kept, seed, depths)
        levels = want.view(batch, 5, kept)[:, 2]  # depths from 1
        own = [min(kept, k + (int(d) - 1) * k * k) for d in depths]  # the candidates above each one's depth
        assert all(bool((levels[b, :n] <= depths[b]).all()) for b, n in enumerate(own))
