"""A grant with two steps in flight gives what plain decoding step by step gives.

On CPU the CUDA-graph buckets run their padded buffers eagerly (GraphConfig(capture=False))
with the Triton kernels interpreted; on a GPU the same test replays real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from target_service.cuda_graphs import GraphConfig
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.pipelined_grant import pipelined
from target_service.step_batch import StepBatch
from target_service.types import SequenceStep
from target_service.wire import GrantStops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = {"a": [7, 3, 21, 40, 11], "b": [5, 9], "c": [60, 2, 2, 8, 1, 30, 4]}


@pytest.fixture(scope="module")
def models(tiny_llama):
    path = tiny_llama("gqa")
    return LlamaModel(path, device=DEVICE, attention_backend="torch"), \
        LlamaModel(path, device=DEVICE, attention_backend="triton")


def plain_tokens(model, n: int) -> dict[str, list[int]]:
    engine = TargetEngine(model, num_blocks=64, block_size=4)
    out = {r.request_id: r.tokens for r in engine.step([SequenceStep.chain(rid, p, create=True)
                                                            for rid, p in PROMPTS.items()])}
    for _ in range(n - 1):
        for r in engine.step([SequenceStep.chain(rid, [toks[-1]]) for rid, toks in out.items()]):
            out[r.request_id] = out[r.request_id] + r.tokens
    return out


def granted(model, first: dict[str, int], steps: int, max_new: dict[str, int], stop_ids: dict[str, set[int]],
            interrupt_after: int | None = None):
    engine = TargetEngine(model, num_blocks=64, block_size=4,
                          graphs=GraphConfig(max_batch=4, max_nodes=2, capture=DEVICE == "cuda"))
    engine.step([SequenceStep.chain(rid, p, create=True) for rid, p in PROMPTS.items()])
    batch = StepBatch.from_items([SequenceStep.chain(rid, [first[rid]]) for rid in PROMPTS])
    assert pipelined(engine, batch)
    stops = GrantStops(max_new_tokens=np.array([max_new[rid] for rid in PROMPTS], dtype=np.int32),
                       stop_token_ids=tuple(frozenset(stop_ids.get(rid, ())) for rid in PROMPTS))
    seen = {rid: [] for rid in PROMPTS}
    yielded = []
    for granted_step in engine.grant(batch, stops, steps, lambda: interrupt_after is not None
                                     and len(yielded) >= interrupt_after):
        yielded.append(granted_step)
        if granted_step.results is not None:
            for item, tok in zip(granted_step.item_index.tolist(), granted_step.results.new_tokens[:, 0].tolist()):
                seen[list(PROMPTS)[item]].append(tok)
    assert yielded[-1].last and not any(g.last for g in yielded[:-1])
    return seen, engine, len(yielded)


def test_a_pipelined_grant_equals_plain_steps_and_stops_where_it_should(models):
    ref = plain_tokens(models[0], 8)
    first = {rid: toks[0] for rid, toks in ref.items()}
    # "a" stops after 3 tokens by count; "b" on its 4th token (a stop id learnt one step late,
    # so the step already launched for it is dropped); "c" runs the whole grant.
    stop_b = ref["b"][4]
    seen, engine, _ = granted(models[1], first, 6, {"a": 3, "b": 10, "c": 10}, {"b": {stop_b}})
    assert seen["a"] == ref["a"][1:4]
    assert seen["b"] == ref["b"][1: ref["b"].index(stop_b, 1) + 1]
    assert seen["c"] == ref["c"][1:7]
    # The KV of every token the grant reported is the cache's: a later plain step still agrees.
    after = engine.step([SequenceStep.chain("c", [seen["c"][-1]])])[0].tokens
    assert after == [ref["c"][7]]


def test_an_interrupted_pipelined_grant_ends_after_the_step_in_flight(models):
    ref = plain_tokens(models[0], 8)
    first = {rid: toks[0] for rid, toks in ref.items()}
    seen, _, replies = granted(models[1], first, 8, {rid: 10 for rid in PROMPTS}, {}, interrupt_after=2)
    assert replies == 3  # the step launched before the interrupt was seen is still reported
    assert all(seen[rid] == ref[rid][1:4] for rid in PROMPTS)
