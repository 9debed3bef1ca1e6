"""A LlamaModel with random weights, built from a config alone.

For realistic step costs (an 8B-shaped target) without a checkpoint on disk:
weights are drawn on the model's device as LlamaModel._load asks for them.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from tandem.layers import Rotary
from tandem.model_config import LlamaConfig, RopeConfig
from target_service.model import LlamaModel, ParallelSpec, check_tp

LLAMA_31_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position=131072, tie_word_embeddings=False,
    rope=RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position=8192),
    eos_token_ids=(128001, 128008, 128009))
# Llama-3.1-70B: ~141 GB of bf16 weights, the size an 8-GPU machine exists for (the TP=8 scale track).
LLAMA_31_70B = dataclasses.replace(LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                                   num_heads=64)


@dataclass(frozen=True)
class RandomInit:
    """How the weights are drawn. With planted_next_token the greedy output is a fixed
    permutation walk (token t is followed by perm[t]) with a wide margin: embeddings
    dominate the residual stream (embed_std large, residual_out_std small) and lm_head
    rows are permuted embeddings. Shapes, and so every cost, are those of the config;
    only the values differ. A plain random model's top two logits are often closer than
    bf16 rounding, so its greedy output changes with the batch it runs in, and a
    recorded continuation could not be replayed."""

    seed: int = 0
    std: float = 0.02
    embed_std: float = 0.02
    residual_out_std: float = 0.02  # o_proj and down_proj
    planted_next_token: bool = False

    @classmethod
    def from_config_json(cls, raw: dict) -> RandomInit:
        """The config.json key "tandem_random_init" (absent: the defaults)."""
        spec = raw.get("tandem_random_init") or {}
        unknown = set(spec) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown tandem_random_init field(s): {sorted(unknown)}")
        return cls(**spec)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator for one tensor: seeded by (seed, name), so a tensor is the same whichever
    rank draws it and whatever was drawn before (crc32: Python's str hash is salted)."""
    return torch.Generator(device=device).manual_seed((seed << 32 | zlib.crc32(name.encode())) % (1 << 63))


class RandomWeights:
    """Answers LlamaModel._load's requests the way SafetensorsDir does, with random
    tensors (norm weights 1, matrices N(0, std)) made directly on `device`.

    Every tensor is drawn whole from its own generator (_generator), then the rank's
    slice is taken: the model is the same at every tensor-parallel degree."""

    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 std: float = 0.02, init: RandomInit | None = None):
        self.init = init or RandomInit(seed=seed, std=std)
        self.cfg, self.device, self.dtype, self.std = cfg, device, dtype, self.init.std
        self._embed: torch.Tensor | None = None

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
        whole = self._whole(name, tuple(shape))
        if dim is None:
            return whole
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, stop)
        return whole[tuple(index)].contiguous()

    def _whole(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        init = self.init
        if name == "lm_head.weight" and init.planted_next_token and self._embed is not None:
            # Row j is the embedding of perm^-1(j): after token t the largest logit is perm(t).
            order = torch.randperm(shape[0], generator=_generator(init.seed, "planted permutation", self.device),
                                   device=self.device)
            return self._embed[order]
        std = self.std
        if name.endswith("embed_tokens.weight"):
            std = init.embed_std
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            std = init.residual_out_std
        out = torch.empty(shape, device=self.device, dtype=self.dtype).normal_(
            0.0, std, generator=_generator(init.seed, name, self.device))
        if name.endswith("embed_tokens.weight"):
            self._embed = out
        return out


def random_llama_model(cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", tp: ParallelSpec | None = None, seed: int = 0,
                       attention_backend: str | None = None, init: RandomInit | None = None,
                       batch_invariant: bool = False) -> LlamaModel:
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
    model.weight_prefetch = None
    model.choose_kernels(attention_backend, batch_invariant)
    model._load(RandomWeights(cfg, model.device, dtype, seed, init=init), kv_start)
    return model
