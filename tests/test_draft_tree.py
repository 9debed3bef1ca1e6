"""Tree drafting: invariants on random inputs, and the chosen nodes against brute-force enumeration."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.tree_growth import TreeGrowth
from draft_service.types import DraftBudget, DraftItem, DraftTree, IngestItem
from tandem.tree import validate_tree
from tests.tiny_draft import ReferenceEagle3, make_tiny_eagle3

# --- helpers ---------------------------------------------------------------------------------


def random_table(vocab: int, seed: int, sharpness: float = 2.0):
    """path (tuple of ids) -> log-probs of the next id: a fixed random 'model'."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def lp(path: tuple[int, ...]) -> torch.Tensor:
        if path not in cache:
            gen = torch.Generator().manual_seed(hash((seed, *path)) % (2**31))
            cache[path] = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * sharpness, -1)
        return cache[path]

    return lp


def grow(budget: DraftBudget, lp) -> tuple[TreeGrowth, list[tuple[int, ...]]]:
    """Run TreeGrowth against a table; return it and the path of every selected node."""
    g = TreeGrowth(budget)

    def path(c: int) -> tuple[int, ...]:
        out = []
        while c >= 0:
            out.append(g.tokens[c])
            c = g.parents[c]
        return tuple(reversed(out))

    g.expand(lp(())[None])
    while not g.done:
        g.expand(torch.stack([lp(path(c)) for c in g.frontier]))
    return g, [path(c) for c in g.select()]


def all_paths(vocab: int, depth: int, lp) -> dict[tuple[int, ...], float]:
    scores: dict[tuple[int, ...], float] = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            scores[path] = scores.get(path[:-1], 0.0) + float(lp(path[:-1])[path[-1]])
    return scores


def beam_pool(budget: DraftBudget, scores: dict[tuple[int, ...], float], lp) -> set[tuple[int, ...]]:
    """EAGLE-2's candidate set, stated over paths: each level, top-k children of each frontier
    node; the frontier is the best k of them."""
    k = budget.topk
    frontier, pool = [()], set()
    for _ in range(budget.steps):
        level = [(*f, int(c)) for f in frontier for c in torch.topk(lp(f), k).indices]
        pool.update(level)
        frontier = sorted(level, key=lambda p: -scores[p])[:k]
    return pool


def top(scores: dict[tuple[int, ...], float], candidates, n: int) -> tuple[set, float]:
    """The n best candidates, and the score gap at the cut (how clear the answer is)."""
    ranked = sorted(candidates, key=lambda p: -scores[p])
    gap = scores[ranked[n - 1]] - scores[ranked[n]] if n < len(ranked) else float("inf")
    return set(ranked[:n]), gap


def check_invariants(tree: DraftTree, budget: DraftBudget) -> None:
    n = len(tree)
    assert len(tree.parents) == len(tree.depths) == len(tree.logprobs) == len(tree.scores) == n
    assert n <= max(budget.num_draft_tokens - 1, 0)
    for i, p in enumerate(tree.parents):
        assert -1 <= p < i, "parents precede children"
        ancestors, a = 0, p
        while a >= 0:
            ancestors, a = ancestors + 1, tree.parents[a]
        assert tree.depths[i] == ancestors + 1, "depth = number of ancestors (the root included)"
        assert tree.depths[i] <= budget.steps
        assert tree.logprobs[i] <= 0
        parent_score = tree.scores[p] if p >= 0 else 0.0
        assert tree.scores[i] == pytest.approx(parent_score + tree.logprobs[i], abs=1e-5)
        assert tree.scores[i] <= parent_score + 1e-6
    siblings: dict[int, list[int]] = {}
    for tok, p in zip(tree.tokens, tree.parents):
        siblings.setdefault(p, []).append(tok)
    for kids in siblings.values():
        assert len(kids) == len(set(kids)), "no duplicate siblings"
        assert len(kids) <= budget.topk
    tokens, parents, num_fixed = tree.verify_tree()
    assert validate_tree(parents, num_fixed) is None
    assert tokens[0] == tree.root_token


# --- the growth rule on random tables ------------------------------------------------------------

