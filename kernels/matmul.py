"""A batch-invariant linear layer: a row's result does not depend on the other rows.

cuBLAS picks its algorithm (tile shape, split-K, the instruction) by the
problem's shape, so the same activation row multiplied alone and among 63
others can round differently in bf16, and a near-tie argmax can flip: that is
how speculation changed greedy output on the GPU (BENCHMARKS.md, issue 19).
This kernel splits the reduction over K by the weight's shape (N, K) alone,
never by M: each split covers a fixed, BLOCK_K-aligned range of K, walked in
BLOCK_K steps upward; the float32 partials are summed per output element in
split order (0, 1, ...), then the bias is added. An output element is then the
same sequence of multiply-accumulate steps over K whatever M is and wherever
its row falls in a tile, so it is bitwise the same.

The tile shape may follow M without changing that sequence: an element of a
tile is its A row times its B column, accumulated over K in the same BLOCK_K
steps by the same tensor-core instruction family (on Hopper, warpgroup MMAs of
K 16 into a float32 accumulator, for any tile of 64 rows or more and 4 warps or
more), whatever the tile's height and width. Calls of up to WIDE_FROM_M - 1 rows
(decode, small verifies) take 64 x 64 tiles, which give the memory-bound case
enough programs; larger calls take wider tiles, which reuse each loaded tile
for more multiply-adds. The GPU tests check that a row computed alone equals
the row among 511 others, bitwise, across that switch.

Wide calls on Hopper read their tiles through TMA descriptors and, rather than
writing float32 partials for a second kernel to sum, walk a tile's splits one
after another and add each split's sum to a running total in split order: the
same additions, made in registers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels._triton import interpreting, tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton, or none: wide calls take the pointer kernel
    TensorDescriptor = None

# The tiles of calls below WIDE_FROM_M rows. BLOCK_M stays 64 down to M = 1: on
# Hopper a tile under 64 rows would switch the instruction. The column tile may
# depend on the weight's shape, which is fixed per layer (MIN_PROGRAMS below).
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
# Five loads in flight per program: at one row these calls stream their weight, and on an H200 the mode's
# forward replayed at batch 1 in 5.30 ms with 5 stages against 5.42 with 3, its output bitwise the same
# for every 8B weight at 1, 8, 64 and 512 rows (bench/linear_knobs.py; BENCHMARKS.md, issue 19).
NUM_STAGES = 5
# float32 operands (no tensor cores) are twice the bytes: their tiles keep the three stages they had
# (96 KB of shared memory, where five would take 160 KB); five were not timed for them.
FP32_NUM_STAGES = 3
# Column tiles wanted per row tile before BLOCK_N drops to 32 (0: never). Narrower tiles were meant to
# give narrow weights more programs at small M; on the H200 64-wide tiles with split-K ran the decode
# step faster (bench/engine_step.py --deterministic --matmul: 5.78 against 6.30 ms at batch 1, 11.03
# against 11.29 at 64), so split-K alone supplies the programs.
MIN_PROGRAMS = 0

# Split-K, for decode: at M = 1 a weight has only cdiv(N, BLOCK_N) programs
# (128 for down_proj), each walking all of K, too few to keep the HBM of 132
# SMs busy. Splitting K multiplies the programs. The count is a constant, not
# the device's SM count, so that a layer rounds the same on every GPU.
SPLIT_K_PROGRAMS = 256  # programs wanted per row tile: about two per SM of an H200
# Splits rounded up to a power of two (0: not rounded). The wide tiles of a large call run one
# program per SM; with 3 splits of qkv (or 5 of o_proj and down_proj) 512 rows made 288 (320)
# programs, 2.2 (2.4) waves of 132 SMs, the last one mostly idle; with 4, 384 (256): 2.9 (1.9).
SPLITS_POWER_OF_TWO = 1
MIN_K_PER_SPLIT = 8 * BLOCK_K  # shorter K loops would not fill the software pipeline
# The small tiles' K step where the walked range is a whole number of them (else BLOCK_K), as
# WIDE_BLOCK_K for the wide calls: an element sums the same K-16 tensor-core steps either way.
SMALL_BLOCK_K = 64
MAX_SPLITS = 8  # the partials cost SPLITS * M * N * 4 bytes written and read again: bounded for prefill

# Calls of at least WIDE_FROM_M rows (0: never) take these tiles instead: at 64 requests x 8 tree
# nodes (512 rows) on an H200 the 64 x 64 tiles ran the linear layers at about 350 TFLOP/s, these
# at about 525, cuBLAS at about 760 (bench/engine_step.py --profile, BENCHMARKS.md, issue 19). Both
# shapes keep BLOCK_K and the splits, which are what set an element's reduction order.
WIDE_FROM_M = 65
WIDE_BLOCK_M = 128
WIDE_BLOCK_N = 256
WIDE_NUM_WARPS = 8
WIDE_NUM_STAGES = 3
# Wide calls load their operand tiles through TMA descriptors (Hopper's tensor memory accelerator:
# one instruction per tile, out-of-bounds rows and columns filled with zeros) where the device has
# it, and walk a column tile's K splits one after another in the program, adding each split's sum
# to the running total in split order: the additions the partials kernel makes, in registers, so
# no float32 partials go through HBM (at 512 rows about 117 MB a layer) and no summing kernel runs.
# On an H200 the forward of a 64 x 8 verify step of the 8B shapes in the mode, replayed, went from
# 22.19 to 20.53-20.62 ms (BENCHMARKS.md, issue 19).
WIDE_TMA = 1
WIDE_SPLITS_IN_PROGRAM = 1
# The column tile and stages of a wide call that sums splits in the program: it holds two float32
# tiles (the split's and the running total), and two of 128 x 256 would not fit 8 warps' registers.
SUMMING_BLOCK_N = 128
SUMMING_NUM_STAGES = 4
# The TMA kernel's K step where every split is a whole number of them (else BLOCK_K). An element
# still sums the same K-16 tensor-core steps in the same order; the GPU tests check it bitwise.
WIDE_BLOCK_K = 64
REDUCE_BLOCK = 1024  # output elements per program of the kernel that sums the partials


def block_n_for(n: int) -> int:
    return BLOCK_N if triton.cdiv(n, BLOCK_N) >= MIN_PROGRAMS else 32


def tiles_for(m: int, n: int, *, tensor_cores: bool = True,
              sums_splits: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a call of m rows on a weight of n outputs;
    `sums_splits`: the call adds its K splits in the program. Without tensor cores (float32 at
    IEEE precision: the dot runs on FMA units, where a wide tile's operands do not fit the
    registers and its stages not the shared memory) every call takes the small tiles."""
    if tensor_cores and WIDE_FROM_M and m >= WIDE_FROM_M:
        if sums_splits:
            return WIDE_BLOCK_M, SUMMING_BLOCK_N, WIDE_NUM_WARPS, SUMMING_NUM_STAGES
        return WIDE_BLOCK_M, WIDE_BLOCK_N, WIDE_NUM_WARPS, WIDE_NUM_STAGES
    return BLOCK_M, block_n_for(n), NUM_WARPS, NUM_STAGES if tensor_cores else FP32_NUM_STAGES


