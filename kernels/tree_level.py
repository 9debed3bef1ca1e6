"""The bookkeeping between two levels of the draft's tree growth, in one launch a level.

After a level's frontier has run through the draft and each frontier node has its k best children
(log-probs and draft ids, `top_k_ranked`), draft_service.device_tree records the k*k new candidates
(token, parent, level, log-prob, score = parent score + log-prob in float64), picks the next frontier
(the k best scores, ties to the earlier candidate as a stable sort gives them, in creation order), and
sets up the next level's run: its tokens (target ids through d2t), positions, and ancestor words (a
node's word is its parent's plus its own bit). In torch ops that is about twenty launches a level
(gathers, scatters, two sorts): on the H200, at batch 1, most of a level's small kernels, each a
launch of 1-3 us for a few hundred bytes (BENCHMARKS.md, "The draft call in fewer launches"). Here
one program per request does it all. The same goes for the growth's last step, the selection of the
kept nodes (about fifteen launches: a top-k, a sort, a scatter, gathers).

`grow_level_reference` and `select_reference` are the torch rules (device_tree's code before these
kernels); the tests hold each kernel equal to its rule, ties included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels._triton import tl, triton
from kernels.topk import top_k_ranked_reference

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
                         has_next: bool, own_words: torch.Tensor | None = None) -> NextLevel:
    """Records run `run`'s children as candidates created .. created + k*k - 1 and picks the next
    frontier. frontier [B, k]: this run's nodes; child_lp, child_ids [B * k, k]; lengths [B]; words
    [B, R] (each request's run slots; with has_next, run + 1's slots are written); own_words [R]: each
    slot's own bit, made once by the caller (None: made here, two launches more inside a graph)."""
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
        own = (own_words[slots] if own_words is not None
               else 1 << torch.arange((run + 1) * K, (run + 2) * K, device=words.device))
        words[:, slots] = words.gather(1, run * K + parent) | own
    token = d2t[child_ids.view(B, K * K).gather(1, best)]
    positions = (lengths[:, None] + (run + 1)).expand(B, K)
    return NextLevel(created + best, parent, token, positions)


@triton.jit
def _best_lanes(score, alive, lanes, count, BLOCK: tl.constexpr):
    """The `count` alive lanes of largest score as a mask: rounds of the largest score left, then the lowest
    lane holding it (a stable descending sort's first `count`)."""
    taken = lanes < 0
    for _ in range(count):
        best = tl.max(tl.where(alive, score, float("-inf")), 0)
        at = tl.min(tl.where(alive & (score == best), lanes, BLOCK), 0)
        taken = taken | (lanes == at)
        alive = alive & (lanes != at)
    return taken


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
    # The k best, then taken in ascending order: k rounds of the lowest taken lane.
    taken = _best_lanes(score, valid, lanes, K, BLOCK)
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


def select_reference(cand: Candidates, n: int, d2t: torch.Tensor, out: torch.Tensor,
                     top_k: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = top_k_ranked_reference,
                     depths: torch.Tensor | None = None) -> None:
    """The tree's kept nodes: the n best scores (ties to the earlier candidate), in creation order,
    into out [B, 5 * n] int32: each request's target ids, parents' indices among the kept (-1: the
    root), depths (from 1), and the float32 bits of log-probs and scores. top_k: top_k_ranked's
    contract (its Triton launches where the growth's other top-k run on Triton). depths [B]: each
    request's own depth; its candidates of level depth or more score -inf (kept only where it has
    fewer than n others, and then last: see device_tree.BatchTreeGrowth.load)."""
    B, C = cand.token.shape
    if depths is not None:
        cand = cand._replace(score=cand.score.masked_fill(cand.level >= depths[:, None], float("-inf")))
    chosen = top_k(cand.score, n)[1].sort(-1).values  # [B, n] candidate indices, ascending
    index_of = torch.full((B, C + 1), -1, dtype=torch.long, device=cand.token.device)
    index_of.scatter_(1, chosen, torch.arange(n, device=cand.token.device).expand(B, n))
    parents = cand.parent.gather(1, chosen)
    rows = out.view(B, 5, n)  # int32: each copy below converts as it writes
    rows[:, 0] = d2t[cand.token.gather(1, chosen)]
    rows[:, 1] = index_of.gather(1, torch.where(parents >= 0, parents, C))
    rows[:, 2] = cand.level.gather(1, chosen) + 1
    rows[:, 3] = cand.lp.gather(1, chosen).view(torch.int32)
    rows[:, 4] = cand.score.gather(1, chosen).float().view(torch.int32)


