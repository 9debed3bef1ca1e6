"""Draft state per request: catch-up equals prefill, validation leaves state alone, release frees all."""

from __future__ import annotations

import pytest
import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import (
    DraftBudget,
    DraftItem,
    DraftTree,
    IngestItem,
    InvalidDraftInput,
    OutOfDraftCapacity,
)
from tests.draft_state import history, kv_of, snapshot
from tests.tiny_draft import make_tiny_eagle3


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    target = tiny_llama("gqa")
    return Eagle3Draft(make_tiny_eagle3(tmp_path_factory.mktemp("d") / "d", target, seed=21), target)


BUDGET = DraftBudget(steps=4, topk=3, num_draft_tokens=10)


def test_catch_up_over_a_history_equals_a_prefill(model):
    """A request fed step by step as a gateway would (prefill, then verify results of varying
    length, a draft call between each) ends with the KV a from-scratch prefill computes."""
    tokens, feats = history(model, 40, seed=1)
    live = DraftEngine(model, num_blocks=32, block_size=4)
    # Prefill: prompt of 9 committed tokens + the pending one.
    live.ingest([IngestItem("r", 0, tuple(tokens[:10]), feats[:9])])
    pos = 9  # the pending token's position
    for accepted in [0, 3, 1, 0, 5, 2, 4, 0, 6, 1, 2]:
        trees = live.draft([DraftItem("r", BUDGET, num_tokens=pos + 1)])
        assert live.computed("r") == pos and trees[0].root_position == pos
        end = min(pos + accepted + 1, 40)
        # The verify step committed [pending] + accepted, and sampled a new pending token.
        live.draft([], ingest=[IngestItem("r", pos, tuple(tokens[pos:end + 1]), feats[pos:end])])
        pos = end
        if pos == 40:
            break
    live.catch_up()
    scratch = DraftEngine(model, num_blocks=32, block_size=4)
    scratch.ingest([IngestItem("r", 0, tuple(tokens[:pos + 1]), feats[:pos])], catch_up=True)
    assert live.computed("r") == scratch.computed("r") == pos
    for a, b in zip(kv_of(live, "r"), kv_of(scratch, "r")):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(live.requests["r"].last_h, scratch.requests["r"].last_h, atol=1e-5, rtol=0)
    # Same state, same tree.
    t1, t2 = (e.draft([DraftItem("r", BUDGET)])[0] for e in (live, scratch))
    assert (t1.tokens, t1.parents) == (t2.tokens, t2.parents)


def test_token_only_catch_up_equals_prefill_without_those_features(model):
    """A request that speculated, then did not (no features), then did again: catching up in one go
    equals a from-scratch prefill that lacks the same features."""
    tokens, feats = history(model, 30, seed=2)
    live = DraftEngine(model, num_blocks=32, block_size=4)
    live.ingest([IngestItem("r", 0, tuple(tokens[:8]), feats[:7])])
    live.draft([DraftItem("r", BUDGET)])
    for p in range(7, 20):  # plain decode: tokens only
        live.ingest([IngestItem("r", p, tuple(tokens[p:p + 2]))])
    assert live.status("r").num_missing_features == 13 and not live.status("r").ready
    live.ingest([IngestItem("r", 20, tuple(tokens[20:31]), feats[20:30])])
    live.draft([DraftItem("r", BUDGET)])
    assert live.status("r").ready
    scratch = DraftEngine(model, num_blocks=32, block_size=4)
    scratch.ingest([IngestItem("r", 0, tuple(tokens[:20])), IngestItem("s", 0, (1, 2))])
    scratch.ingest([IngestItem("r", 0, tuple(tokens[:8]), feats[:7]),
                    IngestItem("s", 1, (2, 3))])
    scratch.ingest([IngestItem("r", 20, tuple(tokens[20:31]), feats[20:30])], catch_up=True)
    for a, b in zip(kv_of(live, "r"), kv_of(scratch, "r")):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # And the missing features did matter: exact features give different KV.
    exact = DraftEngine(model, num_blocks=32, block_size=4)
    exact.ingest([IngestItem("r", 0, tuple(tokens), feats)], catch_up=True)
    assert not torch.allclose(kv_of(exact, "r")[0], kv_of(live, "r")[0], atol=1e-3)


