"""The target model against transformers: log-probs, greedy generation, loading rules."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from kernels.tree_attention import StepLayout
from tandem.model_config import ModelLoadError
from tandem.tree import ancestor_mask
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep

VARIANTS = ["gqa", "llama3_tied", "mha"]


def hf_logprobs(model_dir, tokens: list[int]) -> torch.Tensor:
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)


def chain_logprobs(engine: TargetEngine, rid: str, tokens: list[int]) -> torch.Tensor:
    """Log-probs at every position of `tokens` appended to `rid`'s committed prefix (nothing committed)."""
    kv = engine.kv
    n, length = len(tokens), kv.seqs[rid].length
    kv.reserve(rid, length + n)
    layout = StepLayout((0,), (n,), (kv.slots(rid, 0, length),), (ancestor_mask(list(range(-1, n - 1))),))
    out = engine.model.forward(torch.tensor(tokens), torch.arange(length, length + n), layout, kv,
                               torch.arange(n))
    return torch.log_softmax(out.logits, -1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logprobs_match_transformers(tiny_llama, variant):
    model_dir = tiny_llama(variant)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logprobs(model_dir, tokens)
    # Block size 4 puts the prefix across many blocks; committing 13 tokens first
    # makes the last 32 positions read their prefix from the paged cache.
    engine = TargetEngine(LlamaModel(model_dir), num_blocks=32, block_size=4)
    first = engine.step([SequenceStep.chain("r", tokens[:13], create=True)])[0]
    assert first.logprobs[0] == pytest.approx(float(ref[12, first.tokens[0]]), abs=1e-4)
    ours = chain_logprobs(engine, "r", tokens[13:])
    torch.testing.assert_close(ours, ref[13:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_one_node_steps_equal_generate(tiny_llama, variant):
    model_dir = tiny_llama(variant)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 3, 9, 33, 2, 40]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = TargetEngine(LlamaModel(model_dir), num_blocks=32, block_size=4)
    out = engine.step([SequenceStep.chain("g", prompt, create=True)])[0].tokens
    while len(out) < 40:
        out += engine.step([SequenceStep.chain("g", [out[-1]])])[0].tokens
    assert out == ref


def test_sglang_feature_layers_default(tiny_llama):
    cfg = LlamaModel(tiny_llama("gqa")).cfg
    assert cfg.default_feature_layers == (2, 2, 1)  # L=4: [2, L//2, L-3]


def test_features_are_residual_stream_at_layer_input(tiny_llama):
    model_dir = tiny_llama("gqa")
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = [1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # hs[i] = input of layer i
    engine = TargetEngine(LlamaModel(model_dir), num_blocks=16, block_size=4)
    r = engine.step([SequenceStep.chain("f", tokens, create=True, return_features=True)], (0, 2, 3))[0]
    expected = torch.cat([hs[0][0], hs[2][0], hs[3][0]], -1)
    torch.testing.assert_close(r.features, expected, atol=1e-5, rtol=0)


def test_refuses_pickled_weights_and_bad_shapes(tmp_path, tiny_llama):
    src = tiny_llama("gqa")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((src / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="never loaded"):
        LlamaModel(pickled)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight' has shape \[128, 64\], expected \[96, 64\]"):
        LlamaModel(bad)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    from tests.tiny_models import make_tiny_llama

    d = make_tiny_llama(tmp_path / "m", "gqa", max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").exists()
    assert len(list(d.glob("*.safetensors"))) > 1
    ref = hf_logprobs(d, [1, 2, 3, 4])
    engine = TargetEngine(LlamaModel(d), num_blocks=8, block_size=4)
    r = engine.step([SequenceStep.chain("s", [1, 2, 3, 4], create=True)])[0]
    assert r.logprobs[0] == pytest.approx(float(ref[3].max()), abs=1e-4)
