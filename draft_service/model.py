"""The EAGLE-3 draft head: weights in SGLang/SpecForge's format, and its forward.

Forward for draft position t (DESIGN section 3):
    g = fc(cat(low, mid, high))          target features of token t, or the
                                         previous position's pre-norm h
    x = cat(input_layernorm(embed(tok[t+1])), hidden_norm(g))     width 2H
    h = g + o_proj(attn(x))
    h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))            over the draft vocabulary
The pre-norm h is the next position's g when no features are at hand: what
tree drafting does below the root, and what "training-time test" trains.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from draft_service.config import load_draft_config
from draft_service.types import MAX_STEPS
from kernels.activation import silu_mul_triton
from kernels.backend import get_attention_backend
from kernels.rmsnorm import add_rms_norm_triton, rms_norm_triton
from kernels.rope import rope_qkv_triton, rope_triton
from kernels.tree_attention import StepLayout
from tandem.kv_cache import PagedKVCache
from tandem.layers import Rotary, SafetensorsDir, rms_norm
from tandem.model_config import ModelLoadError, load_llama_config


def _named(w: SafetensorsDir, name: str) -> str:
    # SpecForge writes bare names (fc.weight, midlayer.*); some exports prefix
    # "model." as SGLang's module tree does. SGLang accepts both; so do we.
    return name if name in w or f"model.{name}" not in w else f"model.{name}"


class Eagle3Draft:
    def __init__(self, draft_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attention_backend: str | None = None):
        target_cfg = load_llama_config(target_dir)
        self.cfg = cfg = load_draft_config(draft_dir, target_cfg)
        self.device = torch.device(device)
        self.dtype = dtype
        layer = cfg.layer
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.scale = layer.head_dim ** -0.5
        # Tree levels run past the last committed position; the target bounds the sequence.
        self.max_position = max(layer.max_position, target_cfg.max_position) + MAX_STEPS
        self.rotary = Rotary(layer.head_dim, layer.rope, self.max_position, self.device)
        # "torch" | "triton"; None picks the device's default (kernels.backend).
        self.attention = get_attention_backend(attention_backend, self.device)
        self._load(SafetensorsDir(draft_dir), SafetensorsDir(target_dir), target_cfg.tie_word_embeddings)

    # --- weights ----------------------------------------------------------
    def _load(self, w: SafetensorsDir, target: SafetensorsDir, target_tied: bool) -> None:
        cfg, layer = self.cfg, self.cfg.layer
        H, D, I = layer.hidden_size, layer.head_dim, layer.intermediate_size
        hq, hkv = layer.num_heads * D, layer.num_kv_heads * D

        def get(name: str, shape: tuple[int, ...], source: SafetensorsDir = w) -> torch.Tensor:
            return source.get(_named(source, name), shape).to(device=self.device, dtype=self.dtype)

        # The draft has no embeddings of its own: it reads the target's.
        if cfg.target_hidden_size != H:
            raise ModelLoadError(f"the draft's hidden_size ({H}) differs from the target's ({cfg.target_hidden_size}):"
                                 f" the draft embeds tokens with the target's embed_tokens, so they must match")
        self.embed = get("embed_tokens.weight", (cfg.target_vocab_size, H), target)
        self.fc = get("fc.weight", (H, cfg.feature_width))
        self.fc_bias = get("fc.bias", (H,)) if cfg.fc_bias else None
        p = "midlayer."
        self.input_norm = get(p + "input_layernorm.weight", (H,))
        self.hidden_norm = get(p + "hidden_norm.weight", (H,))
        self.post_norm = get(p + "post_attention_layernorm.weight", (H,))
        self.qkv = torch.cat([get(p + "self_attn.q_proj.weight", (hq, 2 * H)),
                              get(p + "self_attn.k_proj.weight", (hkv, 2 * H)),
                              get(p + "self_attn.v_proj.weight", (hkv, 2 * H))])
        self.o = get(p + "self_attn.o_proj.weight", (H, hq))
        self.gate_up = torch.cat([get(p + "mlp.gate_proj.weight", (I, H)),
                                  get(p + "mlp.up_proj.weight", (I, H))])
        self.down = get(p + "mlp.down_proj.weight", (H, I))
        self.norm = get("norm.weight", (H,))
        self.lm_head = self._load_lm_head(w, target, target_tied, get)
        self.d2t = self._load_vocab_map(w)

    def _load_lm_head(self, w, target, target_tied, get) -> torch.Tensor:
        cfg, H = self.cfg, self.cfg.hidden_size
        if cfg.layer.tie_word_embeddings:
            if not cfg.full_vocab:
                raise ModelLoadError("tie_word_embeddings needs the full vocabulary, but draft_vocab_size is "
                                     f"{cfg.draft_vocab_size} of {cfg.target_vocab_size}")
            return self.embed
        if _named(w, "lm_head.weight") in w or not cfg.full_vocab:
            return get("lm_head.weight", (cfg.draft_vocab_size, H))
        # A full-vocabulary draft without its own head borrows the target's (as SGLang does).
        if "lm_head.weight" in target and not target_tied:
            return get("lm_head.weight", (cfg.target_vocab_size, H), target)
        return self.embed

    def _load_vocab_map(self, w: SafetensorsDir) -> torch.Tensor:
        """d2t as absolute target ids: target_id = draft_id + d2t[draft_id]."""
        cfg = self.cfg
        ids = torch.arange(cfg.draft_vocab_size)
        if _named(w, "d2t") not in w and cfg.full_vocab:
            return ids.to(self.device)
        d2t = w.get(_named(w, "d2t"), (cfg.draft_vocab_size,))
        if d2t.dtype not in (torch.int64, torch.int32):
            raise ModelLoadError(f"tensor 'd2t' has dtype {d2t.dtype}, expected int64")
        target_ids = ids + d2t.long()
        if target_ids.min() < 0 or target_ids.max() >= cfg.target_vocab_size:
            raise ModelLoadError(f"tensor 'd2t' maps draft ids outside the target vocabulary "
                                 f"[0, {cfg.target_vocab_size})")
        if target_ids.unique().numel() != target_ids.numel():
            raise ModelLoadError("tensor 'd2t' maps two draft ids to the same target id")
        if _named(w, "t2d") in w:
            t2d = w.get(_named(w, "t2d"), (cfg.target_vocab_size,)).bool()
            if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[target_ids].all()):
                raise ModelLoadError("tensors 't2d' and 'd2t' disagree about which target ids the draft "
                                     "vocabulary holds")
        return target_ids.to(self.device)

    # --- cache ------------------------------------------------------------
    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(1, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    # --- forward, in three parts so tree levels can reuse earlier nodes' K/V ---
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """g = fc(features): [T, feature_width] -> [T, H]."""
        return F.linear(features.to(device=self.device, dtype=self.dtype), self.fc, self.fc_bias)

    @property
    def _fused(self) -> bool:
        # On GPU one Triton kernel instead of several torch ops: the draft's levels are launch-bound.
        return self.device.type == "cuda" and self.attention.name == "triton"

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused:
            return rms_norm_triton(x, weight, self.cfg.layer.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.layer.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._fused:
            return rope_triton(x, positions, self.rotary.cos, self.rotary.sin)
        return self.rotary.apply(x, positions)

    def _qkv(self, next_tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v projection before RoPE: [T, (heads + 2 kv_heads) * D]. next_tokens are target ids."""
        e = F.embedding(next_tokens, self.embed)
        return F.linear(torch.cat((self._norm(e, self.input_norm), self._norm(g, self.hidden_norm)), -1), self.qkv)

    def attention_inputs(self, next_tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] after RoPE. next_tokens are target ids."""
        T, D = next_tokens.shape[0], self.head_dim
        q, k, v = self._qkv(next_tokens, g).split(
            [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q = self._rope(q.reshape(T, self.num_heads, D), positions)
        k = self._rope(k.reshape(T, self.num_kv_heads, D), positions)
        return q, k, v.reshape(T, self.num_kv_heads, D)

    def attention_inputs_into(self, next_tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                              q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                              rows: torch.Tensor) -> None:
        """attention_inputs' q, k and v, token t's written to row rows[t] of q_out [N, heads, D], k_out and
        v_out [N, kv_heads, D]: RoPE and the three writes in one Triton kernel (the tree growth's fused
        levels: a level's nodes go straight to their slots)."""
        rope_qkv_triton(self._qkv(next_tokens, g), positions, self.rotary.cos, self.rotary.sin, self.num_heads,
                        self.num_kv_heads, k_out, v_out, q_out=q_out, rows=rows)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
               kv: PagedKVCache) -> torch.Tensor:
        # One layer: the plan (kernel metadata) is used once per call.
        plan = self.attention.plan(layout, block_size=kv.block_size, num_q_heads=self.num_heads,
                                   num_kv_heads=self.num_kv_heads, device=self.device)
        return self.attention(q, k, v, kv.k[0], kv.v[0], plan, self.scale)

    def finish(self, attn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The pre-norm hidden state h from the attention output and g."""
        o = F.linear(attn.reshape(attn.shape[0], -1), self.o)
        if self._fused:  # the residual add with the norm, silu with the product: two launches fewer
            h, normed = add_rms_norm_triton(o, g, self.post_norm, self.cfg.layer.rms_norm_eps)
            return h + F.linear(silu_mul_triton(F.linear(normed, self.gate_up)), self.down)
        h = g + o
        gate, up = F.linear(self._norm(h, self.post_norm), self.gate_up).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, self.down)

    def forward(self, next_tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                layout: StepLayout, kv: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, h) of every row; K/V are returned, not written (the caller decides what to keep)."""
        q, k, v = self.attention_inputs(next_tokens, g, positions)
        return k, v, self.finish(self.attend(q, k, v, layout, kv), g)

    def logprobs(self, h: torch.Tensor) -> torch.Tensor:
        """float32 log-probs over the draft vocabulary: [T, draft_vocab]."""
        # dtype= converts inside the kernel: no float32 copy of the logits first.
        return torch.log_softmax(F.linear(self._norm(h, self.norm), self.lm_head), -1, dtype=torch.float32)
