"""log(sum(exp(x))) over each row of a matrix, computed the same way for every row.

torch.logsumexp on a GPU picks its reduction's layout (threads per row, blocks that
split a row) from the tensor's shape, so a row of logits alone and the same row among
others can come out a few ulps apart: the batch-invariant target (issue 19) would then
report another log-prob for a token verified in a tree than for the same token decoded
plainly. Here one program reduces one row, in fixed BLOCK chunks whatever the number of
rows, in one pass: each lane walks its chunks in order, and the lanes are added by one
fixed tree at the end.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

BLOCK = 4096  # fixed: it sets the order of a row's sum
NUM_WARPS = 8  # fixed too: it sets how the lanes' sums are added at the end


def logsumexp_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.float(), -1)


@triton.jit
def _logsumexp_kernel(X, Out, V, sx, BLOCK: tl.constexpr):
    """One pass over the row: each lane keeps the largest value it has seen and the sum of
    exp(x - that value), rescaled when it grows (online softmax); then the lanes' sums are
    brought to the row's maximum and added. A lane that has seen only -inf keeps 0."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(X + row * sx + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, x)
        finite = new_top != float("-inf")
        safe_top = tl.where(finite, new_top, 0.0)
        total = tl.where(finite, total * tl.exp(top - safe_top) + tl.exp(x - safe_top), 0.0)
        top = new_top
    row_max = tl.max(top, 0)
    # A row of -inf (every token masked) has no finite maximum: shift by 0 instead, giving -inf.
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    lane_sums = tl.where(top != float("-inf"), total * tl.exp(top - shift), 0.0)
    tl.store(Out + row, tl.log(tl.sum(lane_sums, 0)) + shift)


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, V] -> float32 [rows], each row bitwise independent of the others."""
    if x.dim() != 2:
        raise ValueError(f"logsumexp_rows takes [rows, V], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _logsumexp_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
