"""Batch-invariant tree attention: a node's result is bitwise the plain-decode result.

A node at depth d below a prefix of P committed tokens sees P + d keys: the
prefix, then its ancestors in depth order (itself last). Decoding the same
token plainly, after its ancestors were committed, it sees the same keys with
the same values, only stored differently (all but itself in the cache). This
kernel visits every node's keys as that one logical sequence, in tiles of
BLOCK_N aligned to position 0, one node per program iteration: the reduction
of a node never depends on the other nodes in the step, on how its keys are
split between cache and step, or on the tree around it. So a verify step
computes each accepted node exactly as plain decoding would (issue 19), and a
row alone equals the row among others.

kernels.tree_attention is faster (several nodes per tile, flash-decoding
splits chosen by shape) and stays the default.

Which own nodes a node sees, in depth order, comes from the packed ancestor
masks of TreeAttnMetadata (ancestor_tails): a leading chain 0..c-1 (a prompt
chunk, or the tokens given unconditionally, and any run of a tree that
continues it), then at most MAX_TAIL further ancestors listed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import interpreting, tl, triton
from kernels.tree_attention import LOG2E, StepLayout, _logits, _online_softmax_step
from kernels.tree_metadata import TreeAttnMetadata, metadata_from_layout

# Keys per tile: fixed, since it sets the reduction order.
BLOCK_N = 32
# Ancestors past a node's leading chain that can be listed. Step items are a chain of
# given tokens and a drafted tree below it, so this bounds the drafted tree's depth
# (the engine checks it; a draft tree's depth is ~10).
MAX_TAIL = 64


@dataclass(frozen=True)
class AncestorTails:
    """Per step row: the own nodes it sees, in depth order, as chain[i] (it sees
    nodes 0..chain[i]-1) followed by tail[i, :depth[i] - chain[i]]."""

    chain: torch.Tensor  # int32 [rows]
    depth: torch.Tensor  # int32 [rows]: own nodes seen, itself included
    tail: torch.Tensor  # int32 [rows, MAX_TAIL]


def ancestor_tails(mask_words: torch.Tensor, max_tail: int = MAX_TAIL) -> AncestorTails:
    """From the packed masks ([rows, W] int64, bit j of row i: i sees own node j), with
    torch ops of fixed shapes on the masks' device (a CUDA graph can capture them)."""
    rows, words = mask_words.shape
    shifts = torch.arange(64, device=mask_words.device, dtype=torch.int64)
    bits = ((mask_words.unsqueeze(-1) >> shifts) & 1).reshape(rows, words * 64)
    chain = torch.cumprod(bits, 1).sum(1)
    cols = torch.arange(words * 64, device=mask_words.device)
    rest = bits.bool() & (cols >= chain[:, None])
    rank = torch.cumsum(rest, 1) - 1
    # Entries past max_tail (and every column that is not a tail ancestor) land in a
    # spare column that is dropped; the engine rejects trees that would need them.
    where = torch.where(rest & (rank < max_tail), rank, max_tail)
    tail = torch.zeros(rows, max_tail + 1, dtype=torch.int64, device=mask_words.device)
    tail.scatter_(1, where, cols.expand(rows, -1))
    return AncestorTails(chain=chain.to(torch.int32), depth=bits.sum(1).to(torch.int32),
                         tail=tail[:, :max_tail].to(torch.int32).contiguous())


