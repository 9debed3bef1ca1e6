"""Commit the accepted path: copy selected rows of a step's K/V into paged cache slots."""

from __future__ import annotations

import torch

from kernels._triton import tl, triton


def kv_write_reference(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rows: torch.Tensor, slots: torch.Tensor) -> None:
    """cache_k/v: [blocks, block_size, Hkv, D]; k, v: [T, Hkv, D]; rows, slots: [n].

    cache[flat slot slots[i]] = k/v[rows[i]]; every other slot is left as it was.
    """
    rows = rows.to(k.device, torch.long)
    slots = slots.to(k.device, torch.long)
    cache_k.view(-1, *cache_k.shape[2:]).index_put_((slots,), k[rows])
    cache_v.view(-1, *cache_v.shape[2:]).index_put_((slots,), v[rows])


@triton.jit
def _kv_write_kernel(
    CK, CV, K, V, Rows, Slots,
    sk_t, sk_h, sv_t, sv_h, sck_s, sck_h, scv_s, scv_h,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(Rows + i).to(tl.int64)
    slot = tl.load(Slots + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HEADS) & (d < HEAD_DIM)
    k = tl.load(K + row * sk_t + h * sk_h + d, mask=mask)
    v = tl.load(V + row * sv_t + h * sv_h + d, mask=mask)
    tl.store(CK + slot * sck_s + h * sck_h + d, k.to(CK.dtype.element_ty), mask=mask)
    tl.store(CV + slot * scv_s + h * scv_h + d, v.to(CV.dtype.element_ty), mask=mask)


def kv_write_triton(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Same contract as kv_write_reference, one program per written row."""
    if rows.shape != slots.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and slots {tuple(slots.shape)} must be equal 1-D shapes")
    if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
        raise ValueError("the cache must be contiguous: it is written in place")
    n = rows.shape[0]
    if n == 0:
        return
    heads, dim = k.shape[1], k.shape[2]
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    ck = cache_k.view(-1, *cache_k.shape[2:])
    cv = cache_v.view(-1, *cache_v.shape[2:])
    rows = rows.to(k.device, torch.int64)
    slots = slots.to(k.device, torch.int64)
    _kv_write_kernel[(n,)](
        ck, cv, k, v, rows, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1),
        HEADS=heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
    )


def kv_commit_reference(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slots: torch.Tensor) -> None:
    """Every layer at once. cache_k/v: [L, slots, Hkv, D] (flat slots); k, v: [L, T, Hkv, D]
    (a step's K/V scratch); slots: [T]. cache[l, slots[t]] = k/v[l, t] for every row t:
    rows that are not kept point at a trash slot."""
    slots = slots.to(k.device, torch.long)
    cache_k[:, slots] = k
    cache_v[:, slots] = v


@triton.jit
def _kv_commit_kernel(CK, CV, K, V, Slots, sck_l, sck_s, scv_l, scv_s, sk_l, sk_t, sv_l, sv_t,
                      ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + layer * sk_l + t * sk_t + offs, mask=mask)
    v = tl.load(V + layer * sv_l + t * sv_t + offs, mask=mask)
    tl.store(CK + layer * sck_l + slot * sck_s + offs, k.to(CK.dtype.element_ty), mask=mask)
    tl.store(CV + layer * scv_l + slot * scv_s + offs, v.to(CV.dtype.element_ty), mask=mask)


def kv_commit_triton(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """Same contract as kv_commit_reference: one launch for every row of every layer
    (it replaces one kv_write launch per layer after each step)."""
    L, T = k.shape[:2]
    if k.shape != v.shape or slots.shape != (T,) or cache_k.shape[0] != L or cache_k.shape[2:] != k.shape[2:]:
        raise ValueError(f"cache {tuple(cache_k.shape)}, k/v {tuple(k.shape)} and slots {tuple(slots.shape)} "
                         "do not fit")
    for t in (cache_k, cache_v, k, v):
        if t.stride(3) != 1 or t.stride(2) != t.shape[3]:
            raise ValueError("each row (heads x head_dim) must be contiguous")
    if T == 0:
        return
    row = k.shape[2] * k.shape[3]
    _kv_commit_kernel[(T, L)](cache_k, cache_v, k, v, slots, cache_k.stride(0), cache_k.stride(1),
                              cache_v.stride(0), cache_v.stride(1), k.stride(0), k.stride(1), v.stride(0),
                              v.stride(1), ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4)
