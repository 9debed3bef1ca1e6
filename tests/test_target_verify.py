"""Tree verification: acceptance rules, committed KV, sampling distribution, release."""

from __future__ import annotations

import random
import re

import pytest
import torch
from scipy.stats import chi2_contingency

import target_service.acceptance as acceptance
from tandem.tree import validate_tree
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.step_batch import StepBatch
from target_service.types import InvalidStep, SamplingParams, SequenceStep
from tests.tiny_models import make_tiny_llama

PROMPT = [7, 3, 21, 40, 11, 9]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return LlamaModel(tiny_llama("gqa"))


def new_engine(model, blocks=64) -> TargetEngine:
    return TargetEngine(model, num_blocks=blocks, block_size=4)


def greedy_plain(engine, rid, prompt, n) -> list[int]:
    out = engine.step([SequenceStep.chain(rid, prompt, create=True)])[0].tokens
    while len(out) < n:
        out += engine.step([SequenceStep.chain(rid, [out[-1]])])[0].tokens
    return out[:n]


def committed_kv(engine, rid):
    n = engine.kv.seqs[rid].length
    slots = engine.kv.slots(rid, 0, n)
    return [engine.kv.read(layer, slots) for layer in range(len(engine.kv.k))]


def tree_with_path(pending: int, path: list[int], distractors: dict[int, list[int]]):
    """Fixed node `pending`, then a chain `path` where node at depth d (1-based) also
    gets sibling tokens `distractors[d]` placed before it (so the walk must skip them)."""
    tokens, parents = [pending], [-1]
    parent = 0
    for depth, tok in enumerate(path, start=1):
        for other in distractors.get(depth, []):
            tokens.append(other)
            parents.append(parent)
        tokens.append(tok)
        parents.append(parent)
        parent = len(tokens) - 1
        # a dead branch below each sibling, to exercise ancestor masking
        for other_idx in range(len(tokens) - 1 - len(distractors.get(depth, [])), len(tokens) - 1):
            tokens.append((tok + 5) % 101)
            parents.append(other_idx)
    return tokens, parents


def test_tree_with_own_greedy_continuation_is_fully_accepted(model):
    ref = greedy_plain(new_engine(model), "ref", PROMPT, 12)
    engine = new_engine(model)
    first = engine.step([SequenceStep.chain("t", PROMPT, create=True)])[0].tokens[0]
    assert first == ref[0]
    path = ref[1:7]
    vocab = model.cfg.vocab_size
    distract = {d: [(path[d - 1] + 1) % vocab, (path[d - 1] + 2) % vocab] for d in range(1, 7)}
    tokens, parents = tree_with_path(first, path, distract)
    r = engine.step([SequenceStep("t", tuple(tokens), tuple(parents), num_fixed=1)])[0]
    assert [tokens[i] for i in r.accepted_nodes] == path
    assert r.tokens == ref[1:8]  # the whole path plus the bonus token
    assert r.num_committed == len(PROMPT) + 7
    # The committed KV equals decoding those tokens one by one.
    plain = new_engine(model)
    greedy_plain(plain, "t", PROMPT, 8)
    for (k1, v1), (k2, v2) in zip(committed_kv(engine, "t"), committed_kv(plain, "t"), strict=True):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=0)


@pytest.mark.parametrize("wrong_depth", [1, 3, 5])
def test_wrong_child_at_depth_d_accepts_d_tokens_plus_bonus(model, wrong_depth):
    ref = greedy_plain(new_engine(model), "ref", PROMPT, 10)
    engine = new_engine(model)
    first = engine.step([SequenceStep.chain("w", PROMPT, create=True)])[0].tokens[0]
    path = list(ref[1:7])
    path[wrong_depth - 1] = (path[wrong_depth - 1] + 1) % model.cfg.vocab_size
    tokens, parents = tree_with_path(first, path, {})
    r = engine.step([SequenceStep("w", tuple(tokens), tuple(parents), num_fixed=1)])[0]
    accepted = wrong_depth - 1
    assert len(r.accepted_nodes) == accepted
    assert r.tokens == ref[1:1 + accepted + 1]
    # Continuing by plain decode gives the same text as never speculating.
    out = [first] + r.tokens
    while len(out) < 10:
        out += engine.step([SequenceStep.chain("w", [out[-1]])])[0].tokens
    assert out[:10] == ref
    plain = new_engine(model)
    greedy_plain(plain, "w", PROMPT, 10)
    assert engine.kv.seqs["w"].length == plain.kv.seqs["w"].length
    for (k1, _), (k2, _) in zip(committed_kv(engine, "w"), committed_kv(plain, "w"), strict=True):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)