@triton.jit(do_not_specialize=["info_off", "tile_off", "bt_stride", "tail_stride"])
def _invariant_attention_kernel(
    Q, K, V, KC, VC, Out, Ints, BlockTable, Chain, Depth, Tail,
    info_off, tile_off, bt_stride, tail_stride,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    skc_b, skc_s, skc_h, svc_b, svc_s, svc_h, so_t, so_h,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, F32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(Ints + tile_off + tile * 3)
    first = tl.load(Ints + tile_off + tile * 3 + 1)
    count = tl.load(Ints + tile_off + tile * 3 + 2)  # 0 for padding tiles: the loop below is empty
    prefix_len = tl.load(Ints + info_off + seq * 4)
    row0 = tl.load(Ints + info_off + seq * 4 + 1)
    table = BlockTable + tl.load(Ints + info_off + seq * 4 + 3).to(tl.int64) * bt_stride

    offs_m = tl.arange(0, BLOCK_M)
    head_ok = offs_m < GROUP
    head = kvh * GROUP + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for node in range(0, count):
        row = row0 + first + node
        q = tl.load(Q + row * sq_t + head[:, None] * sq_h + offs_d[None, :],
                    mask=head_ok[:, None] & d_ok[None, :], other=0.0)
        chain = tl.load(Chain + row)
        length = prefix_len + tl.load(Depth + row)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, length, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            ok = pos < length
            cached = ok & (pos < prefix_len)
            own = pos - prefix_len  # depth - 1 of the ancestor at this position
            from_tail = ok & (own >= chain)
            listed = tl.load(Tail + row * tail_stride + (own - chain), mask=from_tail, other=0)
            own_row = (row0 + tl.where(from_tail, listed, own)).to(tl.int64)
            block = tl.load(table + pos // PAGE, mask=cached, other=0).to(tl.int64)
            within = pos % PAGE
            c_mask = cached[:, None] & d_ok[None, :]
            s_mask = (ok & ~cached)[:, None] & d_ok[None, :]
            # Each position's key and value come from the cache or from the step, never both.
            k = tl.where(cached[:, None],
                         tl.load(KC + (block * skc_b + within * skc_s + kvh * skc_h)[:, None] + offs_d[None, :],
                                 mask=c_mask, other=0.0),
                         tl.load(K + own_row[:, None] * sk_t + kvh * sk_h + offs_d[None, :], mask=s_mask,
                                 other=0.0))
            v = tl.where(cached[:, None],
                         tl.load(VC + (block * svc_b + within * svc_s + kvh * svc_h)[:, None] + offs_d[None, :],
                                 mask=c_mask, other=0.0),
                         tl.load(V + own_row[:, None] * sv_t + kvh * sv_h + offs_d[None, :], mask=s_mask,
                                 other=0.0))
            s = _logits(q, k, qk_scale, F32_DOT)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + row * so_t + head[:, None] * so_h + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=head_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class InvariantPlan:
    """One step's metadata plus its ancestor lists, shared by every layer."""

    meta: TreeAttnMetadata
    tails: AncestorTails


def plan_invariant(meta: TreeAttnMetadata) -> InvariantPlan:
    return InvariantPlan(meta=meta, tails=ancestor_tails(meta.mask_words))


def tree_attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cache_k: torch.Tensor, cache_v: torch.Tensor,
                             plan: InvariantPlan | TreeAttnMetadata | StepLayout, scale: float) -> torch.Tensor:
    """Same contract as tree_attention_reference, each node's result independent of the
    rest of the step (see the module's docstring)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if isinstance(plan, StepLayout):
        plan = metadata_from_layout(plan, block_size=cache_k.shape[1], num_q_heads=Hq, num_kv_heads=Hkv,
                                    device=q.device)
    if isinstance(plan, TreeAttnMetadata):
        plan = plan_invariant(plan)
    meta, tails = plan.meta, plan.tails
    if meta.block_size != cache_k.shape[1] or meta.group * Hkv != Hq or cache_k.shape[2] != Hkv:
        raise ValueError(f"metadata for block size {meta.block_size} and {meta.group} query heads per kv "
                         f"head; cache {tuple(cache_k.shape)}, q {Hq} heads, k {Hkv}")
    q, k, v, cache_k, cache_v = (x if x.stride(-1) == 1 else x.contiguous()
                                 for x in (q, k, v, cache_k, cache_v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    f32_dot = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
    _invariant_attention_kernel[(meta.num_tiles, Hkv)](
        q, k, v, cache_k, cache_v, out, meta.ints, meta.block_table, tails.chain, tails.depth, tails.tail,
        meta.info_off, meta.tile_off, meta.block_table.stride(0), tails.tail.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), out.stride(0), out.stride(1),
        scale * LOG2E,
        GROUP=meta.group, BLOCK_M=max(16, triton.next_power_of_2(meta.group)), BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)), HEAD_DIM=D, PAGE=meta.block_size, F32_DOT=f32_dot,
        num_warps=4,
    )
    return out
