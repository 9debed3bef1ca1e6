"""A Llama-family decoder that runs a step's token trees over a paged KV cache.

Tensor parallel in the Megatron style: q/k/v and gate/up are split by output
(column-parallel), o_proj and down_proj by input (row-parallel, then an
all-reduce). Embedding and lm_head are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.backend import get_attention_backend
from kernels.rmsnorm import rms_norm_triton
from kernels.rope import rope_triton
from kernels.tree_attention import StepLayout
from tandem.kv_cache import PagedKVCache
from tandem.layers import Rotary, SafetensorsDir, rms_norm
from tandem.model_config import LlamaConfig, ModelLoadError, load_llama_config


@dataclass(frozen=True)
class ParallelSpec:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} out of range for tp size {self.size}")


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    if cfg.num_heads % tp:
        raise ModelLoadError(f"--tp {tp} does not divide num_attention_heads ({cfg.num_heads})")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ModelLoadError(
            f"--tp {tp} neither divides nor is a multiple of num_key_value_heads ({cfg.num_kv_heads})")
    if cfg.intermediate_size % tp:
        raise ModelLoadError(f"--tp {tp} does not divide intermediate_size ({cfg.intermediate_size})")


@dataclass
class StepOutput:
    # Per layer, the step nodes' new K and V: [T, kv_heads_local, head_dim].
    new_k: list[torch.Tensor]
    new_v: list[torch.Tensor]
    # float32 logits [len(logit_rows), vocab].
    logits: torch.Tensor
    # [T, len(feature_layers) * hidden] or None.
    features: torch.Tensor | None


class LlamaModel:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", tp: ParallelSpec | None = None,
                 attention_backend: str | None = None):
        self.cfg = cfg = load_llama_config(model_dir)
        self.tp = tp = tp or ParallelSpec()
        check_tp(cfg, tp.size)
        self.device = torch.device(device)
        self.dtype = dtype
        self.heads_local = cfg.num_heads // tp.size
        if cfg.num_kv_heads % tp.size == 0:
            self.kv_heads_local = cfg.num_kv_heads // tp.size
            kv_start = tp.rank * self.kv_heads_local
        else:  # more ranks than kv heads: each rank keeps a copy of the one it needs
            self.kv_heads_local = 1
            kv_start = tp.rank * cfg.num_kv_heads // tp.size
        self.scale = cfg.head_dim ** -0.5
        self.rotary = Rotary(cfg.head_dim, cfg.rope, cfg.max_position, self.device)
        # "torch" | "triton" | "flashinfer"; None picks the device's default (kernels.backend).
        self.attention = get_attention_backend(attention_backend, self.device)
        self._load(SafetensorsDir(model_dir), kv_start)

    # --- weights ----------------------------------------------------------
    def _load(self, w: SafetensorsDir, kv_start: int) -> None:
        cfg, r = self.cfg, self.tp.rank
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        pre = "model." if "model.embed_tokens.weight" in w else ""

        def get(name, shape, dim=None, start=0, stop=None):
            t = w.get(pre + name if not name.startswith("lm_head") else name, shape, dim, start, stop)
            return t.to(device=self.device, dtype=self.dtype)

        self.embed = get("embed_tokens.weight", (cfg.vocab_size, H))
        q_rows = (r * self.heads_local * D, (r + 1) * self.heads_local * D)
        kv_rows = (kv_start * D, (kv_start + self.kv_heads_local) * D)
        i_rows = (r * I // self.tp.size, (r + 1) * I // self.tp.size)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            qkv = [get(p + "self_attn.q_proj.weight", (cfg.num_heads * D, H), 0, *q_rows),
                   get(p + "self_attn.k_proj.weight", (cfg.num_kv_heads * D, H), 0, *kv_rows),
                   get(p + "self_attn.v_proj.weight", (cfg.num_kv_heads * D, H), 0, *kv_rows)]
            layer = {
                "input_norm": get(p + "input_layernorm.weight", (H,)),
                "post_norm": get(p + "post_attention_layernorm.weight", (H,)),
                "qkv": torch.cat(qkv),
                "o": get(p + "self_attn.o_proj.weight", (H, cfg.num_heads * D), 1, *q_rows),
                "gate_up": torch.cat([get(p + "mlp.gate_proj.weight", (I, H), 0, *i_rows),
                                      get(p + "mlp.up_proj.weight", (I, H), 0, *i_rows)]),
                "down": get(p + "mlp.down_proj.weight", (H, I), 1, *i_rows),
                "qkv_bias": None, "o_bias": None, "gate_up_bias": None, "down_bias": None,
            }
            if cfg.attention_bias:
                layer["qkv_bias"] = torch.cat([
                    get(p + "self_attn.q_proj.bias", (cfg.num_heads * D,), 0, *q_rows),
                    get(p + "self_attn.k_proj.bias", (cfg.num_kv_heads * D,), 0, *kv_rows),
                    get(p + "self_attn.v_proj.bias", (cfg.num_kv_heads * D,), 0, *kv_rows)])
                # Row-parallel bias is added once, after the all-reduce.
                layer["o_bias"] = get(p + "self_attn.o_proj.bias", (H,))
            if cfg.mlp_bias:
                layer["gate_up_bias"] = torch.cat([get(p + "mlp.gate_proj.bias", (I,), 0, *i_rows),
                                                   get(p + "mlp.up_proj.bias", (I,), 0, *i_rows)])
                layer["down_bias"] = get(p + "mlp.down_proj.bias", (H,))
            self.layers.append(layer)
        self.norm = get("norm.weight", (H,))
        if "lm_head.weight" in w and not cfg.tie_word_embeddings:
            self.lm_head = get("lm_head.weight", (cfg.vocab_size, H))
        else:
            self.lm_head = self.embed

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.cfg.num_layers, num_blocks, block_size, self.kv_heads_local,
                            self.cfg.head_dim, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.cfg.num_layers * self.kv_heads_local * self.cfg.head_dim * self.dtype.itemsize

    @property
    def fused_elementwise(self) -> bool:
        """RMSNorm and RoPE as single Triton kernels (on GPU) instead of ~8 torch ops each."""
        return self.device.type == "cuda" and self.attention.name == "triton"

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_elementwise:
            return rms_norm_triton(x, weight, self.cfg.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.fused_elementwise:
            return rope_triton(x, positions, self.rotary.cos, self.rotary.sin)
        return self.rotary.apply(x, positions)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            dist.all_reduce(x)
        return x

    # --- forward ----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: StepLayout,
                kv: PagedKVCache, logit_rows: torch.Tensor,
                feature_layers: tuple[int, ...] = ()) -> StepOutput:
        """Run every node of the step. KV of the step's nodes is returned, not written:
        the caller commits only the accepted ones."""
        cfg = self.cfg
        D, hq, hkv = cfg.head_dim, self.heads_local, self.kv_heads_local
        T = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        captured: dict[int, torch.Tensor] = {}
        new_k, new_v = [], []
        # Packed once per step, read by every layer.
        attn_plan = self.attention.plan(layout, block_size=kv.block_size, num_q_heads=hq,
                                        num_kv_heads=hkv, device=self.device)
        for i, layer in enumerate(self.layers):
            if i in feature_layers:
                captured[i] = x
            h = self._norm(x, layer["input_norm"])
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
            q = self._rope(q.view(T, hq, D), positions)
            k = self._rope(k.view(T, hkv, D), positions)
            v = v.view(T, hkv, D)
            new_k.append(k)
            new_v.append(v)
            attn = self.attention(q, k, v, kv.k[i], kv.v[i], attn_plan, self.scale)
            o = self._all_reduce(F.linear(attn.reshape(T, hq * D), layer["o"]))
            if layer["o_bias"] is not None:
                o = o + layer["o_bias"]
            x = x + o
            h = self._norm(x, layer["post_norm"])
            gate, up = F.linear(h, layer["gate_up"], layer["gate_up_bias"]).chunk(2, dim=-1)
            m = self._all_reduce(F.linear(F.silu(gate) * up, layer["down"]))
            if layer["down_bias"] is not None:
                m = m + layer["down_bias"]
            x = x + m
        if cfg.num_layers in feature_layers:
            captured[cfg.num_layers] = x
        h = self._norm(x[logit_rows], self.norm)
        logits = F.linear(h, self.lm_head).float()
        features = torch.cat([captured[i] for i in feature_layers], -1) if feature_layers else None
        return StepOutput(new_k, new_v, logits, features)
