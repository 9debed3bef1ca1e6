"""EAGLE-2/3 tree growth for a batch of requests on the device, in fixed shapes.

The rule is tree_growth.TreeGrowth's (its docstring; the tests hold the two
equal): level 0 takes the root's top-k children; every later level runs the k
frontier nodes through the draft, takes each one's top-k children (score =
parent score + log-prob, float64), and the best k of those k*k become the next
frontier; finally the best num_draft_tokens - 1 candidates are kept, in
creation order. Ties go to the earlier candidate, as a stable sort would.

Here every request of a batch with one top-k and size grows at once, to the deepest
of their depths (each keeps only its own depth's nodes: see load), and nothing leaves
the device until the trees are done: a fixed frontier of B x k rows per level,
top-k without sorting the vocabulary, ancestor masks as bit words built level by
level (a node's word is its parent's plus its own bit), and the selection on the
device. The shapes depend only on (batch, budget), so on a GPU one CUDA graph per
(batch bucket, budget) replays the whole growth; a CPU runs the same code eagerly.

Layout: request b's frontier node j of run e (e = 1 .. steps - 1; level-0 nodes
are run at e = 1) lives in slot (e - 1) * k + j of b's rows, b * R .. b * R + R - 1
with R = (steps - 1) * k. Attention gives each run's nodes the request's paged
prefix plus the slots their ancestor words name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from draft_service.staging import StagedInput
from draft_service.types import DraftBudget
from kernels.topk import top_k_ranked
from kernels.tree_attention import StepLayout
from kernels.tree_level import Candidates, grow_level, select_reference, select_triton
from kernels.tree_metadata import SEQ_INFO_FIELDS, TreeAttnMetadata, choose_block_m, choose_num_splits
from tandem.graph_capture import capture_graphs

log = logging.getLogger(__name__)

INTS_PER_16_BYTES = 4  # int32s
MAX_SLOTS = 64  # run slots per request: one 64-bit ancestor word (5/4/8 uses 16, 6/8/16 uses 40)


def _aligned(count: int, multiple: int) -> int:
    """`count` rounded up to a multiple of `multiple`."""
    return -(-count // multiple) * multiple


def fits(budget: DraftBudget) -> bool:
    return not budget.empty and (budget.steps - 1) * budget.topk <= MAX_SLOTS


@dataclass(frozen=True)
class GrowthShape:
    batch: int
    budget: DraftBudget

    @property
    def k(self) -> int:
        return self.budget.topk

    @property
    def runs(self) -> int:
        return self.budget.steps - 1

    @property
    def slots(self) -> int:
        return max(1, self.runs * self.k)

    @property
    def candidates(self) -> int:
        return self.k + self.runs * self.k * self.k

    @property
    def kept(self) -> int:
        return self.budget.max_nodes


class BatchTreeGrowth:
    """The static buffers and (on CUDA) the graph of one (batch, budget)."""

    def __init__(self, model, kv, shape: GrowthShape, capture: bool, *, fused_levels: bool = False):
        self.model, self.kv, self.shape = model, kv, shape
        self.fused_levels = fused_levels  # grow_level's Triton launch (DraftEngine's fused_levels)
        dev, B, R, K = model.device, shape.batch, shape.slots, shape.k
        group = model.num_heads // model.num_kv_heads
        self.block_m = choose_block_m(K, group)
        self.per_tile = self.block_m // group
        self.tiles_per_run = -(-K // self.per_tile)
        tiles = B * self.tiles_per_run
        # ints: seq_info [B, 4] (a request's length first), then each run's tiles [tiles, 3], then each
        # request's depth (its own budget's steps: see load); one non-blocking copy a call. The depths
        # start on a 16-byte boundary: Triton specialises a pointer argument on that alignment, and
        # kernels.tree_level.warm_up compiles the aligned variant. Unaligned, a shortened depth's first
        # growth compiled the selection while a served step waited for it (0.12-0.23 s on an H100,
        # 2026-12-05: one such step cost a lone request's level 12% of its tok/s).
        depths_at = _aligned(SEQ_INFO_FIELDS * B + 3 * tiles * max(shape.runs, 1), INTS_PER_16_BYTES)
        self.ints_in = StagedInput((depths_at + B,), torch.int32, dev)
        self.ints = self.ints_in.device
        self.depths = self.ints[depths_at:]
        self.root_h = torch.zeros(B, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.words = torch.zeros(B * R, 1, dtype=torch.int64, device=dev)
        self.q = torch.zeros(B * R, model.num_heads, model.head_dim, dtype=model.dtype, device=dev)
        self.k_scratch = torch.zeros(B * R, model.num_kv_heads, model.head_dim, dtype=model.dtype, device=dev)
        self.v_scratch = torch.zeros_like(self.k_scratch)
        self.out = torch.zeros(B, 5 * max(shape.kept, 1), dtype=torch.int32, device=dev)
        # Constants of the growth, made once (in a graph each would be kernels every replay): every slot's
        # own ancestor bit, and level 0's frontier.
        self.own_words = (1 << torch.arange(R, device=dev)).repeat(B)[:, None].contiguous()
        self.first_frontier = torch.arange(K, device=dev).repeat(B, 1)
        # Each run's rows of q and the K/V scratch, request by request (fused levels write them straight there).
        run_start = torch.arange(shape.runs, device=dev)[:, None, None] * K
        request_start = torch.arange(B, device=dev)[None, :, None] * R
        self.run_rows = (run_start + request_start + torch.arange(K, device=dev)).reshape(shape.runs, B * K)
        self.splits = choose_num_splits(tiles * model.num_kv_heads, model.max_position, dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capture_seconds = 0.0
        # The layout the ints' host buffer holds from the last call (see _write_layout): (requests, padding row).
        self._layout: tuple[int, int] | None = None
        if capture:
            self._capture()

    # --- inputs -------------------------------------------------------------------
    def load(self, root_h: list[torch.Tensor], lengths: list[int], table_rows: list[int], padding_row: int,
             host_slots: list[np.ndarray] | None = None, depths: list[int] | None = None) -> None:
        """The requests of this call (fewer than the bucket's batch: the rest are padding): each
        one's last pre-norm h (on the device), computed length and block-table row, and the depth its
        tree keeps (default the shape's): every request grows to the shape's depth, and the selection
        takes a request's best nodes of levels below its own depth only. Levels grow the same whatever
        comes after them, so these are the nodes a growth to that depth alone keeps."""
        B = self.shape.batch
        n = len(lengths)
        if depths is not None and (len(depths) != n or any(not 1 <= d <= self.shape.budget.steps for d in depths)):
            raise ValueError(f"{n} requests need depths 1..{self.shape.budget.steps}, got {depths}")
        ints = self.ints_in.host().numpy()
        info = ints[: SEQ_INFO_FIELDS * B].reshape(B, SEQ_INFO_FIELDS)
        if self._layout != (n, padding_row):
            self._write_layout(ints, n, padding_row)
            self.root_h[n:].zero_()  # padding requests grow from zeros (nothing else writes root_h)
        info[:n, 0] = lengths
        info[:n, 3] = table_rows
        ints[-B:] = self.shape.budget.steps
        if depths is not None:
            ints[-B:][:n] = depths
        self.ints_in.send()
        if n:
            torch.stack(root_h, out=self.root_h[:n])
        if self.model.attention.name == "torch":
            self.host_slots = host_slots or [np.zeros(0, dtype=np.int64)] * n

    def _write_layout(self, ints: np.ndarray, n: int, padding_row: int) -> None:
        """What the ints hold for any call of n requests: the padding requests' info, every request's
        offset and slots, each run's tiles. The host buffer keeps it between calls, so a call of as many
        requests as the last writes only lengths, table rows and depths (each numpy op a call leaves out
        is some microseconds warm, and several times that cold)."""
        B, R, K = self.shape.batch, self.shape.slots, self.shape.k
        info = ints[: SEQ_INFO_FIELDS * B].reshape(B, SEQ_INFO_FIELDS)
        info[:] = (0, 0, 0, padding_row)
        info[:, 1] = np.arange(B) * R
        info[:n, 2] = R
        at = SEQ_INFO_FIELDS * B
        for run in range(self.shape.runs):
            tiles = ints[at: at + 3 * B * self.tiles_per_run].reshape(B, self.tiles_per_run, 3)
            first = run * K + np.arange(self.tiles_per_run) * self.per_tile
            tiles[:, :, 0] = np.arange(B)[:, None]
            tiles[:, :, 1] = first
            tiles[:, :, 2] = np.minimum(self.per_tile, (run + 1) * K - first)
            tiles[n:, :, 2] = 0  # padding requests do nothing
            at += 3 * B * self.tiles_per_run
        self._layout = (n, padding_row)

    # --- the growth ---------------------------------------------------------------
    def _plan(self, run: int):
        """What run `run`'s attention reads: kernel metadata, or (torch backend) a layout."""
        B, R = self.shape.batch, self.shape.slots
        if self.model.attention.name == "triton":
            tile_off = SEQ_INFO_FIELDS * B + run * 3 * B * self.tiles_per_run
            return TreeAttnMetadata(
                ints=self.ints, info_off=0, tile_off=tile_off, block_table=self.kv.block_table.table,
                mask_words=self.words, batch=B, num_tiles=B * self.tiles_per_run, block_size=self.kv.block_size,
                group=self.model.num_heads // self.model.num_kv_heads, block_m=self.block_m,
                num_splits=self.splits)
        # The reference attends every row; rows of later runs see only themselves (their bit).
        bits = (self.words.view(B, R, 1) >> torch.arange(R, device=self.words.device)) & 1
        masks = bits.bool()
        slots = [torch.from_numpy(s) for s in self.host_slots]
        slots += [torch.zeros(0, dtype=torch.long)] * (B - len(slots))  # the padding requests
        return StepLayout(tuple(range(0, B * R, R)), (R,) * B, tuple(slots), tuple(masks[b] for b in range(B)))

    def _top_k(self, values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Two Triton launches where attention runs on Triton (a GPU; the interpreter in the CPU tests).
        return top_k_ranked(values, k, use_triton=self.model.attention.name == "triton")

    def run(self) -> None:
        """Grow every request's tree; results in self.out (read with `trees`)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._grow()

    def _grow(self) -> None:
        model, shape = self.model, self.shape
        B, K, R, runs, C = shape.batch, shape.k, shape.slots, shape.runs, shape.candidates
        dev = model.device
        heads, kv_heads, dim = model.num_heads, model.num_kv_heads, model.head_dim
        lengths = self.ints[: SEQ_INFO_FIELDS * B].view(B, SEQ_INFO_FIELDS)[:, 0].long()  # padding: 0
        # Every candidate, in creation order: [B, C] each, written level by level (each column once).
        cand = Candidates(*(torch.empty(B, C, dtype=dtype, device=dev)
                            for dtype in (torch.long, torch.long, torch.long, torch.float32, torch.float64)))
        # Level 0: the root's children, the first run's frontier.
        lp, ids = self._top_k(model.logprobs(self.root_h), K)  # [B, K]
        cand.token[:, :K] = ids
        cand.parent[:, :K] = -1
        cand.level[:, :K] = 0
        cand.lp[:, :K] = lp
        cand.score[:, :K] = lp
        frontier, token = self.first_frontier, model.d2t[ids]
        positions = lengths[:, None].expand(B, K)
        g = self.root_h[:, None, :].expand(B, K, -1)
        self.words.copy_(self.own_words)  # the first run's words: their own bits (the root has no slot)
        # A run's rows of every request: slots run * K .. run * K + K - 1 of each request's R.
        q_rows = self.q.view(B, R, heads, dim)
        k_rows = self.k_scratch.view(B, R, kv_heads, dim)
        v_rows = self.v_scratch.view(B, R, kv_heads, dim)
        created = K
        for run in range(runs):
            slots = slice(run * K, (run + 1) * K)
            if self.fused_levels:  # RoPE and the three writes into the run's slots: one kernel
                model.attention_inputs_into(token.reshape(-1), g.reshape(B * K, -1), positions.reshape(-1), self.q,
                                            self.k_scratch, self.v_scratch, self.run_rows[run])
            else:
                q, k, v = model.attention_inputs(token.reshape(-1), g.reshape(B * K, -1), positions.reshape(-1))
                q_rows[:, slots] = q.view(B, K, heads, dim)
                k_rows[:, slots] = k.view(B, K, kv_heads, dim)
                v_rows[:, slots] = v.view(B, K, kv_heads, dim)
            attn = model.attention(self.q, self.k_scratch, self.v_scratch, self.kv.k[0], self.kv.v[0],
                                   self._plan(run), model.scale)
            h = model.finish(attn.view(B, R, heads, dim)[:, slots].reshape(B * K, heads, dim),
                             g.reshape(B * K, -1))  # [B*K, H]
            child_lp, child_ids = self._top_k(model.logprobs(h), K)  # [B*K, K]
            # The children become candidates; the best k of them, the next run (its words written here).
            frontier, parent, token, positions = grow_level(
                cand, frontier, child_lp, child_ids, created, run, model.d2t, lengths, self.words.view(B, R),
                has_next=run + 1 < runs, use_triton=self.fused_levels, own_words=self.own_words[:R, 0])
            g = h.view(B, K, -1).gather(1, parent[:, :, None].expand(B, K, h.shape[-1]))
            created += K * K
        self._select(cand)

    def _select(self, cand: Candidates) -> None:
        """The kept nodes into self.out (kernels.tree_level.select_reference's layout). A request's
        candidates deeper than its own depth score -inf: never kept where it has enough others, and where it
        has fewer than the shape keeps, kept last (they were created last), so `trees` cuts them off."""
        n = self.shape.kept
        if n <= 0:
            return
        if self.fused_levels:
            select_triton(cand, n, self.model.d2t, self.out, self.depths)
        else:
            select_reference(cand, n, self.model.d2t, self.out, top_k=self._top_k, depths=self.depths)

    def _capture(self) -> None:
        t0 = time.perf_counter()
        padding_row = self.kv.block_table.padding_row
        self.load([], [], [], padding_row)
        [self.graph] = capture_graphs(self._grow)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured the draft tree graph for batch %d, budget %d/%d/%d in %.2f s", self.shape.batch,
                 self.shape.budget.steps, self.shape.budget.topk, self.shape.budget.num_draft_tokens,
                 self.capture_seconds)

    # --- results ------------------------------------------------------------------
    def trees(self, kept: list[int]) -> list[tuple[list[int], list[int], list[int], list[float], list[float]]]:
        """(tokens, parents, depths, log-probs, scores) of the first len(kept) requests, the first kept[b]
        nodes of request b (its own budget's max_nodes, at most the shape's): one device-to-host copy."""
        n, width = len(kept), self.shape.kept
        if any(k > width for k in kept):
            raise ValueError(f"a tree of this shape keeps at most {width} nodes, asked for {max(kept)}")
        raw = self.out[:n].cpu().numpy().reshape(n, 5, max(width, 1))
        floats = raw[:, 3:5].copy().view(np.float32)
        return [(raw[b, 0, :k].tolist(), raw[b, 1, :k].tolist(), raw[b, 2, :k].tolist(), floats[b, 0, :k].tolist(),
                 floats[b, 1, :k].tolist()) for b, k in enumerate(kept)]
