"""RMSNorm as tandem.layers.rms_norm computes it: float32 statistics, cast back, then scale."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face Llama order: normalise in float32, cast to x's dtype, then
    # multiply by the weight in the promoted dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@triton.jit
def _rms_norm_kernel(X, W, Out, sx, so, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * sx + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    # Round to x's dtype before the weight, as the reference does.
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * so + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., N]; weight: [N]. One program per row; `out` (contiguous, x's shape) if given."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(x.shape)}")
    out2 = out.view(-1, n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out2, x2.stride(0), out2.stride(0), eps,
                                         N=n, BLOCK=triton.next_power_of_2(n),
                                         num_warps=8 if n >= 4096 else 4)
    return out
