"""The bookkeeping between two levels of the draft's tree growth, in one launch a level.

After a level's frontier has run through the draft and each frontier node has its k best children
(log-probs and draft ids, `top_k_ranked`), draft_service.device_tree records the k*k new candidates
(token, parent, level, log-prob, score = parent score + log-prob in float64), picks the next frontier
(the k best scores, ties to the earlier candidate as a stable sort gives them, in creation order), and
sets up the next level's run: its tokens (target ids through d2t), positions, and ancestor words (a
node's word is its parent's plus its own bit). In torch ops that is about twenty launches a level
(gathers, scatters, two sorts): on the H200, at batch 1, most of a level's small kernels, each a
launch of 1-3 us for a few hundred bytes (BENCHMARKS.md, "The draft call in fewer launches"). Here
one program per request does it all.

`grow_level_reference` is the torch rule (device_tree's loop body before this kernel); the tests hold
the two equal, ties included.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import tl, triton

MIN_BLOCK = 16  # lanes for a level's k*k children: k <= 4 share one variant


class Candidates(NamedTuple):
    """Every candidate of a growth, in creation order: [B, C] each."""

    token: torch.Tensor  # draft ids, int64
    parent: torch.Tensor  # the parent's candidate index (-1: the root), int64
    level: torch.Tensor  # int64
    lp: torch.Tensor  # float32
    score: torch.Tensor  # float64


class NextLevel(NamedTuple):
    """What the next level runs: [B, k] each, int64."""

    frontier: torch.Tensor  # candidate indices, ascending
    parent: torch.Tensor  # each frontier node's parent among this level's frontier (0 .. k - 1)
    token: torch.Tensor  # target ids (d2t applied)
    positions: torch.Tensor


def grow_level_reference(cand: Candidates, frontier: torch.Tensor, child_lp: torch.Tensor, child_ids: torch.Tensor,
                         created: int, run: int, d2t: torch.Tensor, lengths: torch.Tensor, words: torch.Tensor,
                         has_next: bool) -> NextLevel:
    """Records run `run`'s children as candidates created .. created + k*k - 1 and picks the next
    frontier. frontier [B, k]: this run's nodes; child_lp, child_ids [B * k, k]; lengths [B]; words
    [B, R] (each request's run slots; with has_next, run + 1's slots are written)."""
    B, K = frontier.shape
    child_score = (cand.score.gather(1, frontier)[:, :, None] + child_lp.view(B, K, K)).reshape(B, K * K)
    new = slice(created, created + K * K)
    cand.token[:, new] = child_ids.view(B, K * K)
    cand.parent[:, new] = frontier[:, :, None].expand(B, K, K).reshape(B, K * K)
    cand.level[:, new] = run + 1
    cand.lp[:, new] = child_lp.view(B, K * K)
    cand.score[:, new] = child_score
    best = torch.sort(child_score, dim=-1, descending=True, stable=True).indices[:, :K].sort(-1).values
    parent = best // K
    if has_next:
        slots = slice((run + 1) * K, (run + 2) * K)
        own = 1 << torch.arange((run + 1) * K, (run + 2) * K, device=words.device)
        words[:, slots] = words.gather(1, run * K + parent) | own
    token = d2t[child_ids.view(B, K * K).gather(1, best)]
    positions = (lengths[:, None] + (run + 1)).expand(B, K)
    return NextLevel(created + best, parent, token, positions)


@triton.jit(do_not_specialize=["C", "R", "K", "created", "run", "has_next"])
def _grow_level_kernel(ChildLp, ChildIds, Frontier, CandToken, CandParent, CandLevel, CandLp, CandScore, D2t,
                       Lengths, Words, OutFrontier, OutParent, OutToken, OutPositions,
                       C, R, K, created, run, has_next, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kk = K * K
    lanes = tl.arange(0, BLOCK)
    valid = lanes < kk
    lp = tl.load(ChildLp + b * kk + lanes, mask=valid, other=0.0)
    ids = tl.load(ChildIds + b * kk + lanes, mask=valid, other=0)
    parent_cand = tl.load(Frontier + b * K + lanes // K, mask=valid, other=0)
    # float64, as torch promotes the float32 log-prob in the add
    score = tl.load(CandScore + b * C + parent_cand, mask=valid, other=0.0) + lp.to(tl.float64)
    row = b * C + created + lanes
    tl.store(CandToken + row, ids, mask=valid)
    tl.store(CandParent + row, parent_cand, mask=valid)
    tl.store(CandLevel + row, tl.zeros_like(ids) + run + 1, mask=valid)
    tl.store(CandLp + row, lp, mask=valid)
    tl.store(CandScore + row, score, mask=valid)
    # The k best: k rounds of the largest untaken score, then the lowest lane holding it (a stable
    # descending sort's first k); then the taken lanes in ascending order, k rounds of the lowest.
    alive = valid
    taken = lanes < 0
    for _ in range(K):
        best = tl.max(tl.where(alive, score, float("-inf")), 0)
        at = tl.min(tl.where(alive & (score == best), lanes, BLOCK), 0)
        taken = taken | (lanes == at)
        alive = alive & (lanes != at)
    length = tl.load(Lengths + b)
    for j in range(K):
        at = tl.min(tl.where(taken, lanes, BLOCK), 0)
        taken = taken & (lanes != at)
        parent = at // K
        out = b * K + j
        tl.store(OutFrontier + out, created + at)
        tl.store(OutParent + out, parent)
        tl.store(OutToken + out, tl.load(D2t + tl.sum(tl.where(lanes == at, ids, 0), 0)))
        tl.store(OutPositions + out, length + run + 1)
        if has_next:
            slot = (run + 1) * K + j
            word = tl.load(Words + b * R + run * K + parent)
            tl.store(Words + b * R + slot, word | (tl.full([], 1, tl.int64) << slot))


def _block(k: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(k * k))


def grow_level_triton(cand: Candidates, frontier: torch.Tensor, child_lp: torch.Tensor, child_ids: torch.Tensor,
                      created: int, run: int, d2t: torch.Tensor, lengths: torch.Tensor, words: torch.Tensor,
                      has_next: bool) -> NextLevel:
    """grow_level_reference's contract in one launch (every tensor contiguous, int64 and the
    reference's float dtypes)."""
    B, K = frontier.shape
    C, R = cand.token.shape[1], words.shape[1]
    out = torch.empty(4, B, K, dtype=torch.long, device=frontier.device)
    if B:
        _grow_level_kernel[(B,)](child_lp, child_ids, frontier, cand.token, cand.parent, cand.level, cand.lp,
                                 cand.score, d2t, lengths, words, out[0], out[1], out[2], out[3],
                                 C, R, K, created, run, int(has_next), BLOCK=_block(K), num_warps=1)
    return NextLevel(*out)


