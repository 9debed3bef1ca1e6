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
