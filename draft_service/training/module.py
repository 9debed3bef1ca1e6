"""The EAGLE-3 draft as a trainable torch module, unrolled for training-time test.

Its state_dict holds exactly the tensors of SGLang/SpecForge's checkpoint
(fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d); the target's
embedding is a frozen, non-persistent buffer, so it is never exported. The
math is draft_service.model.Eagle3Draft's (same rms_norm, same RoPE tables);
tests check that a step of this module equals Eagle3Draft on the export.

Training-time test (TTT), as SpecForge runs it. Step 0 is the ordinary
forward: row t pairs g_t = fc(features of token t) with token t+1 at
position t and predicts token t+2. Step k >= 1 feeds row t the pre-norm h
that step k-1 produced in row t, pairs it with the ground-truth token t+1+k,
runs at position t+k, and predicts token t+2+k. Row t of step k attends to
step 0's rows 0..t and to its own row in steps 1..k: exactly what a chain
node at depth k below a root at position t+1 sees at inference (the committed
prefix, then its ancestors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers import Rotary, rms_norm
from tandem.model_config import RopeConfig


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    num_feature_layers: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "draft_vocab_size", "target_vocab_size", "num_feature_layers", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"draft shape: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft shape: num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft vocabulary ({self.draft_vocab_size}) exceeds the target's "
                             f"({self.target_vocab_size})")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.q_proj = nn.Linear(2 * s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Attention of TTT step k = len(cache) - 1.

    q: [B, T, heads, D]; cache[j] = (K_j, V_j), [B, T, kv_heads, D], of steps 0..k.
    Row t sees K_0[0..t] (causal) and K_j[t] for j = 1..k (its chain of ancestors).
    """
    B, T, hq, D = q.shape
    group = hq // cache[0][0].shape[2]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, kv, D] -> [B, hq, T, D]; head i reads kv head i // group
        return x.repeat_interleave(group, dim=2).transpose(1, 2)

    qh = q.transpose(1, 2)
    k0, v0 = heads(cache[0][0]), heads(cache[0][1])
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = (qh @ k0.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [((qh * heads(k)).sum(-1).float() * scale).unsqueeze(-1) for k, _ in cache[1:]]  # [B, hq, T, 1]
    probs = torch.softmax(torch.cat([scores, *diag], -1), -1).to(q.dtype)
    out = probs[..., :T] @ v0
    for j, (_, v) in enumerate(cache[1:]):
        out = out + probs[..., T + j, None] * heads(v)
    return out.transpose(1, 2)  # [B, T, hq, D]


class Eagle3TrainModel(nn.Module):
    def __init__(self, shape: DraftShape, embed_tokens: torch.Tensor, target_ids: torch.Tensor):
        """embed_tokens: the target's [target_vocab, H] embedding (frozen, not exported).
        target_ids: int64 [draft_vocab], the target id of each draft id, ascending."""
        super().__init__()
        s = self.shape = shape
        if tuple(embed_tokens.shape) != (s.target_vocab_size, s.hidden_size):
            raise ValueError(f"target embedding is {list(embed_tokens.shape)}, expected "
                             f"[{s.target_vocab_size}, {s.hidden_size}]")
        if target_ids.shape != (s.draft_vocab_size,):
            raise ValueError(f"target_ids has shape {list(target_ids.shape)}, expected [{s.draft_vocab_size}]")
        device = embed_tokens.device
        self.fc = nn.Linear(s.num_feature_layers * s.hidden_size, s.hidden_size, bias=False)
        self.midlayer = _MidLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        target_ids = target_ids.long().cpu()
        t2d = torch.zeros(s.target_vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        # SGLang's layout: target_id = draft_id + d2t[draft_id]; t2d marks target ids in the draft vocabulary.
        self.register_buffer("d2t", target_ids - torch.arange(s.draft_vocab_size))
        self.register_buffer("t2d", t2d)
        self.register_buffer("embed_tokens", embed_tokens.detach().float(), persistent=False)
        self.to(device)
        self.rotary = Rotary(s.head_dim, RopeConfig(theta=s.rope_theta), s.max_position + 64, device)
        self.scale = s.head_dim ** -0.5

    @property
    def target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.shape.draft_vocab_size, device=self.d2t.device)

    def init_lm_head_from(self, target_lm_head: torch.Tensor) -> None:
        """Start from the target's output rows of the draft vocabulary: a head that already
        maps a final hidden state to sensible tokens (the draft's h is trained towards it)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head[self.target_ids].float())

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def step(self, next_tokens: torch.Tensor, g: torch.Tensor, position_offset: int,
             cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One TTT step over [B, T] rows: appends this step's (K, V) to cache, returns pre-norm h."""
        s, layer = self.shape, self.midlayer
        B, T = next_tokens.shape
        e = F.embedding(next_tokens, self.embed_tokens).to(g.dtype)
        x = torch.cat((layer.input_layernorm(e), layer.hidden_norm(g)), -1)
        attn = layer.self_attn
        q = attn.q_proj(x).view(B, T, s.num_heads, s.head_dim)
        k = attn.k_proj(x).view(B, T, s.num_kv_heads, s.head_dim)
        v = attn.v_proj(x).view(B, T, s.num_kv_heads, s.head_dim)
        positions = torch.arange(T, device=x.device) + position_offset
        q, k = self.rotary.apply(q, positions), self.rotary.apply(k, positions)
        cache.append((k, v))
        h = g + attn.o_proj(ttt_attention(q, cache, self.scale).reshape(B, T, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))