def test_drafting_leaves_only_committed_state(model):
    engine = DraftEngine(model, num_blocks=32, block_size=4)
    tokens, feats = history(model, 12, seed=3)
    engine.ingest([IngestItem("r", 0, tuple(tokens), feats)], catch_up=True)
    before = [t.clone() for t in kv_of(engine, "r")]
    used = engine.load().used_blocks
    trees = [engine.draft([DraftItem("r", DraftBudget(6, 4, 30))])[0] for _ in range(2)]
    assert trees[0] == trees[1]
    assert engine.computed("r") == 12 and engine.load().used_blocks == used
    for a, b in zip(before, kv_of(engine, "r")):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_release_frees_all_state(model):
    engine = DraftEngine(model, num_blocks=32, block_size=4)
    total = engine.load().total_blocks
    for i in range(5):
        tokens, feats = history(model, 6 + 5 * i, seed=10 + i)
        engine.draft([DraftItem(f"r{i}", BUDGET)], ingest=[IngestItem(f"r{i}", 0, tuple(tokens), feats[:-2])])
    engine.ingest([IngestItem("lazy", 0, (1, 2, 3))])  # no KV yet, but state
    load = engine.load()
    assert load.num_sequences == 6 and load.used_blocks > 0
    assert engine.release(["r0", "r1", "nope"]) == 2
    assert engine.load().num_sequences == 4
    assert engine.release([f"r{i}" for i in range(5)] + ["lazy"]) == 4
    load = engine.load()
    assert (load.num_sequences, load.used_blocks, load.free_blocks) == (0, 0, total)
    assert engine.requests == {} and engine.kv.seqs == {}
    assert engine.release(["r0"]) == 0  # repeatable
    # The freed blocks serve new requests.
    tokens, feats = history(model, 100, seed=9)
    engine.ingest([IngestItem("big", 0, tuple(tokens), feats)], catch_up=True)
    assert engine.load().used_blocks == 25


# --- validation: a bad call changes nothing ----------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda e: e.draft([DraftItem("ghost", BUDGET)]), "unknown request 'ghost'"),
    (lambda e: e.ingest([IngestItem("ghost", 3, (1,))]), "unknown request 'ghost'"),
    (lambda e: e.ingest([IngestItem("a", 9, (1,))]), "start_position 9"),
    (lambda e: e.ingest([IngestItem("a", 2, (5, 6))]), "position 2 holds token"),
    (lambda e: e.ingest([IngestItem("a", 8, (1000,))]), "token id 1000 out of range"),
    (lambda e: e.ingest([IngestItem("a", 8, (1,), torch.zeros(1, 10))]), r"features must be .* \[rows, 192\]"),
    (lambda e: e.ingest([IngestItem("a", 8, (1,), torch.zeros(2, 192))]), "2 feature rows for 1 tokens"),
    (lambda e: e.ingest([IngestItem("", 0, (1,))]), "request_id must not be empty"),
    (lambda e: e.ingest([IngestItem("n", 0, (1,)), IngestItem("n", 1, (2,))]), "twice"),
    (lambda e: e.ingest([IngestItem("a", 8, (1,) * 3000)]), "over the draft's limit"),
    (lambda e: e.draft([DraftItem("a", DraftBudget(-1, 2, 3))]), ">= 0"),
    (lambda e: e.draft([DraftItem("a", DraftBudget(5, 25, 8))]), "topk must be <= 24"),
    (lambda e: e.draft([DraftItem("a", DraftBudget(99, 2, 8))]), "steps must be <= 32"),
    (lambda e: e.draft([DraftItem("a", DraftBudget(5, 2, 5000))]), "num_draft_tokens must be <= 1024"),
    (lambda e: e.draft([DraftItem("a", BUDGET, num_tokens=7)]), "caller knows 7 tokens but the draft holds 8"),
    (lambda e: e.draft([DraftItem("a", BUDGET), DraftItem("a", BUDGET)]), "twice"),
    # A good ingest in the same call as a bad item is not applied either.
    (lambda e: e.draft([DraftItem("ghost", BUDGET)], ingest=[IngestItem("a", 8, (4, 4), torch.zeros(1, 192))]),
     "unknown request 'ghost'"),
    (lambda e: e.ingest([IngestItem("new", 0, (1, 2)), IngestItem("a", 2, (0,))]), "position 2 holds"),
])
def test_bad_input_names_the_request_and_changes_nothing(model, call, message):
    engine = DraftEngine(model, num_blocks=32, block_size=4)
    tokens, feats = history(model, 7, seed=4)
    engine.ingest([IngestItem("a", 0, tuple(tokens), feats[:5])])
    before = snapshot(engine)
    with pytest.raises(InvalidDraftInput, match=message):
        call(engine)
    assert snapshot(engine) == before
    engine.draft([DraftItem("a", BUDGET)])  # still serving