def k_splits_for(n: int, k: int) -> tuple[int, int]:
    """(number of splits, K columns per split) for a weight [n, k]: enough splits
    that the column tiles times the splits reach SPLIT_K_PROGRAMS (rounded up to a power
    of two), each split at least MIN_K_PER_SPLIT long, at most MAX_SPLITS. A function of the weight alone:
    the same for every M, which is what keeps a row's sum order fixed. Wide
    weights (gate_up, lm_head) already have enough column tiles: one split,
    the single-kernel path."""
    column_tiles = triton.cdiv(n, block_n_for(n))
    wanted = triton.cdiv(SPLIT_K_PROGRAMS, column_tiles)
    if SPLITS_POWER_OF_TWO:
        wanted = triton.next_power_of_2(wanted)
    splits = max(1, min(wanted, k // MIN_K_PER_SPLIT, MAX_SPLITS))
    return _aligned_splits(k, splits)


def _aligned_splits(k: int, splits: int) -> tuple[int, int]:
    """`splits` rounded so that every split covers whole BLOCK_K steps and none is empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), max(1, splits)) * BLOCK_K
    return max(1, triton.cdiv(k, k_per_split)), k_per_split


@functools.cache
def _has_tma(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_fits(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA descriptors can read these operands: a Triton that has them, a Hopper-class
    device (or the interpreter), and rows whose start addresses are 16-byte aligned."""
    if TensorDescriptor is None:
        return False
    if not interpreting() and (x2.device.type != "cuda" or not _has_tma(x2.device.index)):
        return False
    row_bytes_ok = all(t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x2, weight))
    return row_bytes_ok and x2.stride(-1) == 1 and weight.stride(-1) == 1


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# M changes every step: not specialised, so no step waits for a compile and one
# binary serves all M (so_split = M * N changes with it).
@triton.jit(do_not_specialize=["M", "so_split"])
def _linear_kernel(X, W, B, Out, M, N, K, K_PER_SPLIT, sx_m, sw_n, so_m, so_split,
                   HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """X[:, split's K range] @ W[:, split's K range].T for one tile and one split
    (program axis 2). With one split Out is the output; with more it is the
    float32 partials [splits, M, N] and the bias waits for the sum."""
    pid_split = tl.program_id(2)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_split * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # A loop bound that is an argument, not a value computed in the kernel: Triton 3.6's interpreter
    # cannot range over the latter. Steps of the last split past K load nothing and add exact zeros.
    for k_step in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_start + k_step
        k_ok = (k0 + offs_k) < K
        a = tl.load(X + offs_m[:, None] * sx_m + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + offs_n[:, None] * sw_n + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_split = Out + pid_split.to(tl.int64) * so_split  # so_split is 0 with one split
    tl.store(out_split + offs_m[:, None] * so_m + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "so_split"])
def _wide_linear_kernel(x_desc, w_desc, B, Out, M, N, K_PER_SPLIT, STEPS, so_m, so_split,
                        SPLITS_IN_PROGRAM: tl.constexpr, HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_linear_kernel's tile with its operands read through TMA descriptors. STEPS is the BLOCK_K
    steps the program walks: one split's (program axis 2 is the split, Out the float32 partials)
    or, with SPLITS_IN_PROGRAM, every split's, each split's sum added to the running total as it
    ends (the first taken as it is, as the summing kernel takes partial 0), then the bias."""
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    k_base = tl.program_id(2) * K_PER_SPLIT
    steps_per_split = K_PER_SPLIT // BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, STEPS):
        k0 = k_base + step * BLOCK_K
        a = x_desc.load([m0, k0])
        w = w_desc.load([n0, k0])
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        if SPLITS_IN_PROGRAM:
            if (step + 1) % steps_per_split == 0:
                total = tl.where(step < steps_per_split, acc, total + acc)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SPLITS_IN_PROGRAM:
        acc = total
    offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_split = Out + tl.program_id(2).to(tl.int64) * so_split  # so_split is 0 when no partials are written
    tl.store(out_split + offs_m[:, None] * so_m + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(Partials, B, Out, M, N,
                       SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Out = Partials[0] + Partials[1] + ... (in that order, float32) + bias, for
    contiguous Partials [SPLITS, M, N] and Out [M, N]: each element's sum is the
    same sequence of additions whatever M is."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M.to(tl.int64) * N
    ok = offs < size
    acc = tl.load(Partials + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(Partials + s * size + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=ok)


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     splits: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K], each output row
    bitwise independent of how many rows x has. float32 runs at IEEE precision (no TF32).
    `splits` overrides k_splits_for(N, K) (tests use it on shapes too small to split);
    it is rounded to whole BLOCK_K steps per split."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape != (N, K):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit inputs of width {K}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit {N} outputs")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if not M:
        return out.view(*x.shape[:-1], N)
    # The interpreter multiplies bf16 dot operands as raw bits: there they go through float32.
    f32_dot = x.dtype == torch.float32 or interpreting()
    # Under the interpreter the wide tiles run too (in float32), so that CPU tests walk them.
    tensor_cores = not f32_dot or interpreting()
    n_splits, k_per_split = k_splits_for(N, K) if splits is None else _aligned_splits(K, splits)
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    wide = bool(tensor_cores and WIDE_FROM_M and M >= WIDE_FROM_M)
    tma = wide and WIDE_TMA and _tma_fits(x2, weight)
    sums_splits = n_splits > 1 and tma and WIDE_SPLITS_IN_PROGRAM
    in_program = n_splits == 1 or sums_splits
    block_m, block_n, num_warps, num_stages = tiles_for(M, N, tensor_cores=tensor_cores, sums_splits=sums_splits)
    target = out if in_program else torch.empty((n_splits, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), 1 if in_program else n_splits)
    common = dict(HAS_BIAS=bias is not None and in_program, F32_DOT=f32_dot,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages)
    so_split = 0 if in_program else target.stride(0)
    if tma:
        block_k = WIDE_BLOCK_K if k_per_split % WIDE_BLOCK_K == 0 else BLOCK_K
        common["BLOCK_K"] = block_k
        x_desc = TensorDescriptor.from_tensor(x2, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
        steps = k_per_split // block_k * (n_splits if in_program else 1)
        _wide_linear_kernel[grid](x_desc, w_desc, bias_arg, target, M, N, k_per_split, steps,
                                  target.stride(-2), so_split, SPLITS_IN_PROGRAM=sums_splits,
                                  **common)
    else:
        walked = k_per_split if n_splits > 1 else K
        common["BLOCK_K"] = SMALL_BLOCK_K if walked % SMALL_BLOCK_K == 0 else BLOCK_K
        _linear_kernel[grid](x2, weight, bias_arg, target, M, N, K, walked,
                             x2.stride(0), weight.stride(0), target.stride(-2), so_split, **common)
    if not in_program:
        _sum_splits_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            target, bias_arg, out, M, N,
            SPLITS=n_splits, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], N)
