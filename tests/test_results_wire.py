"""A step's results on the wire (PackedResults): what the gateway reads is the target's own
per-sequence view of the step (StepResults.sequence_results), whatever each sequence accepted
and asked for."""

from __future__ import annotations

import numpy as np
import torch

from target_service.step_batch import StepResults
from target_service.wire import results_from_proto, results_to_proto


def test_the_gateway_reads_each_sequences_tokens_top_log_probs_and_features_as_the_target_gave_them():
    B, M, K = 3, 4, 3
    rng = np.random.default_rng(5)
    results = StepResults(
        request_ids=("a", "b", "c"), num_accepted=np.array([3, 0, 1], np.int32),
        accepted_nodes=rng.integers(0, 9, (B, M)).astype(np.int32),
        new_tokens=rng.integers(0, 500, (B, M)).astype(np.int32),
        logprobs=-rng.random((B, M)).astype(np.float32), num_committed=np.array([40, 7, 19], np.int64),
        top_ids=rng.integers(0, 500, (B, M, K)).astype(np.int32),
        top_logprobs=-rng.random((B, M, K)).astype(np.float32),
        top_k=np.array([2, 0, 3], np.int32), features=torch.randn(6, 5), feature_counts=np.array([4, 0, 2], np.int64))
    # The call's items were (c, a, b): item_index says which item each result belongs to.
    wire = results_to_proto(results, np.array([1, 2, 0]))
    got = results_from_proto(wire, ("c", "a", "b"))
    want = results.sequence_results()
    assert [r.request_id for r in got] == ["a", "b", "c"]
    for mine, theirs in zip(got, want, strict=True):
        assert (mine.accepted_nodes, mine.tokens, mine.logprobs, mine.top_logprobs, mine.num_committed) == (
            theirs.accepted_nodes, theirs.tokens, theirs.logprobs, theirs.top_logprobs, theirs.num_committed)
        assert (mine.features is None) == (theirs.features is None)
        if mine.features is not None:
            assert torch.equal(mine.features, theirs.features)
    assert len(got[0].tokens) == 4 and len(got[0].top_logprobs) == 4 and len(got[2].features) == 2


def test_steps_packed_from_their_items_are_the_bytes_the_batch_packs():
    """The gateway packs a step straight from its items (items_to_proto); the target reads the columns the
    batch's own packing writes, for every kind of item, and items the plain-list path cannot hold take it."""
    from target_service.controls import LogitsControls
    from target_service.step_batch import StepBatch
    from target_service.types import SamplingParams, SequenceStep
    from target_service.wire import batch_from_proto, batch_to_proto, items_to_proto

    tree = SequenceStep("t", (5, 9, 11, 12), (-1, 0, 0, 1), 1, return_features=True, sample_is_output=True)
    chain = SequenceStep.chain("c", (3, 4, 5), create=True, sampling=SamplingParams(0.7, 40, 0.9, seed=2**63 + 5),
                               top_logprobs=3)
    plain = SequenceStep.chain("p", (8,), sampling=SamplingParams(1.3, 0, 0.95))
    controlled = SequenceStep.chain("k", (6,), controls=LogitsControls(repetition_penalty=1.2, stop_ids=(2,),
                                                                        min_tokens=3, logit_bias=((7, -1.5),)))
    huge = SequenceStep.chain("h", (2**40,))  # not a token; the target refuses it, as it did
    empty = SequenceStep("e", (), (), 0)
    for items in ([tree], [tree, chain, plain], [chain, controlled, tree], [huge, plain], [empty, tree], []):
        packed = items_to_proto(items)
        assert packed == batch_to_proto(StepBatch.from_items(items)), [it.request_id for it in items]
        if empty not in items:  # (the target refuses an empty tree by name)
            assert batch_from_proto(packed).items() == StepBatch.from_items(items).items()