@triton.jit(do_not_specialize=["C", "n"])
def _select_kernel(CandToken, CandParent, CandLevel, CandLp, CandScore, D2t, Depths, Out, C, n, BLOCK: tl.constexpr,
                   HAS_DEPTHS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    valid = lanes < C
    score = tl.load(CandScore + b * C + lanes, mask=valid, other=float("-inf"))
    if HAS_DEPTHS:  # select_reference's depths, here rather than in a launch of its own
        level = tl.load(CandLevel + b * C + lanes, mask=valid, other=0)
        score = tl.where(level < tl.load(Depths + b), score, float("-inf"))
    kept = _best_lanes(score, valid, lanes, n, BLOCK)
    left = kept
    row = Out + b * 5 * n
    for j in range(n):  # the kept in creation order
        at = tl.min(tl.where(left, lanes, BLOCK), 0)
        left = left & (lanes != at)
        parent = tl.load(CandParent + b * C + at)
        # A parent's index among the kept is how many kept candidates precede it (-1: the root, or a
        # parent not kept, which a tree's scores never give: a child scores at most its parent).
        parent_kept = tl.sum((kept & (lanes == parent)).to(tl.int32), 0) > 0
        parent_index = tl.where((parent >= 0) & parent_kept, tl.sum((kept & (lanes < parent)).to(tl.int32), 0), -1)
        tl.store(row + j, tl.load(D2t + tl.load(CandToken + b * C + at)).to(tl.int32))
        tl.store(row + n + j, parent_index)
        tl.store(row + 2 * n + j, (tl.load(CandLevel + b * C + at) + 1).to(tl.int32))
        tl.store(row + 3 * n + j, tl.load(CandLp + b * C + at).to(tl.int32, bitcast=True))
        chosen_score = tl.sum(tl.where(lanes == at, score, 0.0), 0)
        tl.store(row + 4 * n + j, chosen_score.to(tl.float32).to(tl.int32, bitcast=True))


def select_triton(cand: Candidates, n: int, d2t: torch.Tensor, out: torch.Tensor,
                  depths: torch.Tensor | None = None) -> None:
    """select_reference in one launch (every tensor contiguous)."""
    B, C = cand.token.shape
    if B and n:
        block = _select_block(C)
        _select_kernel[(B,)](cand.token, cand.parent, cand.level, cand.lp, cand.score, d2t,
                             cand.level if depths is None else depths, out, C, n, BLOCK=block,
                             num_warps=1 if block <= 256 else 4, HAS_DEPTHS=depths is not None)


def _select_block(candidates: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(candidates))


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
               has_next: bool, use_triton: bool, own_words: torch.Tensor | None = None) -> NextLevel:
    """grow_level_reference's result: with use_triton one Triton launch (interpreted on a CPU), else torch ops."""
    if use_triton:
        return grow_level_triton(cand, frontier, child_lp, child_ids, created, run, d2t, lengths, words, has_next)
    return grow_level_reference(cand, frontier, child_lp, child_ids, created, run, d2t, lengths, words, has_next,
                                own_words)


def _zeros(C: int, device: torch.device | str) -> Candidates:
    return Candidates(*(torch.zeros(1, C, dtype=dtype, device=device)
                        for dtype in (torch.long, torch.long, torch.long, torch.float32, torch.float64)))


def warm_up(device: torch.device | str, max_topk: int, max_candidates: int) -> int:
    """Compile every variant grow_level_triton can launch for k up to max_topk (one per block of
    lanes) and select_triton for trees of up to max_candidates candidates, so that no served call
    waits for Triton. Returns the number of launches run."""
    runs = 0
    block = MIN_BLOCK
    while True:  # a tree of `block` candidates (or of all there may be) takes that block
        # With depths, as device_tree always selects.
        select_triton(_zeros(min(block, max_candidates), device), 1, torch.zeros(1, dtype=torch.long, device=device),
                      torch.zeros(1, 5, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32,
                                                                                      device=device))
        runs += 1
        if block >= max_candidates:
            break
        block *= 2
    ints = {"dtype": torch.long, "device": device}
    blocks = set()
    for k in range(1, max_topk + 1):
        if _block(k) in blocks:
            continue
        blocks.add(_block(k))
        frontier = torch.arange(k, device=device)[None].contiguous()
        grow_level_triton(_zeros(k + k * k, device), frontier, torch.zeros(k, k, device=device),
                          torch.zeros(k, k, **ints), k, 0, torch.zeros(1, **ints), torch.zeros(1, **ints),
                          torch.zeros(1, 2 * k, **ints), True)
        runs += 1
    return runs
