"""A LlamaModel with random weights, built from a config alone.

For realistic step costs (an 8B-shaped target) without a checkpoint on disk:
weights are drawn on the model's device as LlamaModel._load asks for them.
"""

from __future__ import annotations

import torch

from kernels.backend import get_attention_backend
from tandem.layers import Rotary
from tandem.model_config import LlamaConfig, RopeConfig
from target_service.model import LlamaModel, ParallelSpec, check_tp

LLAMA_31_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=131072, tie_word_embeddings=False,
    rope=RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position=8192),
    eos_token_ids=(128001, 128008, 128009))


class RandomWeights:
    """Answers LlamaModel._load's requests the way SafetensorsDir does, with random
    tensors (norm weights 1, matrices N(0, std)) made directly on `device`."""

    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 std: float = 0.02):
        self.cfg, self.device, self.dtype, self.std = cfg, device, dtype, std
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def __contains__(self, name: str) -> bool:
        if name == "lm_head.weight":
            return not self.cfg.tie_word_embeddings
        # Hugging Face names with the "model." prefix; biases only when the config has them.
        if name.endswith(".bias"):
            return self.cfg.attention_bias if "self_attn" in name else self.cfg.mlp_bias
        return name.startswith("model.")

    def get(self, name: str, shape: tuple[int, ...], dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        shape = list(shape)
        if dim is not None:
            shape[dim] = len(range(shape[dim])[start:stop])
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        out = torch.empty(shape, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, self.std, generator=self.gen)


def random_llama_model(cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", tp: ParallelSpec | None = None, seed: int = 0,
                       attention_backend: str | None = None) -> LlamaModel:
    """LlamaModel(...) for `cfg` with random weights; same attributes as a loaded one."""
    model = LlamaModel.__new__(LlamaModel)
    # Mirrors LlamaModel.__init__ (tests/test_random_model.py checks they agree),
    # with the weights drawn instead of read.
    model.cfg = cfg
    model.tp = tp = tp or ParallelSpec()
    check_tp(cfg, tp.size)
    model.device = torch.device(device)
    model.dtype = dtype
    model.heads_local = cfg.num_heads // tp.size
    if cfg.num_kv_heads % tp.size == 0:
        model.kv_heads_local = cfg.num_kv_heads // tp.size
        kv_start = tp.rank * model.kv_heads_local
    else:
        model.kv_heads_local = 1
        kv_start = tp.rank * cfg.num_kv_heads // tp.size
    model.scale = cfg.head_dim ** -0.5
    model.rotary = Rotary(cfg.head_dim, cfg.rope, cfg.max_position, model.device)
    model.attention = get_attention_backend(attention_backend, model.device)
    model._load(RandomWeights(cfg, model.device, dtype, seed), kv_start)
    return model
