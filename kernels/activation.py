"""The gated MLP's activation: silu(gate) * up from the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first). Rounds as torch's two ops do: silu to the dtype, then the product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(GU, Out, s_gu, s_out, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(GU + row * s_gu + offs, mask=mask, other=0.0)
    u = tl.load(GU + row * s_gu + I + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(Out + row * s_out + offs, (act.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty),
             mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_mul_reference for 2-D input: one kernel instead of three
    (chunk views are free; silu and the product are two launches and a round trip)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(4096, triton.next_power_of_2(inter))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                         I=inter, BLOCK=block, num_warps=4)
    return out
