"""Rotary position embedding as tandem.layers.Rotary.apply does it (rotate-half, float32 math)."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; positions: [T]; cos/sin: [max_position, D] float32 tables."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * c + rotated.float() * s).to(x.dtype)


@triton.jit
def _rope_kernel(X, Pos, Cos, Sin, Out, sx_t, sx_h, so_t, so_h, sc, ss,
                 HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < HEADS) & (d < HALF)
    d_ok = d < HALF
    x1 = tl.load(X + t * sx_t + h * sx_h + d, mask=mask, other=0.0)
    x2 = tl.load(X + t * sx_t + h * sx_h + HALF + d, mask=mask, other=0.0)
    # The tables hold both halves (cat(freqs, freqs)); read each as the reference does.
    c1 = tl.load(Cos + pos * sc + d, mask=d_ok, other=0.0)
    c2 = tl.load(Cos + pos * sc + HALF + d, mask=d_ok, other=0.0)
    s1 = tl.load(Sin + pos * ss + d, mask=d_ok, other=0.0)
    s2 = tl.load(Sin + pos * ss + HALF + d, mask=d_ok, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    out1 = x1f * c1 + (-x2f) * s1
    out2 = x2f * c2 + x1f * s2
    tl.store(Out + t * so_t + h * so_h + d, out1.to(Out.dtype.element_ty), mask=mask)
    tl.store(Out + t * so_t + h * so_h + HALF + d, out2.to(Out.dtype.element_ty), mask=mask)


def rope_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as rope_reference; x may be a strided view (e.g. a slice of fused qkv).
    `out` (x's shape and dtype, last dim contiguous) receives the result if given."""
    T, heads, dim = x.shape
    if dim % 2:
        raise ValueError(f"head_dim must be even, got {dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {x.dtype} tensor of shape {tuple(x.shape)}")
    if T:
        _rope_kernel[(T,)](x, positions.contiguous(), cos, sin, out, x.stride(0), x.stride(1),
                           out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
                           HEADS=heads, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                           BLOCK_HALF=triton.next_power_of_2(dim // 2), num_warps=4)
    return out