def grow_level(cand: Candidates, frontier: torch.Tensor, child_lp: torch.Tensor, child_ids: torch.Tensor,
               created: int, run: int, d2t: torch.Tensor, lengths: torch.Tensor, words: torch.Tensor,
               has_next: bool, use_triton: bool) -> NextLevel:
    """grow_level_reference's result: with use_triton one Triton launch (interpreted on a CPU), else torch ops."""
    grow = grow_level_triton if use_triton else grow_level_reference
    return grow(cand, frontier, child_lp, child_ids, created, run, d2t, lengths, words, has_next)


def warm_up(device: torch.device | str, max_topk: int) -> int:
    """Compile every variant grow_level_triton can launch for k up to max_topk (one per block of
    lanes), so that no served call waits for Triton. Returns the number of launches run."""
    runs, seen = 0, set()
    for k in range(1, max_topk + 1):
        if _block(k) in seen:
            continue
        seen.add(_block(k))
        B, C = 1, k + k * k
        cand = Candidates(*(torch.zeros(B, C, dtype=dtype, device=device)
                            for dtype in (torch.long, torch.long, torch.long, torch.float32, torch.float64)))
        frontier = torch.arange(k, device=device).expand(B, k).contiguous()
        ints = {"dtype": torch.long, "device": device}
        grow_level_triton(cand, frontier, torch.zeros(B * k, k, device=device), torch.zeros(B * k, k, **ints), k, 0,
                          torch.zeros(1, **ints), torch.zeros(B, **ints), torch.zeros(B, 2 * k, **ints), True)
        runs += 1
    return runs
