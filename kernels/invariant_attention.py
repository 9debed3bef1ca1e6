"""Batch-invariant tree attention: a node's result is bitwise the plain-decode result.

A node at depth d below a prefix of P committed tokens sees P + d keys: the
prefix, then its ancestors in depth order (itself last). Decoding the same
token plainly, after its ancestors were committed, it sees the same keys with
the same values, only stored differently (all but itself in the cache). This
kernel visits every row's keys as that one logical sequence, its "virtual
sequence", in tiles of BLOCK_N aligned to position 0: the reduction of a row
never depends on the other rows in the step, on how its keys are split between
cache and step, or on the tree around it. So a verify step computes each
accepted node exactly as plain decoding would (issue 19), and a row alone
equals the row among others.

Each (row, kv head) is its own problem, with flash-decoding splits at fixed
positions of its virtual sequence: split s covers [s * L, (s + 1) * L), where L
is SPLIT_LEN, doubled until the row needs at most MAX_SPLITS splits. L and the
split count follow from the row's own length only, never from the batch, so a
tree node and the same token decoded plainly (same length) split alike. Each
split's partial (running max, sum, unnormalised accumulator; float32) is
folded into the row's result in the order s = 0, 1, .. by _fold_split.

Which program computes what is chosen from the launch's shape, and never
changes what is computed:

- with rows enough to fill the GPU, one program per (row, kv head) runs the
  row's splits one after the other and folds each as it ends;
- with few rows, P programs share a row's splits (p takes p, p + P, ..) and
  write their partials to a workspace; a second kernel folds them, in the same
  order with the same function (float32 partials go through memory exactly).

Several rows per program (ROWS_PER_PROGRAM > 1, _invariant_rows_kernel): a
program's BLOCK_M M-rows are R rows of one sequence x GROUP query heads (for
Llama-8B, 4 tree nodes x 4 heads fill the 16 M-rows one row left 12 of), so the
prefix tiles they share are loaded once instead of once per row. It stays
invariant because BLOCK_M (set by R alone), BLOCK_N, BLOCK_D and the dot's
precision are the same for every call, a lone row's included, and an element of
a dot depends on its A row and B column only, in a fixed order, whatever the
other M-rows hold; the online softmax and the folds are per M-row (each
multiply-add an explicit fma, see _tile_update). With R = 1 or 4 (Llama-8B) a
row's result also equals the one-row kernel's, bitwise, on an H200; R = 8 widens
BLOCK_M to 32, which the GPU tests check the same way. So:

- a tile wholly inside the committed prefix holds the same keys for every row
  of the sequence: one load, one dot and one update for all the program's rows;
- a tile that reaches the step's own nodes holds each row's own ancestors: the
  program computes it once per row, with that row's keys, and keeps the update
  only in that row's M-rows (the others' results are thrown away);
- splits stay at each row's own positions and are folded in the same order; a
  row that ends before a split does not fold it, as it has none alone.

Rows of a program must split alike (the same split_len): row_groups puts
together up to R consecutive rows of one sequence, in windows aligned to the
sequence's first row, and starts a new group where split_len changes (rows near
the SPLIT_LEN * MAX_SPLITS doubling threshold). A plain decode (one row) runs the
same kernel with the same BLOCK_M as a tree's rows, so a node still equals its
plain decode bitwise. The grouping is computed on the device with fixed shapes
(a CUDA graph captures it); the grid keeps one program per step row, and those
past the last group return at once.

kernels.tree_attention is faster (several nodes per tile share the keys they
load) and stays the default.

Which own nodes a node sees, in depth order, comes from the packed ancestor
masks of TreeAttnMetadata (ancestor_tails): a leading chain 0..c-1 (a prompt
chunk, or the tokens given unconditionally, and any run of a tree that
continues it), then at most MAX_TAIL further ancestors listed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import interpreting, tl, triton
from kernels.tree_attention import LOG2E, StepLayout
from kernels.tree_metadata import TreeAttnMetadata, _sm_count, metadata_from_layout

# Keys per tile: fixed, since it sets the reduction order.
BLOCK_N = 32
# Warps of a program of the attention kernels (not the merge): how a program's work is
# spread over threads. Every row, a lone decode's included, runs with the same value, so
# it cannot make a node differ from its plain decode; the GPU tests check that it also
# leaves the result of the one-row kernel's arithmetic unchanged.
NUM_WARPS = 4
# Software-pipeline stages of those kernels (None: Triton's default), again how, not what.
NUM_STAGES: int | None = None
# Programs per SM a launch aims for before rows share their splits through a workspace.
PROGRAMS_PER_SM = 2
# Keys per split (a multiple of BLOCK_N), fixed for the same reason. A Llama-8B decode
# of a 1k prefix at batch 1 has 5 splits x 8 kv heads = 40 programs of at most 8 tiles,
# where one program per kv head took 33. Shorter splits would give batch 1 more programs
# but restart each program's loop (and its pipelined loads) more often at every batch.
SPLIT_LEN = 256
# Splits per row at most: longer rows use splits of SPLIT_LEN * 2^k (still set by the
# row's length alone). This bounds the grid and the workspace, which are sized before
# the call for the longest row the block table can hold (the engine's covers the
# model's whole context: 128k tokens for Llama 3.1).
MAX_SPLITS = 16
# Ancestors past a node's leading chain that can be listed. Step items are a chain of
# given tokens and a drafted tree below it, so this bounds the drafted tree's depth
# (the engine checks it; a draft tree's depth is ~10).
MAX_TAIL = 64
# Step rows of one sequence that one program computes together (see "Several rows per
# program" above); 1: one row per program, the kernel as it was first measured. Rows per
# program are also capped by the M-rows one GQA group leaves free (BLOCK_M // GROUP).
# On an H200 (8B shapes, prefix 1k, bf16) 4 took a target step of 64 requests x 8 nodes
# from 66.6 to 36.4 ms and 8 x 8 from 11.4 to 7.8 ms, the rest within noise, with each
# node still bitwise its plain decode (BENCHMARKS.md, issue 19).
ROWS_PER_PROGRAM = 4
# Rows per program for calls that average more than ROWS_PER_PROGRAM rows per sequence (0: the
# same as ROWS_PER_PROGRAM). For Llama-8B 8 rows widen BLOCK_M to 32; on an H200 a row computes
# the same bits in a 32-row tile as in a 16-row one (tests/test_batch_invariant.py, rows 8 against
# 1), and 64 requests x 8 nodes took 25.6 ms against 29.3 with 4, while a decode (one row per
# sequence) would leave 28 of the 32 M-rows empty (BENCHMARKS.md, issue 19).
TREE_ROWS_PER_PROGRAM = 8
# The M-rows of a multi-row program at most: 8 rows of Llama-8B's 4 query heads per KV head.
MAX_BLOCK_M = 32
# Programs the interpreter's launches aim for (on a GPU: two per SM). One: programs run
# one after the other there, so splitting a row's work only adds some; tests raise it
# to run the other way of computing a row.
INTERPRETER_PROGRAMS = 1


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


@triton.jit
def _tile_logits(q, k, F32_DOT: tl.constexpr):
    # Unscaled: the scale is applied inside the explicit fma of _tile_update.
    if F32_DOT:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _tile_update(s, v, m_i, l_i, acc, qk_scale, F32_DOT: tl.constexpr):
    # One tile's online-softmax update (s: unscaled logits, -inf where not visible), with
    # every multiply-add written as an explicit fma. Left as a multiply then an add, the
    # compiler may decide per kernel whether to contract them (the scale into the exp2's
    # subtraction, say, unless a select sits between them) or to fold the add into the
    # dot as its accumulator; the kernels below differ in such surroundings, and on an
    # H200 they differed in the last bits until this was written with fmas (issue 19).
    # An fma is one rounding wherever it sits.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # A row that has seen nothing visible yet keeps m = -inf; subtract 0 instead so that
    # exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, None]))
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = tl.fma(acc, alpha[:, None], pv)
    return m_new, l_i, acc


@triton.jit
def _fold_split(m_a, l_a, acc_a, m_b, l_b, acc_b):
    # Partials a (the splits so far) and b (the next split) as one. Every split holds a
    # visible key, so both maxima are finite. The explicit fma leaves the compiler no
    # choice of contraction: both kernels that fold do the same arithmetic.
    m = tl.maximum(m_a, m_b)
    w_a = tl.exp2(m_a - m)
    w_b = tl.exp2(m_b - m)
    l_ab = tl.fma(l_a, w_a, l_b * w_b)
    acc = tl.fma(acc_a, w_a[:, None], acc_b * w_b[:, None])
    return m, l_ab, acc


# Integer arguments that change with the launch's shape are not specialised, so a new
# batch size never stops a served step for a compile (see kernels.tree_attention), and
# a row computed with its splits folded here or by the merge kernel (split_programs 1 or
# more, workspace or none) runs the same compiled kernel. (The workspace's stores lose
# their vector width; only launches of few rows make them.)
@triton.jit(do_not_specialize=["info_off", "split_programs", "bt_stride", "tail_stride",
                               "sa_r", "sa_h", "sa_s", "sm_r", "sm_h", "sm_s"])
def _invariant_attention_kernel(
    Q, K, V, KC, VC, Out, PartAcc, PartMl, Ints, BlockTable, RowSeq, Chain, Depth, Tail,
    info_off, split_programs, bt_stride, tail_stride,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    skc_b, skc_s, skc_h, svc_b, svc_s, svc_h, so_t, so_h,
    sa_r, sa_h, sa_s, sm_r, sm_h, sm_s,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLIT_LEN: tl.constexpr, MAX_SPLITS: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # Program (row, kv head, p): the row's GROUP query heads over its splits p,
    # p + split_programs, ...; with one program per row it also folds them.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    first_split = tl.program_id(2)
    seq = tl.load(RowSeq + row)
    if seq < 0:  # a row of no sequence (padding)
        return
    info = Ints + info_off + seq * 4  # the sequence's prefix_len, first row, count, table row
    prefix_len = tl.load(info)
    length = prefix_len + tl.load(Depth + row)
    # SPLIT_LEN doubled until the row needs at most MAX_SPLITS splits (rows up to
    # SPLIT_LEN * MAX_SPLITS long, nearly all, do not enter the loop). The merge kernel
    # repeats this. (Written out, like tl.cdiv and tl.zeros below: a jitted helper is a
    # nested call, which costs the interpreter about a millisecond.)
    split_len = length * 0 + SPLIT_LEN
    while length > split_len * MAX_SPLITS:
        split_len *= 2
    num_splits = (length + split_len - 1) // split_len
    if first_split >= num_splits:
        return
    row0 = tl.load(info + 1)
    table = BlockTable + tl.load(info + 3).to(tl.int64) * bt_stride
    chain = tl.load(Chain + row)
    tail_at = Tail + row * tail_stride - chain  # + own: the ancestor listed for that depth

    offs_m = tl.arange(0, BLOCK_M)
    head_ok = offs_m < GROUP
    head = kvh * GROUP + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    out_mask = head_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + row * sq_t + head[:, None] * sq_h + offs_d[None, :], mask=out_mask, other=0.0)
    k_cache, v_cache = KC + kvh * skc_h, VC + kvh * svc_h
    k_step, v_step = K + kvh * sk_h, V + kvh * sv_h
    # The row's result so far (splits 0..s-1), when this program runs them all.
    m_row = tl.full([BLOCK_M], 0.0, tl.float32)
    l_row = tl.full([BLOCK_M], 0.0, tl.float32)
    acc_row = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for split in range(first_split, num_splits, split_programs):
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        lo = split * split_len
        # split_len is a multiple of BLOCK_N: a split's tiles are the whole sequence's tiles.
        for start in range(lo, tl.minimum(length, lo + split_len), BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            ok = pos < length
            cached = pos < prefix_len  # the first prefix_len positions; the rest are own nodes
            own = pos - prefix_len  # depth - 1 of the ancestor at this position
            from_tail = ok & (own >= chain)
            listed = tl.load(tail_at + own, mask=from_tail, other=0)
            own_row = (row0 + tl.where(from_tail, listed, own)).to(tl.int64)
            block = tl.load(table + pos // PAGE, mask=cached, other=0).to(tl.int64)
            within = pos % PAGE
            c_mask = cached[:, None] & d_ok[None, :]
            s_mask = (ok & ~cached)[:, None] & d_ok[None, :]
            # Each position's key and value come from the cache or from the step, never both.
            # (Two masked loads: a load through a select of the two pointers would lose their
            # alignment and contiguity, i.e. vector loads and asynchronous copies.)
            k = tl.where(cached[:, None],
                         tl.load(k_cache + (block * skc_b + within * skc_s)[:, None] + offs_d[None, :],
                                 mask=c_mask, other=0.0),
                         tl.load(k_step + own_row[:, None] * sk_t + offs_d[None, :], mask=s_mask, other=0.0))
            v = tl.where(cached[:, None],
                         tl.load(v_cache + (block * svc_b + within * svc_s)[:, None] + offs_d[None, :],
                                 mask=c_mask, other=0.0),
                         tl.load(v_step + own_row[:, None] * sv_t + offs_d[None, :], mask=s_mask, other=0.0))
            s = _tile_logits(q, k, F32_DOT)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_i, l_i, acc = _tile_update(s, v, m_i, l_i, acc, qk_scale, F32_DOT)
        if split_programs > 1:
            tl.store(PartAcc + row * sa_r + head[:, None] * sa_h + split * sa_s + offs_d[None, :], acc,
                     mask=out_mask)
            tl.store(PartMl + row * sm_r + head * sm_h + split * sm_s, m_i, mask=head_ok)
            tl.store(PartMl + row * sm_r + head * sm_h + split * sm_s + 1, l_i, mask=head_ok)
        elif split == 0:
            m_row, l_row, acc_row = m_i, l_i, acc
        else:
            m_row, l_row, acc_row = _fold_split(m_row, l_row, acc_row, m_i, l_i, acc)
    if split_programs == 1:
        out = acc_row / tl.where(l_row > 0, l_row, 1.0)[:, None]
        tl.store(Out + row * so_t + head[:, None] * so_h + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=out_mask)


# The same specialisation rules as the one-row kernel, for the same reasons.
@triton.jit(do_not_specialize=["info_off", "split_programs", "bt_stride", "tail_stride",
                               "sa_r", "sa_h", "sa_s", "sm_r", "sm_h", "sm_s"])
def _invariant_rows_kernel(
    Q, K, V, KC, VC, Out, PartAcc, PartMl, Ints, BlockTable, RowSeq, Chain, Depth, Tail, Groups,
    info_off, split_programs, bt_stride, tail_stride,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
    skc_b, skc_s, skc_h, svc_b, svc_s, svc_h, so_t, so_h,
    sa_r, sa_h, sa_s, sm_r, sm_h, sm_s,
    qk_scale,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLIT_LEN: tl.constexpr,
    MAX_SPLITS: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Program (group, kv head, p): up to ROWS rows of one sequence (Groups[group]: first
    # row, count), M-row m holding query head m % GROUP of the group's row m // GROUP,
    # over the rows' splits p, p + split_programs, ...; with one program per group it
    # also folds them. Each row's arithmetic is the one-row kernel's (module docstring).
    group = tl.program_id(0)
    kvh = tl.program_id(1)
    first_split = tl.program_id(2)
    count = tl.load(Groups + 2 * group + 1)
    if count == 0:  # past the step's groups
        return
    first = tl.load(Groups + 2 * group)
    seq = tl.load(RowSeq + first)
    info = Ints + info_off + seq * 4  # the sequence's prefix_len, first row, count, table row
    prefix_len = tl.load(info)
    offs_m = tl.arange(0, BLOCK_M)
    slot = offs_m // GROUP  # the group's row that M-row m belongs to
    m_ok = (offs_m < ROWS * GROUP) & (slot < count)
    row_m = first + slot
    head = kvh * GROUP + offs_m % GROUP
    length_m = prefix_len + tl.load(Depth + row_m, mask=m_ok, other=0)
    length = tl.max(length_m, 0)  # the group's longest row
    # The rows' split_len, the same for all of them (row_groups sees to it).
    split_len = length * 0 + SPLIT_LEN
    while length > split_len * MAX_SPLITS:
        split_len *= 2
    num_splits = (length + split_len - 1) // split_len
    if first_split >= num_splits:
        return
    row0 = tl.load(info + 1)
    table = BlockTable + tl.load(info + 3).to(tl.int64) * bt_stride
    shared_end = prefix_len // BLOCK_N * BLOCK_N  # tiles before it hold committed keys only

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    out_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + row_m[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :], mask=out_mask, other=0.0)
    k_cache, v_cache = KC + kvh * skc_h, VC + kvh * svc_h
    k_step, v_step = K + kvh * sk_h, V + kvh * sv_h
    m_row = tl.full([BLOCK_M], 0.0, tl.float32)
    l_row = tl.full([BLOCK_M], 0.0, tl.float32)
    acc_row = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for split in range(first_split, num_splits, split_programs):
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        lo = split * split_len
        hi = tl.minimum(length, lo + split_len)
        # Tiles wholly inside the committed prefix come first, in a loop of their own (no
        # branch in it, so the compiler can pipeline its loads); then the tiles that reach
        # the step's nodes. Either way the tiles run in position order, as for a lone row.
        for start in range(lo, tl.minimum(hi, shared_end), BLOCK_N):
            # Committed keys only, the same for every row (and all visible: each row is
            # longer than the prefix): one load and one update for all M-rows.
            pos = start + tl.arange(0, BLOCK_N)
            block = tl.load(table + pos // PAGE).to(tl.int64)
            within = pos % PAGE
            k = tl.load(k_cache + (block * skc_b + within * skc_s)[:, None] + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
            v = tl.load(v_cache + (block * svc_b + within * svc_s)[:, None] + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
            s = _tile_logits(q, k, F32_DOT)
            m_i, l_i, acc = _tile_update(s, v, m_i, l_i, acc, qk_scale, F32_DOT)
        for start in range(tl.maximum(lo, shared_end), hi, BLOCK_N):
            # The tile reaches the step's nodes, each row's own ancestors: per row, as the
            # one-row kernel loads it, the update kept in that row's M-rows only.
            pos = start + tl.arange(0, BLOCK_N)
            for r in range(0, count):
                row = first + r
                length_r = prefix_len + tl.load(Depth + row)
                if start < length_r:  # a row shorter than the tile's start has no such tile
                    chain = tl.load(Chain + row)
                    tail_at = Tail + row * tail_stride - chain
                    ok = pos < length_r
                    cached = pos < prefix_len
                    own = pos - prefix_len
                    from_tail = ok & (own >= chain)
                    listed = tl.load(tail_at + own, mask=from_tail, other=0)
                    own_row = (row0 + tl.where(from_tail, listed, own)).to(tl.int64)
                    block = tl.load(table + pos // PAGE, mask=cached, other=0).to(tl.int64)
                    within = pos % PAGE
                    c_mask = cached[:, None] & d_ok[None, :]
                    s_mask = (ok & ~cached)[:, None] & d_ok[None, :]
                    k = tl.where(cached[:, None],
                                 tl.load(k_cache + (block * skc_b + within * skc_s)[:, None] + offs_d[None, :],
                                         mask=c_mask, other=0.0),
                                 tl.load(k_step + own_row[:, None] * sk_t + offs_d[None, :], mask=s_mask,
                                         other=0.0))
                    v = tl.where(cached[:, None],
                                 tl.load(v_cache + (block * svc_b + within * svc_s)[:, None] + offs_d[None, :],
                                         mask=c_mask, other=0.0),
                                 tl.load(v_step + own_row[:, None] * sv_t + offs_d[None, :], mask=s_mask,
                                         other=0.0))
                    s = _tile_logits(q, k, F32_DOT)
                    s = tl.where(ok[None, :], s, float("-inf"))
                    m_r, l_r, acc_r = _tile_update(s, v, m_i, l_i, acc, qk_scale, F32_DOT)
                    # Padding M-rows take every row's update too: their q is 0, so they stay
                    # finite (a split they never saw would fold -inf with -inf into NaN).
                    mine = (slot == r) | ~m_ok
                    m_i = tl.where(mine, m_r, m_i)
                    l_i = tl.where(mine, l_r, l_i)
                    acc = tl.where(mine[:, None], acc_r, acc)
        has = m_ok & (lo < length_m)  # the rows that have this split
        if split_programs > 1:
            tl.store(PartAcc + row_m[:, None] * sa_r + head[:, None] * sa_h + split * sa_s + offs_d[None, :], acc,
                     mask=has[:, None] & d_ok[None, :])
            tl.store(PartMl + row_m * sm_r + head * sm_h + split * sm_s, m_i, mask=has)
            tl.store(PartMl + row_m * sm_r + head * sm_h + split * sm_s + 1, l_i, mask=has)
        elif split == 0:  # every row has split 0
            m_row, l_row, acc_row = m_i, l_i, acc
        else:
            m_f, l_f, acc_f = _fold_split(m_row, l_row, acc_row, m_i, l_i, acc)
            m_row = tl.where(has, m_f, m_row)
            l_row = tl.where(has, l_f, l_row)
            acc_row = tl.where(has[:, None], acc_f, acc_row)
    if split_programs == 1:
        out = acc_row / tl.where(l_row > 0, l_row, 1.0)[:, None]
        tl.store(Out + row_m[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["info_off", "sa_r", "sa_h", "sa_s", "sm_r", "sm_h", "sm_s"])  # as the kernels above
def _merge_splits_kernel(
    PartAcc, PartMl, Ints, RowSeq, Depth, Out, info_off,
    sa_r, sa_h, sa_s, sm_r, sm_h, sm_s, so_t, so_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT_LEN: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    # Program (row, kv head): the row's GROUP query heads, as in the attention kernel.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(RowSeq + row)
    if seq < 0:  # padding: it has no partials
        return
    length = tl.load(Ints + info_off + seq * 4) + tl.load(Depth + row)
    split_len = length * 0 + SPLIT_LEN  # as in the attention kernel
    while length > split_len * MAX_SPLITS:
        split_len *= 2
    num_splits = (length + split_len - 1) // split_len
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    head = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    ml_at = PartMl + row * sm_r + head * sm_h
    acc_at = PartAcc + row * sa_r + head[:, None] * sa_h + offs_d[None, :]
    m_row = tl.load(ml_at, mask=g_ok, other=0.0)
    l_row = tl.load(ml_at + 1, mask=g_ok, other=0.0)
    acc_row = tl.load(acc_at, mask=mask, other=0.0)
    for split in range(1, num_splits):
        m_row, l_row, acc_row = _fold_split(
            m_row, l_row, acc_row, tl.load(ml_at + split * sm_s, mask=g_ok, other=0.0),
            tl.load(ml_at + split * sm_s + 1, mask=g_ok, other=0.0),
            tl.load(acc_at + split * sa_s, mask=mask, other=0.0))
    out = acc_row / tl.where(l_row > 0, l_row, 1.0)[:, None]
    tl.store(Out + row * so_t + head[:, None] * so_h + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class InvariantPlan:
    """One step's metadata plus what the kernel reads per row, shared by every layer."""

    meta: TreeAttnMetadata
    tails: AncestorTails
    row_seq: torch.Tensor  # int32 [rows]: the sequence of each step row; -1 where none (padding)
    groups: RowGroups | None = None  # for several rows per program; None: one row per program


