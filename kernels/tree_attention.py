"""Attention of a step's tree nodes over a paged KV prefix plus their own ancestors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels._triton import interpreting, tl, triton
from kernels.tree_metadata import TreeAttnMetadata, build_tree_metadata, choose_block_m, metadata_from_layout


@dataclass(frozen=True)
class StepLayout:
    """Where each sequence's nodes sit in the flattened step, and what they see.

    node_starts[r]:node_starts[r]+node_counts[r] are sequence r's rows in q/k/v;
    prefix_slots[r] are the flat cache slots of its committed prefix; masks[r]
    is its [n, n] ancestor-or-self mask (host or device; the reference moves it).

    block_tables[r], optional, are the cache blocks holding that prefix in order
    (prefix_slots[r][t] = block_tables[r][t // block_size] * block_size + t % block_size).
    The Triton backend packs them directly; without them it recovers them from
    the slots, a device-to-host copy and a check per step.
    """

    node_starts: tuple[int, ...]
    node_counts: tuple[int, ...]
    prefix_slots: tuple[torch.Tensor, ...]
    masks: tuple[torch.Tensor, ...]
    block_tables: tuple[Sequence[int], ...] | None = None


def causal_mask(n: int) -> torch.Tensor:
    """The [n, n] ancestor-or-self mask of a run of n consecutive positions, on the host.

    Built by numpy, not torch.ones(...).tril(). On an H100 host (the forty-fourth session's profiles of
    the draft's eager catch-ups) each tril took 4.0 ms for 16 requests' 72-position prompts and 1.8 ms for
    their 190-position wake-ups, and each fill 7 us at 72 positions but 1.7 ms at 190: 56 of the wake-up's
    63 ms of host time. The guess: an OpenMP parallel region per call (tril's at any size, fill's above
    torch's 32,768-element grain), slow to enter on that host; numpy uses no thread pool. On the dev
    machine numpy's is no slower either (190 positions: 9 us against 15-23)."""
    return torch.from_numpy(np.tri(n, dtype=bool))


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cache_k: torch.Tensor, cache_v: torch.Tensor,
                             layout: StepLayout, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cache_k/v: [blocks, block_size, Hkv, D].

    Returns [T, Hq, D]. Each node attends to its sequence's whole committed
    prefix and to the step nodes that are its ancestors or itself.
    """
    flat_k = cache_k.view(-1, *cache_k.shape[2:])
    flat_v = cache_v.view(-1, *cache_v.shape[2:])
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    # Plain matmuls rather than scaled_dot_product_attention: on the CPU its
    # per-call cost (~3 ms with a mask and GQA) dwarfs these tiny problems.
    for start, count, slots, mask in zip(layout.node_starts, layout.node_counts,
                                         layout.prefix_slots, layout.masks, strict=True):
        rows = slice(start, start + count)
        keys = torch.cat((flat_k[slots], k[rows])).float()  # [S, Hkv, D]
        values = torch.cat((flat_v[slots], v[rows])).float()
        visible = torch.cat((torch.ones(count, len(slots), dtype=torch.bool, device=mask.device), mask), 1)
        qg = q[rows].float().view(count, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        scores = torch.matmul(qg, keys.permute(1, 2, 0).unsqueeze(1)) * scale  # [Hkv, G, n, S]
        scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
        attn = torch.matmul(torch.softmax(scores, -1), values.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, n, D]
        out[rows] = attn.permute(2, 0, 1, 3).reshape(count, hq, d).to(q.dtype)
    return out


# --- Triton ---------------------------------------------------------------
#
# One program per (tile of one sequence's nodes, kv head, prefix split). A
# tile's query rows are (node, query head) pairs of one GQA group, so K and V
# are loaded once per group. Keys are visited in two phases with one online
# softmax: the paged prefix (a split's share of it), then the sequence's own
# nodes up to the tile's last node, filtered by the packed ancestor mask. With
# several splits each writes a partial result and its log-sum-exp, and a
# second kernel merges them (flash-decoding).

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT: tl.constexpr):
    # F32_DOT: both matmuls in float32 at IEEE precision (no TF32), for float32
    # inputs; otherwise P is rounded to V's dtype as flash attention does.
    # s: [M, N] logits in log2 units, -inf where not visible.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing visible yet keeps m = -inf; subtract 0 instead
    # so that exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _logits(q, k, qk_scale, F32_DOT: tl.constexpr):
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * qk_scale


# Integer arguments that change from step to step are not specialised: Triton
# compiles a variant per (== 1, % 16 == 0, other) class of each int argument, and
# these classes vary with batch and prefix, so a served step could stop for a
# compile whenever a new combination shows up. Only constexprs pick variants now,
# and warm_up() compiles them all at start-up. The split partials' first strides
# are rows x heads (x head_dim): with 4 query heads their class moved with the rows,
# and the demo target compiled for 1.3-1.4 s three times while serving on an H200.
STEP_SHAPED = ["info_off", "tile_off", "num_splits", "sp_s", "sl_s"]


@triton.jit(do_not_specialize=[*STEP_SHAPED, "bt_stride", "mw_stride"])
def _tree_attention_kernel(
    Q, K, V, KC, VC, Out, PartOut, PartLse, Ints, BlockTable, MaskWords,
    info_off, tile_off, bt_stride, mw_stride,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    skc_b, skc_s, skc_h, svc_b, svc_s, svc_h,
    so_t, so_h, sp_s, sp_t, sp_h, sl_s, sl_t,
    qk_scale, num_splits,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(Ints + tile_off + tile * 3)
    first = tl.load(Ints + tile_off + tile * 3 + 1)
    count = tl.load(Ints + tile_off + tile * 3 + 2)
    active = count > 0  # padding tiles (CUDA-graph buckets) do nothing
    prefix_len = tl.where(active, tl.load(Ints + info_off + seq * 4), 0)
    row0 = tl.load(Ints + info_off + seq * 4 + 1)
    num_nodes = tl.load(Ints + info_off + seq * 4 + 2)
    table = BlockTable + tl.load(Ints + info_off + seq * 4 + 3).to(tl.int64) * bt_stride

    offs_m = tl.arange(0, BLOCK_M)
    node = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = node < count
    row = row0 + first + node
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + row[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: this split's share of the paged prefix (every node sees all of it).
    chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(prefix_len, lo + chunk)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        block = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        within = offs_n % PAGE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + (block * skc_b + within * skc_s + kvh * skc_h)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(VC + (block * svc_b + within * svc_s + kvh * svc_h)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = _logits(q, k, qk_scale, F32_DOT)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT)

    # Phase 2 (last split only): the sequence's own nodes. Ancestors precede
    # descendants, so nodes after the tile's last one are never visible.
    own_hi = tl.where(active & (split == num_splits - 1), tl.minimum(num_nodes, first + count), 0)
    for start in range(0, own_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < own_hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        own = (row0 + offs_n)[:, None]
        k = tl.load(K + own * sk_t + kvh * sk_h + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + own * sv_t + kvh * sv_h + offs_d[None, :], mask=kv_mask, other=0.0)
        words = tl.load(MaskWords + row[:, None] * mw_stride + (offs_n // 64)[None, :],
                        mask=row_ok[:, None] & n_ok[None, :], other=0)
        visible = ((words >> (offs_n % 64).to(tl.int64)[None, :]) & 1) != 0
        s = _logits(q, k, qk_scale, F32_DOT)
        s = tl.where(visible & n_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, F32_DOT)

    out_mask = row_ok[:, None] & d_ok[None, :]
    # Every real row sees itself, so l > 0 there; padding rows, and splits whose
    # share of the prefix is empty, have l = 0 (weight 0 in the merge).
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(PartOut + split * sp_s + row[:, None] * sp_t + head[:, None] * sp_h + offs_d[None, :],
                 out, mask=out_mask)
        tl.store(PartLse + split * sl_s + row * sl_t + head, lse, mask=row_ok)
    else:
        tl.store(Out + row[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=STEP_SHAPED)
def _merge_splits_kernel(
    PartOut, PartLse, Ints, Out, info_off, tile_off,
    sp_s, sp_t, sp_h, sl_s, sl_t, so_t, so_h, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # One program per (tile, query head, node of the tile): a tile's rows merge side by side.
    # (One program per (tile, head) walking the tile's nodes took 15.6 us a layer for a verify
    # tree of 8 nodes on the H200, against 3 us for one node.) Rows outside every tile
    # (padding), and nodes past a tile's count, are never read, so their unwritten partials
    # cannot leak into the output.
    tile = tl.program_id(0)
    head = tl.program_id(1)
    node = tl.program_id(2)
    count = tl.load(Ints + tile_off + tile * 3 + 2)
    if node < count:
        seq = tl.load(Ints + tile_off + tile * 3)
        row = tl.load(Ints + info_off + seq * 4 + 1) + tl.load(Ints + tile_off + tile * 3 + 1) + node
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < num_splits
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        lse = tl.load(PartLse + offs_s * sl_s + row * sl_t + head, mask=s_ok, other=float("-inf"))
        # The last split holds the node itself, so the maximum is finite.
        w = tl.where(s_ok, tl.exp2(lse - tl.max(lse, 0)), 0.0)
        part = tl.load(PartOut + offs_s[:, None] * sp_s + row * sp_t + head * sp_h + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(Out + row * so_t + head * so_h + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cache_k: torch.Tensor, cache_v: torch.Tensor,
                          meta: TreeAttnMetadata | StepLayout, scale: float,
                          *, block_n: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as tree_attention_reference; `meta` is the step's packed
    metadata (build it once per step and pass it to every layer) or a StepLayout,
    packed here. `out` ([T, Hq, D], last dim contiguous) receives the result if given;
    only rows of the step's nodes are written."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if isinstance(meta, StepLayout):
        meta = metadata_from_layout(meta, block_size=cache_k.shape[1], num_q_heads=Hq, num_kv_heads=Hkv,
                                    device=q.device)
    if meta.block_size != cache_k.shape[1]:
        raise ValueError(f"metadata for block size {meta.block_size}, cache has {cache_k.shape[1]}")
    if meta.group * Hkv != Hq or cache_k.shape[2] != Hkv:
        raise ValueError(f"metadata for {meta.group} query heads per kv head; q has {Hq}, k {Hkv}, "
                         f"cache {cache_k.shape[2]}")
    q, k, v, cache_k, cache_v = (x if x.stride(-1) == 1 else x.contiguous()
                                 for x in (q, k, v, cache_k, cache_v))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim")
    if T == 0:
        return out
    splits = meta.num_splits
    if splits > 1:
        part = torch.empty(splits, T, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, T, Hq, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel
        part, lse = out, out
    block_d = max(16, triton.next_power_of_2(D))
    # Keys per iteration. Measured on an H200 (bf16, D=128, prefix 1k): 32 is
    # faster for decode tiles (16 rows) at batch 64-128, 64 for verify tiles.
    # float32 tiles of 64 rows overflow shared memory at 64 keys.
    if block_n is None:
        block_n = 64 if block_d <= 128 and q.element_size() <= 2 and meta.block_m > 16 else 32
    # The interpreter (triton 3.9) multiplies bf16 dot operands as raw bits, so
    # there bf16 dots run in float32 too.
    f32_dot = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
    info_off, tile_off = meta.info_off, meta.tile_off
    if meta.block_table.stride(-1) != 1:
        raise ValueError("the block table's last dim must be contiguous")
    _tree_attention_kernel[(meta.num_tiles, Hkv, splits)](
        q, k, v, cache_k, cache_v, out, part, lse, meta.ints, meta.block_table, meta.mask_words,
        info_off, tile_off, meta.block_table.stride(0), meta.mask_words.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        out.stride(0), out.stride(1),
        part.stride(0) if splits > 1 else 0, part.stride(1), part.stride(2) if splits > 1 else 0,
        lse.stride(0) if splits > 1 else 0, lse.stride(1),
        scale * LOG2E, splits,
        GROUP=meta.group, BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_D=block_d, HEAD_DIM=D,
        PAGE=meta.block_size, SPLIT=splits > 1, F32_DOT=f32_dot,
        num_warps=4,
    )
    if splits > 1:
        _merge_splits_kernel[(meta.num_tiles, Hq, meta.nodes_per_tile)](
            part, lse, meta.ints, out, info_off, tile_off,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
            HEAD_DIM=D, num_warps=4,
        )
    return out


def warm_up(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
            device: torch.device | str) -> int:
    """Compile every kernel variant a model with these shapes can need (tile heights, with
    and without prefix splits, each merge width), so no served step waits for Triton.
    Returns the number of variants run."""
    device = torch.device(device)
    group = num_q_heads // num_kv_heads
    cache_k = torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache_v = torch.zeros_like(cache_k)
    prefix = 3 * block_size
    runs = 0
    for block_m in sorted({choose_block_m(n, group) for n in (1, 8, 16, 64, 1024)}):
        nodes = max(1, block_m // group)
        q = torch.zeros(nodes, num_q_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(nodes, num_kv_heads, head_dim, dtype=dtype, device=device)
        mask = causal_mask(nodes)
        for splits in (1, 2, 4, 8, 16, 32):
            meta = build_tree_metadata([[0, 1, 2]], [prefix], [0], [mask], block_size=block_size,
                                       num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, device=device,
                                       num_splits=splits, block_m=block_m)
            tree_attention_triton(q, k, k, cache_k, cache_v, meta, 1.0)
            runs += 1
    return runs
