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


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's update and the next norm: s = x + residual (in x's dtype),
    then (s, rms_norm(s))."""
    s = x + residual
    return s, rms_norm_reference(s, weight, eps)


@triton.jit
def _add_rms_norm_kernel(X, R, W, Sum, Out, sx, sr, ss, so, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * sx + offs, mask=mask, other=0.0)
    r = tl.load(R + row * sr + offs, mask=mask, other=0.0)
    # The sum is rounded to the stream's dtype before the statistics, as x + residual is.
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(Sum + row * ss + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, 0) / N + eps)
    normed = (sf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * so + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as add_rms_norm_reference for 2-D x and residual [T, N]: one
    kernel instead of an add and a norm (two launches and a re-read per layer, twice)."""
    if x.shape != residual.shape or x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit")
    x, residual = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
    n = x.shape[1]
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight.contiguous(), total, out, x.stride(0),
                                            residual.stride(0), total.stride(0), out.stride(0), eps,
                                            N=n, BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 4096 else 4)
    return total, out