@dataclass(frozen=True)
class RowGroups:
    """Which rows each program of the multi-row kernel computes, for one grouping."""

    rows_per_program: int
    split_len: int
    max_splits: int
    groups: torch.Tensor  # int32 [rows, 2]: program g's first row and row count; count 0 past the last


def row_sequences(meta: TreeAttnMetadata) -> torch.Tensor:
    """Each step row's sequence (-1 for rows of none), from the tiles: torch ops of fixed
    shapes on the metadata's device (a CUDA graph can capture them)."""
    rows = meta.mask_words.shape[0]
    device = meta.ints.device
    tiles = meta.tiles.long()
    seq = tiles[:, 0]
    node = torch.arange(meta.nodes_per_tile, device=device)
    row = (meta.seq_info[:, 1].long()[seq] + tiles[:, 1])[:, None] + node
    # Rows past a tile's count (and padding tiles, count 0) land in a spare entry, dropped.
    row = torch.where(node < tiles[:, 2:3], row, rows)
    row_seq = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    row_seq.scatter_(0, row.flatten(), seq.to(torch.int32)[:, None].expand_as(row).flatten())
    return row_seq[:rows]


def rows_per_program_for(group: int, rows_per_program: int | None = None, *, rows: int = 0,
                         sequences: int = 1) -> int:
    """Rows one program computes: rows_per_program if given; else, for a call of `rows` step
    rows over `sequences` sequences, ROWS_PER_PROGRAM, or TREE_ROWS_PER_PROGRAM (when set)
    where the call averages more rows per sequence than that (verify steps of wide trees,
    prompt chunks). At most as many as MAX_BLOCK_M M-rows hold (GROUP query heads each).
    Both follow from the call's shapes alone, so a plan and its calls agree, and a CUDA
    graph's bucket always takes the same kernel."""
    if rows_per_program is None:
        rows_per_program = ROWS_PER_PROGRAM
        if TREE_ROWS_PER_PROGRAM and rows > ROWS_PER_PROGRAM * max(1, sequences):
            rows_per_program = TREE_ROWS_PER_PROGRAM
    return max(1, min(rows_per_program, MAX_BLOCK_M // group))


def _block_m(group: int, rows: int) -> int:
    # `rows` rows of GROUP query heads, padded to tl.dot's 16 at least. It sets the dots' shape,
    # so every call with the same rows per program uses it: a tree's rows and a plain decode's one.
    return max(16, triton.next_power_of_2(group * rows))


def row_groups(meta: TreeAttnMetadata, row_seq: torch.Tensor, depth: torch.Tensor, rows_per_program: int, *,
               split_len: int = SPLIT_LEN, max_splits: int = MAX_SPLITS) -> RowGroups:
    """Step rows in programs of up to rows_per_program consecutive rows of one sequence that
    split alike, from torch ops of fixed shapes on the metadata's device (a CUDA graph can
    capture them). Windows of rows_per_program rows are aligned to each sequence's first row;
    a window breaks where split_len changes (only near the SPLIT_LEN * MAX_SPLITS doubling
    threshold), so a program never holds rows of two split lengths."""
    rows = row_seq.shape[0]
    device = row_seq.device
    real = row_seq >= 0
    seq = row_seq.long().clamp(min=0)
    info = meta.seq_info.long()
    index = torch.arange(rows, device=device)
    local = index - info[seq, 1]
    length = info[seq, 0] + depth[:rows].long()
    # The kernel doubles split_len while length > split_len * max_splits: the doublings a
    # row gets are the thresholds it passes (32 of them reach far past any context).
    thresholds = split_len * max_splits * torch.pow(
        2, torch.arange(32, device=device, dtype=torch.int64))
    doublings = (length[:, None] > thresholds).sum(1)
    same_as_previous = torch.zeros(rows, dtype=torch.bool, device=device)
    same_as_previous[1:] = (row_seq[1:] == row_seq[:-1]) & (doublings[1:] == doublings[:-1])
    starts = real & ((local % rows_per_program == 0) | ~same_as_previous)
    group = torch.cumsum(starts, 0) - 1
    # Rows that start no group (or are padding) write to a spare entry, dropped.
    groups = torch.zeros(rows + 1, 2, dtype=torch.int32, device=device)
    groups[:, 0].scatter_(0, torch.where(starts, group, rows), index.to(torch.int32))
    groups[:, 1].scatter_add_(0, torch.where(real, group, rows), real.to(torch.int32))
    return RowGroups(rows_per_program=rows_per_program, split_len=split_len, max_splits=max_splits,
                     groups=groups[:rows].contiguous())


def plan_invariant(meta: TreeAttnMetadata, rows_per_program: int | None = None, *, split_len: int = SPLIT_LEN,
                   max_splits: int = MAX_SPLITS) -> InvariantPlan:
    """What every layer's call reads; with several rows per program (rows_per_program, None:
    ROWS_PER_PROGRAM) also their grouping, for calls with this split_len and max_splits."""
    tails = ancestor_tails(meta.mask_words)
    row_seq = row_sequences(meta)
    rows = rows_per_program_for(meta.group, rows_per_program, rows=row_seq.shape[0], sequences=meta.batch)
    groups = None
    if rows > 1:
        groups = row_groups(meta, row_seq, tails.depth, rows, split_len=split_len, max_splits=max_splits)
    return InvariantPlan(meta=meta, tails=tails, row_seq=row_seq, groups=groups)


def _split_programs(row_programs: int, max_splits: int, device: torch.device) -> int:
    """Programs that share one row's splits: 1 when there are rows enough for about
    PROGRAMS_PER_SM programs per SM, else enough to make that many."""
    if device.type == "cuda":
        target = PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = INTERPRETER_PROGRAMS
    return max(1, min(max_splits, triton.cdiv(target, max(1, row_programs))))


def tree_attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cache_k: torch.Tensor, cache_v: torch.Tensor,
                             plan: InvariantPlan | TreeAttnMetadata | StepLayout, scale: float, *,
                             block_n: int | None = None, split_len: int = SPLIT_LEN,
                             max_splits: int = MAX_SPLITS, rows_per_program: int | None = None) -> torch.Tensor:
    """Same contract as tree_attention_reference, each node's result independent of the
    rest of the step (see the module's docstring).

    block_n (None: BLOCK_N), split_len and max_splits set every row's reduction order: results are
    bitwise comparable only between calls with the same values (tests lower them so
    that tiny sequences get several tiles and splits). rows_per_program (None:
    ROWS_PER_PROGRAM) picks the kernel, not the result: see the module's docstring."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    block_n = BLOCK_N if block_n is None else block_n
    if split_len % block_n or max_splits < 1:
        raise ValueError(f"split_len {split_len} must be a multiple of block_n {block_n}, max_splits "
                         f"{max_splits} positive")
    if isinstance(plan, StepLayout):
        plan = metadata_from_layout(plan, block_size=cache_k.shape[1], num_q_heads=Hq, num_kv_heads=Hkv,
                                    device=q.device)
    if isinstance(plan, TreeAttnMetadata):
        plan = plan_invariant(plan, rows_per_program, split_len=split_len, max_splits=max_splits)
    meta, tails = plan.meta, plan.tails
    if meta.block_size != cache_k.shape[1] or meta.group * Hkv != Hq or cache_k.shape[2] != Hkv:
        raise ValueError(f"metadata for block size {meta.block_size} and {meta.group} query heads per kv "
                         f"head; cache {tuple(cache_k.shape)}, q {Hq} heads, k {Hkv}")
    if meta.block_table.stride(-1) != 1:
        raise ValueError("the block table's last dim must be contiguous")
    q, k, v, cache_k, cache_v = (x if x.stride(-1) == 1 else x.contiguous()
                                 for x in (q, k, v, cache_k, cache_v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows = min(T, plan.row_seq.shape[0])  # rows past the metadata's belong to no sequence
    if rows == 0:
        return out

    # Everything below follows from shapes alone (a CUDA graph replays it for other lengths).
    # No row is longer than the prefix its table can hold plus the step's rows.
    longest = meta.block_table.shape[1] * meta.block_size + T
    splits = min(max_splits, triton.cdiv(longest, split_len))
    per_program = rows_per_program_for(meta.group, rows_per_program, rows=plan.row_seq.shape[0],
                                       sequences=meta.batch)
    groups = None
    if per_program > 1:
        groups = plan.groups
        if groups is None or (groups.rows_per_program, groups.split_len, groups.max_splits) != (
                per_program, split_len, max_splits):  # a plan made for other calls
            groups = row_groups(meta, plan.row_seq, tails.depth, per_program, split_len=split_len,
                                max_splits=max_splits)
        # The programs with rows: at most a program per window of per_program rows plus one
        # per sequence for its last, partial window (more only where split_len changes
        # inside a window: rows near the doubling threshold, where this guess is too low).
        programs = min(rows, triton.cdiv(rows, per_program) + meta.batch)
    else:
        programs = rows
    split_programs = _split_programs(programs * Hkv, splits, q.device)
    # The workspace: a partial per (row, query head, split). Only launches of fewer rows
    # than the GPU has programs to give use it, so it stays small: rows x Hkv < 2 x SMs
    # bounds it by 2 x SMs x GROUP x splits x (head_dim + 2) floats (Llama-8B on an H200:
    # 264 x 4 x 16 x 130 x 4 B = 8.8 MB; with R rows per program, R times that at most),
    # where a partial per split for every row of a 4k-token prefill chunk would take
    # 1.1 GB. Larger launches fold in registers and pass a placeholder, never touched.
    if split_programs > 1:
        part_acc = torch.empty(rows, Hq, splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, Hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    f32_dot = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting())
    common = (meta.info_off, split_programs, meta.block_table.stride(0), tails.tail.stride(0),
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
              cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), out.stride(0), out.stride(1),
              part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
              part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
              scale * LOG2E)
    # BLOCK_M follows the rows per program alone, never the step: it sets the dots' shape.
    shape = dict(GROUP=meta.group, BLOCK_M=_block_m(meta.group, per_program), BLOCK_N=block_n, BLOCK_D=block_d,
                 HEAD_DIM=D, PAGE=meta.block_size, SPLIT_LEN=split_len, MAX_SPLITS=max_splits, F32_DOT=f32_dot,
                 num_warps=NUM_WARPS, **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}))
    if groups is None:
        _invariant_attention_kernel[(rows, Hkv, split_programs)](
            q, k, v, cache_k, cache_v, out, part_acc, part_ml, meta.ints, meta.block_table, plan.row_seq,
            tails.chain, tails.depth, tails.tail, *common, **shape)
    else:
        # A program per step row, as above: groups never outnumber rows, and the programs past
        # the last group return at once (their number is only known on the device).
        _invariant_rows_kernel[(rows, Hkv, split_programs)](
            q, k, v, cache_k, cache_v, out, part_acc, part_ml, meta.ints, meta.block_table, plan.row_seq,
            tails.chain, tails.depth, tails.tail, groups.groups, *common, ROWS=per_program, **shape)
    if split_programs > 1:
        _merge_splits_kernel[(rows, Hkv)](
            part_acc, part_ml, meta.ints, plan.row_seq, tails.depth, out, meta.info_off,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2), out.stride(0), out.stride(1),
            GROUP=meta.group, BLOCK_G=triton.next_power_of_2(meta.group), BLOCK_D=block_d, HEAD_DIM=D,
            SPLIT_LEN=split_len, MAX_SPLITS=max_splits, num_warps=4,
        )
    return out
