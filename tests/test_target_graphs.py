"""The graph path of the target step: padded static buffers give the eager step's results.

On CPU the buffers run eagerly (GraphConfig(capture=False)) with the Triton
kernels under TRITON_INTERPRET=1; on a GPU the same test captures real graphs.
"""

from __future__ import annotations

import pytest
import torch

from target_service.cuda_graphs import GraphConfig
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep
from tests.test_target_verify import PROMPT, tree_with_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def models(tiny_llama):
    path = tiny_llama("gqa")
    return LlamaModel(path, device=DEVICE, attention_backend="torch"), \
        LlamaModel(path, device=DEVICE, attention_backend="triton")


def engines(models, **graph_limits):
    eager = TargetEngine(models[0], num_blocks=96, block_size=4)
    graphs = TargetEngine(models[1], num_blocks=96, block_size=4,
                          graphs=GraphConfig(max_batch=4, max_nodes=16, max_tokens=64,
                                             capture=DEVICE == "cuda", **graph_limits))
    return eager, graphs


def run_both(eager, graphs, items, **kw):
    a, b = eager.step(items, **kw), graphs.step(items, **kw)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.accepted_nodes == y.accepted_nodes
        assert x.num_committed == y.num_committed
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
        if x.features is not None:
            assert torch.allclose(x.features, y.features, atol=1e-4)
    return a


def assert_caches_agree(eager, graphs, rids) -> None:
    """The committed caches of both engines agree for these sequences (length and keys, every layer)."""
    for rid in rids:
        n = eager.kv.seqs[rid].length
        assert graphs.kv.seqs[rid].length == n
        for layer in range(len(eager.kv.k)):
            ka, _ = eager.kv.read(layer, eager.kv.slots(rid, 0, n))
            kb, _ = graphs.kv.read(layer, graphs.kv.slots(rid, 0, n))
            assert torch.allclose(ka, kb, atol=1e-5)


def test_decode_and_verify_steps_through_graph_buffers_match_eager(models):
    eager, graphs = engines(models)
    prompts = {f"r{i}": [(t * (i + 3)) % 97 + 1 for t in PROMPT][: 3 + 2 * i] for i in range(3)}
    # The prompts (3, 5 and 7 tokens, new sequences) replay the 4 x 8 bucket: 32 rows, within max_chain_rows.
    first = run_both(eager, graphs, [SequenceStep.chain(r, p, create=True) for r, p in prompts.items()])
    assert graphs.graphs.replays == 1
    last = {r.request_id: r.tokens[-1] for r in first}
    # Four steps cover each case at least once (plain and tree items side by side, features asked, batches
    # of 2 and of 3); on CPU every step runs the Triton kernels interpreted (71 s at six steps, 2026-12-03).
    for step in range(4):
        items = []
        for i, rid in enumerate(prompts):
            if (step + i) % 3 == 0:  # plain decode
                items.append(SequenceStep.chain(rid, [last[rid]]))
            else:  # a tree with siblings and dead branches, some of it right by chance
                toks, parents = tree_with_path(last[rid], [(last[rid] * 7 + k) % 97 for k in range(2 + i)],
                                               {1: [5], 2: [9, 11]})
                items.append(SequenceStep(rid, tuple(toks), tuple(parents), 1, top_logprobs=3,
                                          return_features=step == 2))
        # Ragged batches: drop one request now and then (batch 3 pads to bucket 4, 2 stays 2).
        items = items if step % 2 else items[:2]
        results = run_both(eager, graphs, items)
        last.update({r.request_id: r.tokens[-1] for r in results})
    assert graphs.graphs.replays == 5
    assert_caches_agree(eager, graphs, prompts)


def test_prompt_chunks_replay_a_bucket_only_where_its_padding_stays_small(models):
    eager, graphs = engines(models, max_chain_rows=16)
    prompt = [(t * 5) % 97 + 1 for t in PROMPT * 3][:15]
    # New sequences, features asked (a prompt that feeds a draft): the 2 x 8 bucket, 16 rows.
    first = run_both(eager, graphs, [SequenceStep.chain("a", prompt[:6], create=True, return_features=True),
                                     SequenceStep.chain("b", PROMPT[:4], create=True, return_features=True)])
    assert graphs.graphs.replays == 1
    # The next chunk of a's prompt (three fixed nodes, no new sequence) beside a tree for b.
    toks, parents = tree_with_path(first[1].tokens[-1], [3, 8], {1: [5]})
    second = run_both(eager, graphs, [SequenceStep.chain("a", prompt[6:9], return_features=True),
                                      SequenceStep("b", tuple(toks), tuple(parents), 1, return_features=True)])
    assert graphs.graphs.replays == 2
    # Nine fixed nodes pad both sequences to the 2 x 16 bucket: 32 rows, over max(16, twice the step's 10).
    run_both(eager, graphs, [SequenceStep.chain("a", prompt[9:15] + [7, 8, 9]),
                             SequenceStep.chain("b", [second[1].tokens[-1]])])
    assert graphs.graphs.replays == 2
    assert_caches_agree(eager, graphs, ("a", "b"))