def test_selected_nodes_are_the_global_top_n_when_n_fits_the_beam():
    """With num_draft_tokens - 1 <= topk the beam loses nothing: EAGLE-2's tree is exactly the
    best N paths of all vocab^1 + ... + vocab^steps, found by enumeration."""
    rng = random.Random(0)
    checked = 0
    for trial in range(150):
        vocab, steps = rng.randint(2, 6), rng.randint(1, 4)
        topk = rng.randint(1, vocab)
        budget = DraftBudget(steps, topk, rng.randint(2, topk + 1))
        lp = random_table(vocab, seed=trial)
        scores = all_paths(vocab, steps, lp)
        want, gap = top(scores, scores, budget.num_draft_tokens - 1)
        if gap < 1e-9:
            continue
        _, chosen = grow(budget, lp)
        assert set(chosen) == want, (trial, budget)
        assert len(chosen) == len(want)
        checked += 1
    assert checked > 120


def test_selected_nodes_are_the_top_n_of_the_beam_candidates():
    """Any budget: the best N (by cumulative log-prob) of every candidate the levels looked at."""
    rng = random.Random(1)
    for trial in range(150):
        vocab, steps = rng.randint(2, 6), rng.randint(1, 4)
        budget = DraftBudget(steps, rng.randint(1, vocab), rng.randint(0, 40))
        lp = random_table(vocab, seed=1000 + trial)
        g, chosen = grow(budget, lp)
        if budget.empty:
            assert chosen == []
            continue
        scores = all_paths(vocab, steps, lp)
        pool = beam_pool(budget, scores, lp)
        assert len(pool) == len(g.tokens)
        n = min(budget.num_draft_tokens - 1, len(pool))
        want, gap = top(scores, pool, n)
        if gap > 1e-9:
            assert set(chosen) == want, (trial, budget)
        assert len(chosen) == n == budget.max_nodes
        # Parents before children, and every chosen node's parent chosen.
        assert all(p[:-1] in chosen[:i] for i, p in enumerate(chosen) if len(p) > 1)


def test_ties_are_broken_deterministically_towards_parents():
    # Every child certain (log-prob exactly 0 for id 0): parent and child scores tie.
    certain = torch.tensor([0.0, -1e9, -1e9], dtype=torch.float64)
    budget = DraftBudget(steps=4, topk=2, num_draft_tokens=4)
    g, chosen = grow(budget, lambda path: certain)
    assert chosen == [(0,), (0, 0), (0, 0, 0)]
    # Uniform distributions: everything at a level ties; the earlier candidate wins, the same each run.
    uniform = torch.full((3,), -torch.log(torch.tensor(3.0, dtype=torch.float64)))
    budget = DraftBudget(steps=3, topk=3, num_draft_tokens=8)
    runs = [grow(budget, lambda path: uniform)[1] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] == [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0)]


@pytest.mark.parametrize("budget", [DraftBudget(0, 4, 8), DraftBudget(5, 0, 8), DraftBudget(5, 4, 1),
                                    DraftBudget(5, 4, 0), DraftBudget()])
def test_zero_budget_means_no_tree(budget):
    assert budget.empty and budget.max_nodes == 0
    assert grow(budget, random_table(4, 0))[1] == []


# --- the engine's trees -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama("gqa")


@pytest.fixture(scope="module")
def small_vocab_draft(target, tmp_path_factory):
    return make_tiny_eagle3(tmp_path_factory.mktemp("d6") / "d", target, draft_vocab_size=6, seed=11)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    return make_tiny_eagle3(tmp_path_factory.mktemp("d24") / "d", target, draft_vocab_size=24, seed=12)


def ingest_history(engine: DraftEngine, rid: str, n: int, seed: int, feature_share: float = 1.0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, engine.model.cfg.target_vocab_size, (n + 1,), generator=gen).tolist()
    feats = torch.randn(n, engine.model.cfg.feature_width, generator=gen)
    rng = random.Random(seed)
    for p in range(n + 1):  # one token per ingest; some without features
        has = p < n and rng.random() < feature_share
        engine.ingest([IngestItem(rid, p, (tokens[p],), feats[p:p + 1] if has else None)])
    return tokens


