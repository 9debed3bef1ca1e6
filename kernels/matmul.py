"""A batch-invariant linear layer: a row's result does not depend on the other rows.

cuBLAS picks its algorithm (tile shape, split-K, the instruction) by the
problem's shape, so the same activation row multiplied alone and among 63
others can round differently in bf16, and a near-tie argmax can flip: that is
how speculation changed greedy output on the GPU (BENCHMARKS.md, issue 19).
This kernel has one configuration for every M: fixed tiles, the reduction over
K in BLOCK_K steps from k = 0 upward, no split-K. An output element is then
computed by the same instructions in the same order whatever M is and wherever
its row falls in a tile, so it is bitwise the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import interpreting, tl, triton

# The configuration never depends on M (the rows): BLOCK_M stays the same at
# M = 1 and at a 2k-token prefill (on Hopper a smaller M tile would switch the
# instruction). It may depend on the weight's shape, which is fixed per layer:
# narrow weights (o_proj, down_proj: N = 4096) get narrower column tiles so that
# more programs share the memory bandwidth at small M.
BLOCK_M = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3
MIN_PROGRAMS = 256  # column tiles wanted per row tile before BLOCK_N drops to 32


def block_n_for(n: int) -> int:
    return 64 if triton.cdiv(n, 64) >= MIN_PROGRAMS else 32


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# M changes every step: not specialised, so no step waits for a compile and one binary serves all M.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, B, Out, M, N, K, sx_m, sw_n, so_m,
                   HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
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
    tl.store(Out + offs_m[:, None] * so_m + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K], each output row
    bitwise independent of how many rows x has. float32 runs at IEEE precision (no TF32)."""
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
    if M:
        # The interpreter multiplies bf16 dot operands as raw bits: there they go through float32.
        f32_dot = x.dtype == torch.float32 or interpreting()
        block_n = block_n_for(N)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n))
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, out, M, N, K,
                             x2.stride(0), weight.stride(0), out.stride(0),
                             HAS_BIAS=bias is not None, F32_DOT=f32_dot,
                             BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                             num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out.view(*x.shape[:-1], N)