def test_prompt_chunks_no_bucket_takes_replay_a_ragged_bucket_sized_by_their_rows(models):
    """GraphConfig.ragged_rows: a step with prompt chunks that no (batch, nodes) bucket takes (a chunk longer
    than max_nodes, or padding past max_chain_rows) replays a (batch, tree nodes, rows) bucket whose rows are
    the step's own to a power of two, and gives the eager step's results and caches. On the H200 scale track
    such steps ran eagerly at 19-31 ms beside decode and tree steps of 5-9 ms."""
    eager, graphs = engines(models, max_chain_rows=16, ragged_rows=32)
    prompt = [(t * 5) % 97 + 1 for t in PROMPT * 6][:29]
    # A 20-token prompt (over max_nodes 16) beside a 3-token one, new sequences, features asked: 23 rows,
    # the ragged 2 x 1 x 32 bucket.
    first = run_both(eager, graphs, [SequenceStep.chain("a", prompt[:20], create=True, return_features=True),
                                     SequenceStep.chain("b", PROMPT[:3], create=True, return_features=True)])
    assert graphs.graphs.replays == 1 and (2, 1, 32) in graphs.graphs._buckets
    # The rest of a's prompt (9 fixed nodes) beside a 5-node tree for b: 14 rows. The 2 x 16 bucket would pad
    # to 32, over max(16, twice 14): the ragged 2 x 16 x 16 bucket (trees of up to GraphConfig.ragged_tree,
    # 16 nodes, and 16 rows).
    toks, parents = tree_with_path(first[1].tokens[-1], [3, 8], {1: [5]})
    run_both(eager, graphs, [SequenceStep.chain("a", prompt[20:29], return_features=True),
                             SequenceStep("b", tuple(toks), tuple(parents), 1, return_features=True)])
    assert graphs.graphs.replays == 2 and (2, 16, 16) in graphs.graphs._buckets
    # 35 rows are over ragged_rows 32: eager.
    run_both(eager, graphs, [SequenceStep.chain("c", prompt + PROMPT, create=True)])
    assert graphs.graphs.replays == 2
    assert_caches_agree(eager, graphs, ("a", "b", "c"))


def test_the_common_ragged_buckets_are_captured_at_start_up_and_a_joining_prompt_replays_one(models):
    """GraphConfig.ragged_warm_rows: capture_all also takes the ragged buckets of every batch bucket for plain
    decode and for trees (ragged_tree nodes), rows from ragged_warm_rows up, so that no capture pauses a step
    under load (on an H100 four of them paused one level's first probe of trees, which then lost its verdict).
    A step that meets one replays it, with the eager step's results; trees of 2-16 nodes share one."""
    eager, graphs = engines(models, max_chain_rows=16, ragged_rows=32, ragged_warm_rows=16)
    cfg = graphs.graphs.cfg
    warm = cfg.warm_ragged_buckets()
    assert sorted(warm) == sorted((b, n, rows) for b in (1, 2, 4) for n in (1, 16) for rows in (16, 32))
    assert [cfg.ragged_tree_bucket(t) for t in (1, 2, 5, 16, 17)] == [1, 16, 16, 16, None]
    graphs.graphs.capture_all()
    captured = set(graphs.graphs._buckets)
    assert set(warm) <= captured
    prompt = [(t * 5) % 97 + 1 for t in PROMPT * 6][:20]
    first = run_both(eager, graphs, [SequenceStep.chain("a", PROMPT[:4], create=True)])
    # A 20-token prompt joining a's 3-node tree: 23 rows, the warm 2 x 16 x 32 bucket.
    toks, parents = tree_with_path(first[0].tokens[-1], [3, 8], {})
    run_both(eager, graphs, [SequenceStep("a", tuple(toks), tuple(parents), 1),
                             SequenceStep.chain("b", prompt, create=True, return_features=True)])
    assert graphs.graphs.replays == 2 and set(graphs.graphs._buckets) == captured
    assert_caches_agree(eager, graphs, ("a", "b"))


def test_no_ragged_bucket_is_captured_at_start_up_where_ragged_graphs_or_their_warm_rows_are_off():
    assert GraphConfig(ragged_rows=0).warm_ragged_buckets() == []
    assert GraphConfig(ragged_rows=1024, ragged_warm_rows=0).warm_ragged_buckets() == []
    # The defaults: batches 1-128, trees 1 and 16, rows 64-1024 (128-1024 for 128 sequences).
    assert len(GraphConfig(ragged_rows=1024).warm_ragged_buckets()) == 2 * (7 * 5 + 4)
    with pytest.raises(ValueError, match="ragged tree must be positive"):
        GraphConfig(ragged_tree=0)


def test_steps_outside_every_bucket_run_eagerly(models):
    eager, graphs = engines(models)
    rids = [f"s{i}" for i in range(5)]
    first = run_both(eager, graphs, [SequenceStep.chain(r, PROMPT, create=True) for r in rids])
    # 5 sequences is over max_batch 4: eager, same result.
    run_both(eager, graphs, [SequenceStep.chain(r.request_id, [r.tokens[-1]]) for r in first])
    assert graphs.graphs.replays == 0
    # A 20-node tree is over max_nodes 16.
    toks = [first[0].tokens[-1]] + list(range(1, 20))
    run_both(eager, graphs, [SequenceStep(rids[0], tuple(toks), (-1,) + (0,) * 19, 1)])
    assert graphs.graphs.replays == 0


def test_a_negative_ragged_row_limit_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="ragged rows not negative"):
        GraphConfig(ragged_rows=-1)
    with pytest.raises(ValueError, match="warm ragged rows not negative"):
        GraphConfig(ragged_warm_rows=-1)
    from target_service.server import main
    with pytest.raises(SystemExit, match="error: --graph-ragged-rows must be >= 0"):
        main(["--model", "no-such-model", "--port", "0", "--graph-ragged-rows", "-1"])
    with pytest.raises(SystemExit, match="error: --graph-ragged-warm-rows must be >= 0"):
        main(["--model", "no-such-model", "--port", "0", "--graph-ragged-warm-rows", "-1"])