def test_out_of_capacity_changes_nothing(model):
    engine = DraftEngine(model, num_blocks=3, block_size=4)
    tokens, feats = history(model, 20, seed=5)
    engine.ingest([IngestItem("a", 0, tuple(tokens[:9]), feats[:8])], catch_up=True)  # 2 blocks
    before = snapshot(engine)
    with pytest.raises(OutOfDraftCapacity, match="needs 3 more draft KV blocks, 1 free"):
        engine.draft([DraftItem("a", BUDGET)], ingest=[IngestItem("a", 8, tuple(tokens[8:18]), feats[8:17])])
    assert snapshot(engine) == before
    with pytest.raises(OutOfDraftCapacity):
        engine.ingest([IngestItem("b", 0, tuple(tokens), feats)], catch_up=True)
    assert snapshot(engine) == before
    # Without catch-up the ingest is only recorded; drafting other requests still works.
    engine.ingest([IngestItem("b", 0, tuple(tokens), feats)])
    assert len(engine.draft([DraftItem("a", BUDGET)])[0]) == 9


def test_features_for_computed_positions_are_ignored_and_overlaps_must_match(model):
    engine = DraftEngine(model, num_blocks=32, block_size=4)
    tokens, feats = history(model, 10, seed=6)
    engine.ingest([IngestItem("a", 0, tuple(tokens[:6]))], catch_up=True)  # token-only positions 0..4
    k_before = kv_of(engine, "a")[0].clone()
    # Re-sending known tokens with features: positions 0..4 are computed already; 5.. are new.
    status = engine.ingest([IngestItem("a", 0, tuple(tokens), feats)])[0]
    assert (status.num_tokens, status.num_computed, status.num_missing_features) == (11, 5, 0)
    engine.catch_up()
    torch.testing.assert_close(kv_of(engine, "a")[0][:5], k_before, atol=0, rtol=0)
    assert engine.status("a").ready


def test_a_tree_verifies_on_the_target_as_returned(tiny_llama):
    """DraftTree.verify_tree is the target's SequenceStep: a tree holding the target's greedy
    continuation (on one branch, below a decoy) is accepted node for node."""
    from target_service.engine import TargetEngine
    from target_service.model import LlamaModel
    from target_service.types import SequenceStep

    target = TargetEngine(LlamaModel(tiny_llama("gqa")), num_blocks=16, block_size=4)
    prompt = [5, 17, 3, 9, 33, 2, 40, 11]
    greedy = target.step([SequenceStep.chain("plain", prompt, create=True)])[0].tokens
    while len(greedy) < 4:
        greedy += target.step([SequenceStep.chain("plain", greedy[-1:])])[0].tokens
    b = target.step([SequenceStep.chain("spec", prompt, create=True)])[0].tokens[0]
    assert b == greedy[0]
    decoy = (greedy[1] + 1) % 101
    tree = DraftTree("spec", b, len(prompt), tokens=[decoy, greedy[1], greedy[2], decoy],
                     parents=[-1, -1, 1, 1], depths=[1, 1, 2, 2], logprobs=[-1.0] * 4, scores=[-1.0] * 4)
    tokens, parents, num_fixed = tree.verify_tree()
    assert (tokens, parents, num_fixed) == ([b, decoy, greedy[1], greedy[2], decoy], [-1, 0, 0, 2, 2], 1)
    result = target.step([SequenceStep("spec", tuple(tokens), tuple(parents), num_fixed)])[0]
    assert result.accepted_nodes == [2, 3]
    assert result.tokens == greedy[1:4]
