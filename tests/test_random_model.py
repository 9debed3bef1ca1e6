"""random_llama_model builds the same model LlamaModel loads, minus the checkpoint."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_attention import StepLayout
from tandem.model_config import LlamaConfig
from tandem.tree import ancestor_mask
from target_service.model import LlamaModel, ParallelSpec
from target_service.random_model import LLAMA_31_8B, RandomWeights, random_llama_model


def shapes(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, dict):
        return {k: shapes(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shapes(v) for v in x]
    return x


@pytest.mark.parametrize("variant", ["gqa", "llama3_tied"])
@pytest.mark.parametrize("tp", [ParallelSpec(), ParallelSpec(1, 2)], ids=["tp1", "tp2-rank1"])
def test_random_model_mirrors_a_loaded_one(tiny_llama, variant, tp):
    loaded = LlamaModel(tiny_llama(variant), torch.float32, "cpu", tp)
    rand = random_llama_model(loaded.cfg, torch.float32, "cpu", tp)
    # If LlamaModel.__init__ grows an attribute, random_llama_model must set it too.
    assert set(vars(rand)) == set(vars(loaded))
    for name in vars(loaded):
        if name == "attention":
            assert rand.attention.name == loaded.attention.name
        elif name == "rotary":
            assert torch.equal(rand.rotary.cos, loaded.rotary.cos)
        else:
            assert shapes(getattr(rand, name)) == shapes(getattr(loaded, name)), name
    assert (rand.lm_head is rand.embed) == (loaded.lm_head is loaded.embed)


def test_random_model_runs_a_step():
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=False)
    model = random_llama_model(cfg, torch.float32, "cpu", seed=3)
    kv = model.new_kv_cache(4, 4)
    layout = StepLayout((0,), (3,), (torch.zeros(0, dtype=torch.long),), (ancestor_mask([-1, 0, 0]),))
    out = model.forward(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), layout, kv, torch.arange(3))
    assert out.logits.shape == (3, 50) and out.logits.isfinite().all()
    # Random, not degenerate: different tokens give different logits.
    assert not torch.allclose(out.logits[1], out.logits[2])
    again = random_llama_model(cfg, torch.float32, "cpu", seed=3)
    assert torch.equal(again.layers[1]["down"], model.layers[1]["down"])


def test_random_weights_slice_like_a_checkpoint():
    w = RandomWeights(LLAMA_31_8B, torch.device("cpu"), torch.float32)
    assert w.get("model.layers.0.mlp.down_proj.weight", (8, 10), dim=1, start=4, stop=10).shape == (8, 6)
    assert torch.equal(w.get("model.norm.weight", (5,)), torch.ones(5))
    assert "lm_head.weight" in w and "model.layers.0.self_attn.q_proj.bias" not in w


def test_planted_model_greedy_output_is_a_wide_margin_permutation_walk():
    """The scale track's target: greedy output must not depend on bf16 rounding or batching."""
    from dataclasses import replace

    from target_service.engine import TargetEngine
    from target_service.random_model import RandomInit
    from target_service.types import SequenceStep

    cfg = replace(LLAMA_31_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position=256)
    init = RandomInit(embed_std=1.0, residual_out_std=0.002, planted_next_token=True)
    model = random_llama_model(cfg, torch.bfloat16, "cpu", init=init)
    engine = TargetEngine(model, num_blocks=64, block_size=8)
    prompts = {"a": [3, 9, 27], "b": [100, 200, 27], "c": [5]}
    out = {r: engine.step([SequenceStep.chain(r, p, create=True, top_logprobs=2)])[0] for r, p in prompts.items()}
    seqs = {r: [res.tokens[0]] for r, res in out.items()}
    for _ in range(8):  # decode all three in one batch
        res = engine.step([SequenceStep.chain(r, [s[-1]], top_logprobs=2) for r, s in seqs.items()])
        for r in res:
            seqs[r.request_id].append(r.tokens[0])
            (_, (top1, top2)), = r.top_logprobs
            assert top1 - top2 > 5.0  # the margin no rounding can flip
    # The next token depends on the last one only: prompts ending alike continue alike.
    assert seqs["a"] == seqs["b"]
    nxt = {}
    for s in seqs.values():
        for x, y in zip(s, s[1:]):
            assert nxt.setdefault(x, y) == y


def test_random_weights_are_one_model_at_every_tensor_parallel_degree():
    """Each rank's shard is a slice of the same whole tensor (drawn per name, not in load order),
    and the planted permutation is the same: TP=2 runs the model TP=1 runs."""
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=False)
    from target_service.random_model import RandomInit

    init = RandomInit(seed=5, planted_next_token=True)
    whole = random_llama_model(cfg, torch.float32, "cpu", init=init)
    shards = [random_llama_model(cfg, torch.float32, "cpu", ParallelSpec(r, 2), init=init) for r in range(2)]
    assert torch.equal(whole.embed, shards[0].embed) and torch.equal(whole.embed, shards[1].embed)
    # The lm_head is split by vocabulary: 31 rows each, the last rank's padded with a row of zeros.
    assert [s.lm_head.shape[0] for s in shards] == [31, 31]
    assert torch.equal(torch.cat([s.lm_head for s in shards])[:61], whole.lm_head)
    assert not shards[1].lm_head[-1].any()
    for layer in range(cfg.num_layers):
        # Column-parallel pieces concatenate by rows, row-parallel ones by columns.
        assert torch.equal(torch.cat([s.layers[layer]["down"] for s in shards], 1), whole.layers[layer]["down"])
        assert torch.equal(torch.cat([s.layers[layer]["o"] for s in shards], 1), whole.layers[layer]["o"])
        half = cfg.intermediate_size // 2
        gate_up = [s.layers[layer]["gate_up"] for s in shards]
        assert torch.equal(torch.cat([g[:half] for g in gate_up]), whole.layers[layer]["gate_up"][: 2 * half])