def test_batched_mixed_step_equals_separate_steps(model):
    """Prefill, plain decode and verification in one step give what each gives alone."""
    ref = greedy_plain(new_engine(model), "ref", PROMPT, 6)
    engine = new_engine(model)
    first = engine.step([SequenceStep.chain("v", PROMPT, create=True)])[0].tokens[0]
    engine.step([SequenceStep.chain("d", [1, 2, 3], create=True)])
    tokens, parents = tree_with_path(first, ref[1:4], {2: [0]})
    results = engine.step([
        SequenceStep.chain("p", PROMPT, create=True),
        SequenceStep("v", tuple(tokens), tuple(parents), num_fixed=1),
        SequenceStep.chain("d", [4]),
    ])
    assert results[0].tokens == [ref[0]]
    assert results[1].tokens == ref[1:5]
    alone = new_engine(model)
    alone.step([SequenceStep.chain("d", [1, 2, 3], create=True)])
    assert results[2].tokens == alone.step([SequenceStep.chain("d", [4])])[0].tokens


def test_release_returns_cache_to_zero(model):
    engine = new_engine(model)
    engine.step([SequenceStep.chain(f"r{i}", PROMPT * (i + 1), create=True) for i in range(4)])
    assert engine.kv.used_blocks > 0
    assert engine.release(["r0", "r1", "r2", "r3", "never-existed"]) == 4
    assert engine.kv.used_blocks == 0 and engine.load().num_sequences == 0


# --- sampling keeps the target distribution ------------------------------

TINY_VOCAB = 6


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    d = make_tiny_llama(tmp_path_factory.mktemp("v6") / "m", "gqa", vocab_size=TINY_VOCAB, seed=3)
    return LlamaModel(d)


def sample_two_tokens(model, speculate: bool, trials: int, seed0: int) -> list[tuple[int, int]]:
    """Sample (t1, t2) after a fixed prompt for many seeded sequences in one batched step."""
    engine = TargetEngine(model, num_blocks=trials * 3, block_size=4)
    sp = lambda i: SamplingParams(temperature=1.0, top_k=5, top_p=0.95, seed=seed0 + i)  # noqa: E731
    firsts = engine.step([SequenceStep.chain(f"s{i}", [1, 2, 3], create=True, sampling=sp(i))
                          for i in range(trials)])
    if speculate:
        # Two candidate children (tokens 0 and 1) each with two grandchildren.
        tree = lambda t: (t, 0, 2, 3, 1, 4, 0)  # noqa: E731
        parents = (-1, 0, 1, 1, 0, 4, 4)
        items = [SequenceStep(f"s{i}", tree(r.tokens[0]), parents, 1, sampling=sp(i))
                 for i, r in enumerate(firsts)]
    else:
        items = [SequenceStep.chain(f"s{i}", [r.tokens[0]], sampling=sp(i)) for i, r in enumerate(firsts)]
    second = engine.step(items)
    return [(f.tokens[0], s.tokens[0]) for f, s in zip(firsts, second, strict=True)]


