"""A linear layer for calls of a few rows (decode at batch 1-4): a Triton GEMV.

At one request the target's forward is memory-bound: every weight is read once
per step for one row of activations. On an H200 the forward at batch 1 took
4.8 ms against 3.6 ms for reading the weights at 4.2 TB/s (BENCHMARKS.md, issue
11), most of it in cuBLAS's small-M GEMMs. This kernel streams each weight
once with wide loads and reduces on the CUDA cores: a program owns BLOCK_N
output columns, walks all of K in BLOCK_K steps (no split of K, so no partials
and no second kernel) and keeps the few rows' float32 sums in registers.

Off by default (ENABLED): cuBLAS stays the default until an H200 shows this is
faster (`bench/step_cost.py --gemv`, `bench/engine_step.py --gemv`). Where it is
off, or the call has more than MAX_ROWS rows, or runs on the CPU, linear() is
F.linear. Not batch-invariant: the --deterministic mode keeps kernels.matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton
from kernels.matmul import linear_operands

ENABLED = False
MAX_ROWS = 4  # calls of more rows take F.linear: beyond a few rows the tensor cores win
BLOCK_N = 32  # output columns per program: qkv of Llama-8B gives 192 programs, o_proj and down_proj 128
BLOCK_K = 256  # K per step with one row; halved for each doubling of the rows (registers)
NUM_WARPS = 4
NUM_STAGES = 4  # loads in flight per program: memory-bound, so deep


@triton.jit
def _gemv_kernel(X, W, B, Out, M, N, K, sx_m, sw_n, so_m,
                 HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out[:M, cols] = X[:M] @ W[cols].T (+ bias) for the program's BLOCK_N columns; ROWS >= M
    (a power of two). One row is written without a row axis: [BLOCK_N, BLOCK_K] products."""
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = offs_n < N
    if ROWS == 1:
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x = tl.load(X + offs_k, mask=k_ok, other=0.0)
            acc1 += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc1 += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(Out + offs_n, acc1.to(Out.dtype.element_ty), mask=n_ok)
    else:
        offs_r = tl.arange(0, ROWS)
        r_ok = offs_r < M
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w = tl.load(W + offs_n[:, None] * sw_n + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x = tl.load(X + offs_r[:, None] * sx_m + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_r[:, None] * so_m + offs_n[None, :], acc.to(Out.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


def rows_block(m: int) -> int:
    """The kernel's row tile for a call of m rows: m rounded up to a power of two."""
    return triton.next_power_of_2(max(1, m))


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most MAX_ROWS rows, weight [N, K], with the kernel
    above (on the CPU under TRITON_INTERPRET=1). float32 sums whatever the dtype."""
    x2, weight = linear_operands(x, weight, bias)
    M, N, K = x2.shape[0], weight.shape[0], x2.shape[1]
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: the GEMV takes at most {MAX_ROWS}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        rows = rows_block(M)
        block_k = max(16, BLOCK_K // rows)  # the product [rows, BLOCK_N, block_k] stays one size
        _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](
            x2, weight, bias if bias is not None else weight, out, M, N, K,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, ROWS=rows, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The target's default linear layer: the GEMV for calls of few rows on a GPU where ENABLED,
    F.linear otherwise (read at every call, so a bench can switch it before the graphs are captured)."""
    if ENABLED and x.is_cuda and x.numel() <= MAX_ROWS * x.shape[-1]:
        return linear_gemv(x, weight, bias)
    return F.linear(x, weight, bias)