@pytest.mark.parametrize("steps, topk, num_draft_tokens", [(3, 5, 6), (4, 4, 5), (3, 3, 3)])
def test_engine_tree_is_the_brute_force_top_n(target, small_vocab_draft, steps, topk, num_draft_tokens):
    """On a 6-token draft vocabulary, every path up to `steps` deep is scored by the reference
    model (each node seeing the prefix and its ancestors only); the engine keeps the best N."""
    ref = ReferenceEagle3(small_vocab_draft, target)
    engine = DraftEngine(Eagle3Draft(small_vocab_draft, target), num_blocks=16, block_size=4)
    tokens = ingest_history(engine, "r", 7, seed=steps * 10 + topk)
    feats = [engine.requests["r"].features.row(p) for p in range(7)]
    budget = DraftBudget(steps, topk, num_draft_tokens)
    tree = engine.draft([DraftItem("r", budget)])[0]

    ks, vs, hs, lps = ref.prefill(tokens, feats)
    scores = ref.path_scores(ks, vs, hs[-1], lps[-1], steps)
    want, gap = top(scores, scores, num_draft_tokens - 1)
    assert gap > 1e-4, "pick a seed whose answer is clear"
    inverse = {t: d for d, t in enumerate(ref.hot)}
    paths = []
    for i in range(len(tree)):
        parent = tree.parents[i]
        paths.append((*(paths[parent] if parent >= 0 else ()), inverse[tree.tokens[i]]))
        assert tree.scores[i] == pytest.approx(scores[paths[-1]], abs=1e-5)
    assert set(paths) == want
    check_invariants(tree, budget)


def test_engine_trees_keep_invariants_on_random_batches(target, draft):
    engine = DraftEngine(Eagle3Draft(draft, target), num_blocks=64, block_size=4)
    rng = random.Random(3)
    for rid in range(6):
        ingest_history(engine, f"r{rid}", rng.randint(1, 14), seed=rid, feature_share=rng.random())
    for _ in range(5):
        items = [DraftItem(f"r{rid}", DraftBudget(rng.randint(0, 5), rng.randint(0, 6), rng.randint(0, 30)))
                 for rid in range(6)]
        trees = engine.draft(items)
        for it, tree in zip(items, trees):
            check_invariants(tree, it.budget)
            assert len(tree) == it.budget.max_nodes
            assert set(tree.tokens) <= set(engine.target_ids)
            assert tree.root_token == engine.requests[it.request_id].tokens[-1]
            assert tree.root_position == len(engine.requests[it.request_id].tokens) - 1


def test_batched_trees_equal_trees_drafted_alone(target, draft):
    """Requests drafted in one call get the trees they would get alone (different budgets, lengths)."""
    model = Eagle3Draft(draft, target)
    budgets = [DraftBudget(5, 4, 8), DraftBudget(2, 6, 20), DraftBudget(0, 4, 8), DraftBudget(6, 2, 9)]
    together = DraftEngine(model, num_blocks=64, block_size=4)
    for i in range(4):
        ingest_history(together, f"r{i}", 3 + 4 * i, seed=50 + i, feature_share=0.7)
    trees = together.draft([DraftItem(f"r{i}", b) for i, b in enumerate(budgets)])
    for i, b in enumerate(budgets):
        alone = DraftEngine(model, num_blocks=64, block_size=4)
        ingest_history(alone, f"r{i}", 3 + 4 * i, seed=50 + i, feature_share=0.7)
        tree = alone.draft([DraftItem(f"r{i}", b)])[0]
        assert (tree.tokens, tree.parents, tree.depths) == (trees[i].tokens, trees[i].parents, trees[i].depths)
        assert tree.scores == pytest.approx(trees[i].scores, abs=1e-5)


def test_request_with_one_known_token_gets_an_empty_tree(target, draft):
    engine = DraftEngine(Eagle3Draft(draft, target), num_blocks=8)
    engine.ingest([IngestItem("one", 0, (7,))])
    tree = engine.draft([DraftItem("one", DraftBudget(5, 4, 8))])[0]
    assert len(tree) == 0 and tree.root_token == 7 and tree.root_position == 0