def contingency_p(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> float:
    cells = sorted(set(a) | set(b))
    table = [[a.count(c) for c in cells], [b.count(c) for c in cells]]
    keep = [j for j in range(len(cells)) if table[0][j] + table[1][j] >= 5]  # chi-square validity
    return float(chi2_contingency([[row[j] for j in keep] for row in table]).pvalue)


TRIALS = 2000


@pytest.fixture(scope="module")
def plain_samples(tiny_vocab_model):
    return sample_two_tokens(tiny_vocab_model, False, TRIALS, seed0=0)


def test_speculative_sampling_keeps_the_target_distribution(tiny_vocab_model, plain_samples):
    spec = sample_two_tokens(tiny_vocab_model, True, TRIALS, seed0=10_000)
    assert contingency_p(plain_samples, spec) > 0.001


def test_a_broken_acceptance_rule_is_caught(tiny_vocab_model, plain_samples, monkeypatch):
    # Accepting with probability sqrt(p) over-accepts drafted tokens.
    monkeypatch.setattr(acceptance, "accept_child_rule", lambda p_x, u: u < p_x ** 0.5)
    spec = sample_two_tokens(tiny_vocab_model, True, TRIALS, seed0=10_000)
    assert contingency_p(plain_samples, spec) < 1e-6


def test_seeded_sampling_is_reproducible_across_chunking(model):
    sp = SamplingParams(temperature=0.8, seed=42)
    a = new_engine(model)
    out_a = a.step([SequenceStep.chain("x", PROMPT, create=True, sampling=sp)])[0].tokens
    b = new_engine(model)
    b.step([SequenceStep.chain("x", PROMPT[:4], create=True, sampling=sp)])
    out_b = b.step([SequenceStep.chain("x", PROMPT[4:], sampling=sp)])[0].tokens
    assert out_a == out_b


@pytest.mark.parametrize("pick_bytes", [0, 1 << 20], ids=["moved on the device", "picked on the host"])
def test_a_verify_steps_features_are_those_of_its_committed_positions_and_of_no_rejected_node(model, pick_bytes):
    """Features come back for the committed rows only, fixed first and then the accepted nodes in order,
    items that did not ask give none, and each row is the one a prefill of the committed tokens computes
    for that position (float32, CPU). A tree with siblings before each accepted node and a wrong child at
    depth 3 makes row order and node order differ. Both ways of taking the rows (TargetEngine.feature_pick_bytes)."""
    ref = greedy_plain(new_engine(model), "ref", PROMPT, 8)
    engine = new_engine(model)
    engine.feature_pick_bytes = pick_bytes
    first = engine.step([SequenceStep.chain("f", PROMPT, create=True)])[0].tokens[0]
    engine.step([SequenceStep.chain("quiet", [1, 2, 3], create=True)])
    path = list(ref[1:6])
    path[2] = (path[2] + 1) % model.cfg.vocab_size
    vocab = model.cfg.vocab_size
    tokens, parents = tree_with_path(first, path, {d: [(path[d - 1] + 3) % vocab] for d in (1, 2, 3)})
    verify, quiet = engine.step([SequenceStep("f", tuple(tokens), tuple(parents), num_fixed=1, return_features=True),
                                 SequenceStep.chain("quiet", [4])])
    assert [tokens[i] for i in verify.accepted_nodes] == ref[1:3] and quiet.features is None
    committed = PROMPT + [first] + ref[1:3]
    assert verify.num_committed == len(committed) and verify.features.shape[0] == 3  # the root and 2 nodes
    # A plain step beside an item that does not ask: only the asking item's row comes back.
    quiet, plain_step = engine.step([SequenceStep.chain("quiet", quiet.tokens),
                                     SequenceStep.chain("f", verify.tokens[-1:], return_features=True)])
    assert quiet.features is None and plain_step.features.shape[0] == 1
    fresh = new_engine(model)
    [whole] = fresh.step([SequenceStep.chain("f", committed + verify.tokens[-1:], create=True, return_features=True)])
    torch.testing.assert_close(verify.features, whole.features[len(PROMPT): len(committed)], atol=1e-5, rtol=0)
    torch.testing.assert_close(plain_step.features, whole.features[len(committed):], atol=1e-5, rtol=0)


def test_the_feature_pick_threshold_comes_from_the_targets_flag_and_a_negative_one_is_refused(tiny_llama):
    """`tandem target --feature-pick-kib` reaches the engine through EngineSpec; below zero it is refused at
    each layer with a message, not a stack trace."""
    from target_service.model import ParallelSpec
    from target_service.parallel import EngineSpec, build_engine
    from target_service.server import main

    engine = build_engine(EngineSpec(model_dir=str(tiny_llama("gqa")), num_blocks=8, block_size=4,
                                     feature_pick_bytes=123 << 10), ParallelSpec())
    assert engine.feature_pick_bytes == 123 << 10
    with pytest.raises(ValueError, match="feature_pick_bytes must be >= 0"):
        EngineSpec(model_dir="m", feature_pick_bytes=-1)
    with pytest.raises(ValueError, match="feature_pick_bytes must be >= 0"):
        TargetEngine(engine.model, num_blocks=8, feature_pick_bytes=-1)
    with pytest.raises(SystemExit, match="error: --feature-pick-kib must be >= 0"):
        main(["--model", "no-such-model", "--port", "0", "--feature-pick-kib", "-1"])


def test_negative_token_ids_and_top_logprobs_out_of_range_are_refused_by_name(model):
    engine = new_engine(model)
    engine.step([SequenceStep.chain("a", PROMPT, create=True)])
    with pytest.raises(InvalidStep, match=r"request 'a': token id -1 out of range \[0, "):
        engine.step([SequenceStep.chain("a", [-1])])
    for asked in (-1, 21):
        with pytest.raises(InvalidStep, match=r"request 'a': top_logprobs must be in 0\.\.20"):
            engine.step([SequenceStep.chain("a", [5], top_logprobs=asked)])
    assert engine.length("a") == len(PROMPT)


@pytest.mark.parametrize("small_step", [8, 0], ids=["python-numbers", "numpy-reductions"])
def test_bad_sampling_fields_are_refused_by_the_item_that_has_them_and_change_nothing(model, small_step,
                                                                                     monkeypatch):
    """The sampling check reads a small step's columns as Python numbers and a larger one's as five
    reductions (SMALL_STEP), and builds the naming masks only when they fail: a NaN or a negative value
    in any item's column is still found and named, either way."""
    import target_service.engine as engine_module
    from target_service.types import SamplingParams
    monkeypatch.setattr(engine_module, "SMALL_STEP", small_step)
    engine = new_engine(model)
    engine.step([SequenceStep.chain("a", PROMPT, create=True), SequenceStep.chain("b", PROMPT, create=True)])
    cases = {"temperature must be >= 0": SamplingParams(temperature=-0.5),
             "temperature must be >= 0, got nan": SamplingParams(temperature=float("nan")),
             "top_k must be >= 0": SamplingParams(temperature=1.0, top_k=-2),
             "top_p must be a number": SamplingParams(temperature=1.0, top_p=float("nan"))}
    for message, bad in cases.items():
        with pytest.raises(InvalidStep, match=rf"request 'b': {message}"):
            engine.step([SequenceStep.chain("a", [5]), SequenceStep.chain("b", [6], sampling=bad)])
    assert engine.length("a") == engine.length("b") == len(PROMPT)


@pytest.mark.parametrize("small_step", [8, 0], ids=["python-numbers", "numpy-reductions"])
def test_steps_of_one_row_per_item_that_are_not_plain_decode_are_refused_by_the_malformed_items_name(
        model, small_step, monkeypatch):
    """Plain decode is checked in one pass (a small step's columns as Python numbers, a larger one's by
    numpy, SMALL_STEP); a step with as many rows as items that fails it (two nodes beside none, a root
    whose parent is not -1, two fixed nodes in one) is named."""
    import target_service.engine as engine_module
    monkeypatch.setattr(engine_module, "SMALL_STEP", small_step)
    engine = new_engine(model)
    engine.step([SequenceStep.chain("a", PROMPT, create=True), SequenceStep.chain("b", PROMPT, create=True)])
    cases = {
        "request 'b': empty tree": [
            SequenceStep("a", (5, 6), (-1, 0), num_fixed=1), SequenceStep("b", (), (), num_fixed=1)],
        "request 'b': node 0 must have parent -1, got 0": [
            SequenceStep.chain("a", [5]), SequenceStep("b", (5,), (0,), num_fixed=1)],
        "request 'a': num_fixed must be between 1 and the number of nodes (1), got 2": [
            SequenceStep("a", (5,), (-1,), num_fixed=2), SequenceStep.chain("b", [5])],
    }
    for message, items in cases.items():
        with pytest.raises(InvalidStep, match=re.escape(message)):
            engine.step(items)
    assert engine.length("a") == engine.length("b") == len(PROMPT)


def test_steps_after_one_that_outgrows_the_input_buffer_decode_as_a_fresh_engine_does(model):
    """The engine keeps its input views per shape; a step too large for the buffer replaces it,
    and the views of the old one must not be used again."""
    fresh = new_engine(model, blocks=1024)
    expected = greedy_plain(fresh, "x", PROMPT, 12)
    engine = new_engine(model, blocks=1024)
    out = engine.step([SequenceStep.chain("x", PROMPT, create=True)])[0].tokens
    out += engine.step([SequenceStep.chain("x", [out[-1]])])[0].tokens
    big = [SequenceStep.chain(f"big{i}", [(i + t) % 90 + 1 for t in range(60)], create=True) for i in range(48)]
    before = engine._host_buf.numel()
    engine.step(big)
    assert engine._host_buf.numel() > before, "the big step did not outgrow the input buffer"
    while len(out) < 12:
        out += engine.step([SequenceStep.chain("x", [out[-1]])])[0].tokens
    assert out[:12] == expected


def test_a_step_is_refused_exactly_when_one_of_its_trees_is_malformed_and_by_that_items_name():
    """Verify steps (one fixed node each) are accepted by a shortcut (each tree checked once per
    shape); against tandem.tree.validate_tree on random trees, some broken, with chains among them."""
    rng = random.Random(11)
    refused = 0
    for _ in range(300):
        items = []
        for b in range(rng.randint(1, 4)):
            n = rng.randint(1, 9)
            parents = [-1] + [rng.randrange(i) for i in range(1, n)]
            num_fixed = 1 if rng.random() < 0.8 else rng.randint(1, n)
            if num_fixed > 1:
                parents[1:num_fixed] = range(num_fixed - 1)
            if rng.random() < 0.15:  # break one parent (or the root's)
                parents[rng.randrange(n)] = rng.randint(-2, n)
            items.append(SequenceStep(f"s{b}", tuple(range(n)), tuple(parents), num_fixed))
        bad = next((it for it in items if validate_tree(it.parents, it.num_fixed)), None)
        batch = StepBatch.from_items(items)
        if bad is None:
            TargetEngine._check_trees(batch)
        else:
            refused += 1
            with pytest.raises(InvalidStep, match=re.escape(f"request {bad.request_id!r}: ")):
                TargetEngine._check_trees(batch)
    assert 30 < refused < 270
