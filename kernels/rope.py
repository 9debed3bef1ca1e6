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
def _rotate(x1, x2, Cos, Sin, pos, sc, ss, d, d_ok, HALF: tl.constexpr):
    """Both halves of rotate-half RoPE in float32. The tables hold both halves
    (cat(freqs, freqs)); each is read as the reference does."""
    c1 = tl.load(Cos + pos * sc + d, mask=d_ok, other=0.0)
    c2 = tl.load(Cos + pos * sc + HALF + d, mask=d_ok, other=0.0)
    s1 = tl.load(Sin + pos * ss + d, mask=d_ok, other=0.0)
    s2 = tl.load(Sin + pos * ss + HALF + d, mask=d_ok, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    return x1f * c1 + (-x2f) * s1, x2f * c2 + x1f * s2


@triton.jit
def _rope_kernel(X, Pos, Cos, Sin, Out, sx_t, sx_h, so_t, so_h, sc, ss,
                 HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    mask = (h < HEADS) & d_ok
    x1 = tl.load(X + t * sx_t + h * sx_h + d, mask=mask, other=0.0)
    x2 = tl.load(X + t * sx_t + h * sx_h + HALF + d, mask=mask, other=0.0)
    out1, out2 = _rotate(x1, x2, Cos, Sin, pos, sc, ss, d, d_ok, HALF)
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


def rope_qkv_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (q_heads + 2 kv_heads) * D] from the fused projection. Returns rotated q
    [T, q_heads, D], rotated k and v [T, kv_heads, D]."""
    T = qkv.shape[0]
    dim = qkv.shape[1] // (q_heads + 2 * kv_heads)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return (rope_reference(q.reshape(T, q_heads, dim), positions, cos, sin),
            rope_reference(k.reshape(T, kv_heads, dim), positions, cos, sin), v.reshape(T, kv_heads, dim))


@triton.jit
def _rope_qkv_kernel(QKV, Pos, Cos, Sin, QOut, KOut, VOut, Rows, s_qkv, s_q, s_k, s_v, sc, ss,
                     QH: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_ROWS: tl.constexpr):
    # Program (t, g): token t; g = 0 rotates the query heads, 1 the key heads and copies
    # the value heads. Head h of a group sits at column h * 2 * HALF of its part of qkv.
    # HAS_ROWS: token t's outputs go to row Rows[t] of QOut, KOut and VOut (else row t).
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(Pos + t).to(tl.int64)
    dest = tl.load(Rows + t).to(tl.int64) if HAS_ROWS else t
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HALF
    heads = tl.where(g == 0, QH, KVH)
    mask = (h < heads) & d_ok
    src = QKV + t * s_qkv + tl.where(g == 0, 0, QH * 2 * HALF) + h * 2 * HALF
    x1 = tl.load(src + d, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + d, mask=mask, other=0.0)
    out1, out2 = _rotate(x1, x2, Cos, Sin, pos, sc, ss, d, d_ok, HALF)
    out1 = out1.to(QOut.dtype.element_ty)
    out2 = out2.to(QOut.dtype.element_ty)
    if g == 0:
        tl.store(QOut + dest * s_q + h * 2 * HALF + d, out1, mask=mask)
        tl.store(QOut + dest * s_q + h * 2 * HALF + HALF + d, out2, mask=mask)
    else:
        tl.store(KOut + dest * s_k + h * 2 * HALF + d, out1, mask=mask)
        tl.store(KOut + dest * s_k + h * 2 * HALF + HALF + d, out2, mask=mask)
        vsrc = QKV + t * s_qkv + (QH + KVH) * 2 * HALF + h * 2 * HALF
        v1 = tl.load(vsrc + d, mask=mask, other=0.0)
        v2 = tl.load(vsrc + HALF + d, mask=mask, other=0.0)
        tl.store(VOut + dest * s_v + h * 2 * HALF + d, v1, mask=mask)
        tl.store(VOut + dest * s_v + h * 2 * HALF + HALF + d, v2, mask=mask)


def rope_qkv_triton(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_heads: int, kv_heads: int, k_out: torch.Tensor | None = None,
                    v_out: torch.Tensor | None = None, *, q_out: torch.Tensor | None = None,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as rope_qkv_reference, in one kernel. k_out / v_out ([T, kv_heads, D],
    contiguous), when given, receive k and v: the target writes them straight into the
    step's K/V scratch, from which the accepted rows are committed to the cache. With `rows`
    ([T] row indices), q_out, k_out and v_out (contiguous [N, heads, D] each, all given) receive
    token t's q, k and v at row rows[t]: the draft's tree growth writes a level's nodes straight
    into their slots, which are not contiguous across requests."""
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        raise ValueError("qkv must be 2-D with a contiguous last dim")
    T, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    if dim * (q_heads + 2 * kv_heads) != width or dim % 2:
        raise ValueError(f"qkv width {width} does not split into {q_heads}+2x{kv_heads} even heads")
    outs = {"q_out": (q_out, q_heads), "k_out": (k_out, kv_heads), "v_out": (v_out, kv_heads)}
    if rows is not None:
        if rows.shape != (T,) or any(t is None for t, _ in outs.values()):
            raise ValueError("rows must be [T] and comes with q_out, k_out and v_out")
        for name, (t, heads) in outs.items():
            if t.dim() != 3 or t.shape[1:] != (heads, dim) or t.dtype != qkv.dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {qkv.dtype} tensor of shape [N, {heads}, {dim}]")
    else:
        for name, (t, heads) in outs.items():
            if t is not None and (t.shape != (T, heads, dim) or t.dtype != qkv.dtype or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous {qkv.dtype} tensor of shape {(T, heads, dim)}")
    q = q_out if q_out is not None else torch.empty(T, q_heads, dim, dtype=qkv.dtype, device=qkv.device)
    k = k_out if k_out is not None else torch.empty(T, kv_heads, dim, dtype=qkv.dtype, device=qkv.device)
    v = v_out if v_out is not None else torch.empty(T, kv_heads, dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    if T:
        positions = positions.contiguous()
        _rope_qkv_kernel[(T, 2)](qkv, positions, cos, sin, q, k, v, rows if rows is not None else positions,
                                 qkv.stride(0), q.stride(0), k.stride(0), v.stride(0), cos.stride(0), sin.stride(0),
                                 QH=q_heads, KVH=kv_heads, HALF=dim // 2,
                                 BLOCK_H=triton.next_power_of_2(max(q_heads, kv_heads)),
                                 BLOCK_HALF=triton.next_power_of_2(dim // 2), HAS_ROWS=rows is not None, num_warps=4)
    return q, k, v
