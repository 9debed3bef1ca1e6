"""The k largest values of each row, best first, ties to the lower index (a stable descending sort's first k).

The draft's tree growth ranks every frontier node's children over the whole draft vocabulary (32k
log-probs a row) and then its candidates; a tie must go to the lower index, as the host rule's stable
sort gives it, so that the device and host trees are the same. In torch ops that rule costs about 16
launches a call, two radix top-k passes over the row and a cumulative sum among them (on the H200
about 0.6 ms of a 2.6 ms draft call at batch 1, see BENCHMARKS.md); here it is two launches:

1. each program takes one chunk of a row and picks its k best by k rounds of (max, then the lowest
   index holding it), writing k (value, index) pairs;
2. one program per row merges its chunks' pairs by the same rounds.

Meant for small k (a tree's top-k, its kept nodes): the rounds are sequential, so callers with large
k take the reference (`top_k_ranked`).
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

MAX_K = 32  # above this the k sequential rounds cost more than the reference's sorts
CHUNK = 1024  # row elements per program of the first pass (32 programs a row for a 32k vocabulary)
MIN_CHUNK = 128  # shorter rows (a tree's candidates) take this block: fewer variants to compile
MIN_MERGE_BLOCK = 32


def top_k_ranked_reference(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their indices, best first, ties to the lower
    index (what a stable descending sort gives), without sorting the row: the k-th value
    bounds the choice, and among values equal to it the lowest indices fill the rest."""
    kth = values.topk(k, -1).values[..., -1:]
    above = values > kth
    at = values == kth
    need = k - above.sum(-1, keepdim=True)
    taken = above | (at & (at.cumsum(-1) <= need))
    idx = taken.to(values.dtype).topk(k, -1).indices.sort(-1).values  # the k taken, by index
    picked = values.gather(-1, idx)
    order = torch.sort(picked, dim=-1, descending=True, stable=True).indices
    return picked.gather(-1, order), idx.gather(-1, order)


@triton.jit
def _best_rounds(values, index, alive, out_values, out_index, k, FINAL: tl.constexpr):
    """k rounds over one block: the largest alive value, then the lowest alive index holding it.
    A round that finds none (a chunk shorter than k; NaNs) writes the index 2**31 - 1, which the
    final pass turns into 0 so that no caller gathers out of bounds."""
    for j in range(k):
        best = tl.max(tl.where(alive, values, float("-inf")), 0)
        at = tl.min(tl.where(alive & (values == best), index, 2147483647), 0)
        tl.store(out_values + j, best)
        if FINAL:
            tl.store(out_index + j, tl.where(at == 2147483647, 0, at))
        else:
            tl.store(out_index + j, at)
        alive = alive & (index != at)


# k, the row's length and stride are run-time values, not specialised on: a tree's budget trimmed
# near max_tokens asks for other k (its kept nodes) and other rows (its candidates), and with k a
# constexpr every new one compiled both kernels while serving (0.05-0.11 s each on the H200).
# Only the block sizes pick variants, and warm_up() compiles them all at start-up.
@triton.jit(do_not_specialize=["sx", "n", "chunks", "k"])
def _chunk_top_k_kernel(X, Vals, Idx, sx, n, chunks, k, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    alive = offs < n
    x = tl.load(X + row * sx + offs, mask=alive, other=float("-inf"))
    out = (row * chunks + chunk) * k
    _best_rounds(x, offs, alive, Vals + out, Idx + out, k, False)


@triton.jit(do_not_specialize=["k", "m"])
def _merge_top_k_kernel(Vals, Idx, OutV, OutI, k, m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < m
    v = tl.load(Vals + row * m + offs, mask=valid, other=float("-inf"))
    i = tl.load(Idx + row * m + offs, mask=valid, other=2147483647)
    _best_rounds(v, i, valid & (i != 2147483647), OutV + row * k, OutI + row * k, k, True)


def _chunk_size(n: int) -> int:
    """Row elements per first-pass program: rows shorter than MIN_CHUNK share one block size."""
    return max(MIN_CHUNK, min(CHUNK, triton.next_power_of_2(n)))


def _merge_block(chunks: int, k: int) -> int:
    return max(MIN_MERGE_BLOCK, triton.next_power_of_2(chunks * k))


def top_k_ranked_triton(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as top_k_ranked_reference for values [..., n] (float32 or float64), k <= MAX_K."""
    n = values.shape[-1]
    if not 1 <= k <= min(n, MAX_K):
        raise ValueError(f"k must be within [1, {min(n, MAX_K)}] for rows of {n}, got {k}")
    if values.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"values must be float32 or float64, got {values.dtype}")
    rows = values.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    chunk = _chunk_size(n)
    chunks = triton.cdiv(n, chunk)
    r = rows.shape[0]
    part_values = torch.empty(r, chunks * k, dtype=values.dtype, device=values.device)
    part_index = torch.empty(r, chunks * k, dtype=torch.int32, device=values.device)
    out_values = torch.empty(r, k, dtype=values.dtype, device=values.device)
    out_index = torch.empty(r, k, dtype=torch.long, device=values.device)
    if r:
        _chunk_top_k_kernel[(r, chunks)](rows, part_values, part_index, rows.stride(0), n, chunks, k,
                                         CHUNK=chunk, num_warps=4)
        _merge_top_k_kernel[(r,)](part_values, part_index, out_values, out_index, k, chunks * k,
                                  BLOCK=_merge_block(chunks, k), num_warps=4)
    shape = (*values.shape[:-1], k)
    return out_values.view(shape), out_index.view(shape)


def top_k_ranked(values: torch.Tensor, k: int, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_ranked_reference's result: with use_triton, two Triton launches where k is small
    (interpreted on a CPU), else the reference's torch ops."""
    if use_triton and k <= MAX_K and values.dtype in (torch.float32, torch.float64):
        return top_k_ranked_triton(values, k)
    return top_k_ranked_reference(values, k)


def warm_up(device: torch.device | str, longest_row: int,
            dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)) -> int:
    """Compile every variant top_k_ranked_triton can launch for rows of up to `longest_row` values
    (the draft vocabulary): each first-pass block size, and each merge block up to MAX_K rounds,
    so that no served call waits for Triton. Returns the number of launches run."""
    runs = 0
    most_chunks = triton.cdiv(longest_row, CHUNK)
    for dtype in dtypes:
        chunk = MIN_CHUNK
        while chunk <= CHUNK:  # a row of `chunk` values takes that first-pass block
            top_k_ranked_triton(torch.zeros(1, chunk, dtype=dtype, device=device), 1)
            runs += 1
            chunk *= 2
        merges: dict[int, tuple[int, int]] = {}  # merge block -> a (chunks, k) that launches it
        for chunks in range(1, most_chunks + 1):
            for k in range(1, MAX_K + 1):
                merges.setdefault(_merge_block(chunks, k), (chunks, k))
        for chunks, k in merges.values():  # rows of whole CHUNKs: k <= MAX_K fits any of them
            top_k_ranked_triton(torch.zeros(1, chunks * CHUNK, dtype=dtype, device=device), k)
            runs += 1
    return runs
