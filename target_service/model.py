"""A Llama-family decoder that runs a step's token trees over a paged KV cache.

Tensor parallel in the Megatron style: q/k/v and gate/up are split by output
(column-parallel), o_proj and down_proj by input (row-parallel, then an
all-reduce). The lm_head is split by vocabulary: each rank computes its slice
of the logits and one all-gather assembles them (each rank reads 1/N of the
head's weights, 1 GB at Llama-3.1-8B's 128k vocabulary). The embedding is
replicated (a lookup reads only the step's rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.activation import silu_mul_reference, silu_mul_triton
from kernels.backend import get_attention_backend
from kernels.l2_prefetch import WeightPrefetch
from kernels.matmul import linear_invariant
from kernels.rmsnorm import add_rms_norm_triton, rms_norm_triton
from kernels.rope import rope_qkv_reference, rope_qkv_triton
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


def _no_prefetch(_weight: torch.Tensor) -> None:
    """LlamaModel.forward's prefetch where L2 prefetch is off."""


@dataclass
class StepOutput:
    # float32 logits [len(logit_rows), vocab].
    logits: torch.Tensor
    # [T, len(feature_layers) * hidden] or None.
    features: torch.Tensor | None


class LlamaModel:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", tp: ParallelSpec | None = None,
                 attention_backend: str | None = None, batch_invariant: bool = False):
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
        # Asks L2 for each GEMM's weight while the kernels before it run (kernels.l2_prefetch); None: off.
        self.weight_prefetch: WeightPrefetch | None = None
        self.choose_kernels(attention_backend, batch_invariant)
        self._load(SafetensorsDir(model_dir), kv_start)

    def choose_kernels(self, attention_backend: str | None, batch_invariant: bool) -> None:
        """attention_backend: "torch" | "triton" | "flashinfer"; None picks the device's default
        (kernels.backend). batch_invariant: every row's result independent of the rest of the
        step (Triton matmuls, tree attention and norms; all-reduces in rank order), so that
        speculation and batching cannot change greedy output in bf16 (--deterministic)."""
        self.batch_invariant = batch_invariant
        self.attention = get_attention_backend(attention_backend, self.device, batch_invariant=batch_invariant)
        self.linear = linear_invariant if batch_invariant else F.linear

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
        # This rank's rows of the lm_head; the last rank's are padded with zeros to the same count
        # (all_gather takes equal parts), and the padding's logits are cut off after the gather.
        V, shard = cfg.vocab_size, self.vocab_shard
        v0, v1 = min(r * shard, V), min((r + 1) * shard, V)
        if "lm_head.weight" in w and not cfg.tie_word_embeddings:
            lm_head = get("lm_head.weight", (V, H), 0, v0, v1) if self.tp.size > 1 else get("lm_head.weight", (V, H))
        else:
            lm_head = self.embed[v0:v1]
        if lm_head.shape[0] < shard:
            lm_head = torch.cat((lm_head, lm_head.new_zeros(shard - lm_head.shape[0], H)))
        self.lm_head = lm_head

    @property
    def vocab_shard(self) -> int:
        """lm_head rows (logit columns) per rank."""
        return -(-self.cfg.vocab_size // self.tp.size)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.cfg.num_layers, num_blocks, block_size, self.kv_heads_local,
                            self.cfg.head_dim, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.cfg.num_layers * self.kv_heads_local * self.cfg.head_dim * self.dtype.itemsize

    @property
    def fused_elementwise(self) -> bool:
        """RMSNorm (fused with the residual add), RoPE (fused with the K/V scratch write) and
        the MLP's activation as single Triton kernels on GPU, instead of several torch ops each."""
        # With the triton backend on CPU (TRITON_INTERPRET=1, tests) the same kernels run interpreted.
        return self.attention.name == "triton"

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_elementwise:
            return rms_norm_triton(x, weight, self.cfg.rms_norm_eps)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return x
        if not self.batch_invariant:
            dist.all_reduce(x)
            return x
        # NCCL picks its reduction algorithm (ring, tree; the chunking) by message size,
        # which follows the batch: gather every rank's part and add them in rank order.
        parts = [torch.empty_like(x) for _ in range(self.tp.size)]
        dist.all_gather(parts, x)
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the logits, side by side: [rows, vocab]."""
        if self.tp.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, -1)[:, : self.cfg.vocab_size]

    # --- forward ----------------------------------------------------------
    def _qkv_heads(self, qkv: torch.Tensor, positions: torch.Tensor, layer: int,
                   scratch: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q, k and v of one layer; k and v land in the step's K/V scratch when given."""
        hq, hkv, T = self.heads_local, self.kv_heads_local, qkv.shape[0]
        k_out = scratch[0][layer, :T] if scratch is not None else None
        v_out = scratch[1][layer, :T] if scratch is not None else None
        if self.fused_elementwise:
            return rope_qkv_triton(qkv, positions, self.rotary.cos, self.rotary.sin, hq, hkv, k_out, v_out)
        q, k, v = rope_qkv_reference(qkv, positions, self.rotary.cos, self.rotary.sin, hq, hkv)
        if scratch is None:
            return q, k, v
        k_out.copy_(k)
        v_out.copy_(v)
        return q, k_out, v_out

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_elementwise:
            return add_rms_norm_triton(x, residual, weight, self.cfg.rms_norm_eps)
        x = x + residual
        return x, rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul_triton(gate_up) if self.fused_elementwise else silu_mul_reference(gate_up)

    def new_scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V scratch for a step of up to `rows` nodes: [layers, rows, kv_heads, head_dim] each."""
        shape = (self.cfg.num_layers, rows, self.kv_heads_local, self.cfg.head_dim)
        return (torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, layout: StepLayout,
                kv: PagedKVCache, logit_rows: torch.Tensor,
                feature_layers: tuple[int, ...] = (),
                scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepOutput:
        """Run every node of the step. The cache is not written: with `scratch`
        (new_scratch) each layer's K/V of the nodes lands there, rows 0..T-1, and the
        caller commits only the accepted ones."""
        cfg = self.cfg
        D, hq, hkv = cfg.head_dim, self.heads_local, self.kv_heads_local
        T = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        captured: dict[int, torch.Tensor] = {}
        # Packed once per step, read by every layer.
        attn_plan = self.attention.plan(layout, block_size=kv.block_size, num_q_heads=hq,
                                        num_kv_heads=hkv, device=self.device)
        residual = None  # what the last sublayer adds to x; folded into the next norm
        prefetch = self.weight_prefetch.next if self.weight_prefetch is not None else _no_prefetch
        # Each GEMM's weight is asked for once the GEMM before it is enqueued (see kernels.l2_prefetch).
        prefetch(self.layers[0]["qkv"] if self.layers else self.lm_head)
        h = self._norm(x, self.layers[0]["input_norm"]) if self.layers else x
        for i, layer in enumerate(self.layers):
            if residual is not None:
                x, h = self._add_norm(x, residual, layer["input_norm"])
            if i in feature_layers:
                captured[i] = x
            qkv = self.linear(h, layer["qkv"], layer["qkv_bias"])
            prefetch(layer["o"])
            q, k, v = self._qkv_heads(qkv, positions, i, scratch)
            attn = self.attention(q, k, v, kv.k[i], kv.v[i], attn_plan, self.scale)
            o = self._all_reduce(self.linear(attn.reshape(T, hq * D), layer["o"]))
            prefetch(layer["gate_up"])
            if layer["o_bias"] is not None:
                o = o + layer["o_bias"]
            x, h = self._add_norm(x, o, layer["post_norm"])
            gate_up = self.linear(h, layer["gate_up"], layer["gate_up_bias"])
            prefetch(layer["down"])
            m = self._all_reduce(self.linear(self._act(gate_up), layer["down"]))
            prefetch(self.layers[i + 1]["qkv"] if i + 1 < len(self.layers) else self.lm_head)
            if layer["down_bias"] is not None:
                m = m + layer["down_bias"]
            residual = m
        if residual is not None:
            x = x + residual
        if cfg.num_layers in feature_layers:
            captured[cfg.num_layers] = x
        h = self._norm(x[logit_rows], self.norm)
        logits = self._gather_vocab(self.linear(h, self.lm_head)).float()
        if self.weight_prefetch is not None:
            self.weight_prefetch.join()
        features = torch.cat([captured[i] for i in feature_layers], -1) if feature_layers else None
        return StepOutput(logits, features)
