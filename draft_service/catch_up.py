"""The draft's catch-up after a verify step, in fixed shapes: one CUDA graph per batch bucket.

After the target verifies a tree, each drafting request brings a few new
positions (the root and the accepted nodes), all with the target's features.
Computing their draft KV is a short causal chain per request over the paged
prefix: here every request of a call gets WIDTH rows (unused rows are padding,
written to the cache's trash slot), so the shapes depend only on the batch
bucket and a GPU replays one graph. Calls that do not fit (a position without
features, more than WIDTH new positions) take the engine's eager path.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from draft_service.staging import StagedInput
from kernels.tree_attention import StepLayout, causal_mask
from kernels.tree_metadata import SEQ_INFO_FIELDS, TreeAttnMetadata, choose_block_m, choose_num_splits
from tandem.graph_capture import capture_graphs

log = logging.getLogger(__name__)

WIDTH = 8  # new positions per request: a verify commits the root and at most 7 accepted nodes


class BatchCatchUp:
    """Static buffers (and on CUDA the captured graph) of one batch bucket."""

    def __init__(self, model, kv, batch: int, capture: bool):
        self.model, self.kv, self.batch = model, kv, batch
        dev, W = model.device, WIDTH
        rows = batch * W
        group = model.num_heads // model.num_kv_heads
        self.block_m = choose_block_m(W, group)
        self.per_tile = self.block_m // group
        self.tiles_per_seq = -(-W // self.per_tile)
        # A call's input, in one non-blocking copy: each request's start (its computed length), count of new
        # positions and block-table row, then its WIDTH next tokens and whether each position has a feature
        # row. The rest (each row's position, cache slot, feature row and own-h flag, the attention's
        # sequence info and tiles) is derived from it on the device, inside the graph (_rows): built on the
        # host it took some 35 numpy ops a call, each tens of microseconds once the caches had gone cold
        # between calls.
        self.longs_in = StagedInput((3 * batch + 2 * rows,), torch.long, dev)
        self.ints = torch.zeros(SEQ_INFO_FIELDS * batch + 3 * batch * self.tiles_per_seq, dtype=torch.int32,
                                device=dev)
        self.offsets = torch.arange(W, device=dev)  # a row's place in its request's rows
        self.first_rows = torch.arange(batch, device=dev) * W
        self.tile_starts = torch.arange(self.tiles_per_seq, device=dev) * self.per_tile
        self.info = self.ints[: SEQ_INFO_FIELDS * batch].view(batch, SEQ_INFO_FIELDS)
        self.tiles = self.ints[SEQ_INFO_FIELDS * batch:].view(batch, self.tiles_per_seq, 3)
        self.info[:, 1] = self.first_rows  # the parts of the ints that no call changes
        self.tiles[:, :, 0] = torch.arange(batch, device=dev)[:, None]
        self.tiles[:, :, 1] = self.tile_starts
        # Each request's h before its segment, which its rows without features take (copied on the device,
        # outside the graph, only by calls that have such rows: a verify's catch-up never does), and each row's
        # request.
        self.request_h = torch.zeros(batch, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.row_request = torch.arange(rows, device=dev) // W
        self.features_in = StagedInput((rows, model.cfg.feature_width), model.dtype, dev)
        # Row j of a request sees its rows 0..j: the same causal words for every call.
        own = torch.arange(W, device=dev)
        self.words = ((torch.ones_like(own) << (own + 1)) - 1).repeat(batch)[:, None].contiguous()
        self.last_h = torch.zeros(batch, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.splits = choose_num_splits(batch * self.tiles_per_seq * model.num_kv_heads, model.max_position, dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.host_slots: list[np.ndarray] = []
        if capture:
            self._capture()

    def load(self, tokens: list[list[int]], starts: list[int], featured: list[list[bool]],
             features: list[torch.Tensor], own_h: list[torch.Tensor], table_rows: list[int],
             host_prefix: list[np.ndarray] | None = None) -> None:
        """Request b computes len(tokens[b]) positions from starts[b] (its computed length):
        tokens[b] are the next tokens of those positions; featured[b] whether each position has a feature
        row, where one without takes own_h[b] (the request's h before the segment, on the device) instead;
        features are the feature rows of every featured position, in order, in runs [n, width]; table_rows
        are the requests' rows of the block table."""
        B, W = self.batch, WIDTH
        padding = B - len(tokens)
        values = [*starts, *[0] * padding, *map(len, tokens), *[0] * padding,
                  *table_rows, *[self.kv.block_table.padding_row] * padding]
        for row in tokens:
            values += row
            values += [0] * (W - len(row))
        values += [0] * (W * padding)
        for row in featured:
            values += row
            values += [False] * (W - len(row))
        values += [0] * (W * padding)
        self.longs_in.host().numpy()[:] = values
        rows = 0
        if features:  # features arrive on the host (from the target's messages, or its ring)
            host = self.features_in.host()
            for run in features:
                host[rows: rows + run.shape[0]].copy_(run)
                rows += run.shape[0]
        if rows < sum(map(len, tokens)):  # a wake-up's rows: their requests' h, copied on the device (no wait)
            self.request_h[: len(own_h)].copy_(torch.stack(own_h))
        self.longs_in.send()
        self.features_in.send(rows)
        self.host_slots = host_prefix or []

    def _rows(self) -> tuple[torch.Tensor, ...]:
        """From the call's input (see __init__): each row's token, position, cache slot, feature row and
        whether it takes its request's own h, and each request's last row; the attention's sequence info and
        tiles written into the ints. Rows past a request's count are padding: position 0, the trash slot."""
        B, W, size = self.batch, WIDTH, self.kv.block_size
        given = self.longs_in.device
        start, count, table_row = given[:B], given[B: 2 * B], given[2 * B: 3 * B]
        tokens = given[3 * B: 3 * B + B * W]
        has = given[3 * B + B * W:].view(B, W) != 0
        used = self.offsets[None, :] < count[:, None]
        positions = torch.where(used, start[:, None] + self.offsets, 0)
        blocks = self.kv.block_table.table[table_row[:, None], positions // size].long()
        slots = torch.where(used, blocks * size + positions % size, self.kv.trash_slot)
        featured = (has & used).flatten()
        feature_rows = torch.where(used.flatten(), (torch.cumsum(featured, 0) - 1).clamp(min=0), 0)
        takes_own_h = (used & ~has).flatten()
        last_row = self.first_rows + count.clamp(min=1) - 1
        self.info[:, 0] = start
        self.info[:, 2] = count
        self.info[:, 3] = table_row
        self.tiles[:, :, 2] = (count[:, None] - self.tile_starts[None, :]).clamp(0, self.per_tile)
        return tokens, positions.flatten(), slots.flatten(), feature_rows, takes_own_h, last_row

    def _plan(self):
        B, W = self.batch, WIDTH
        if self.model.attention.name == "triton":
            return TreeAttnMetadata(
                ints=self.ints, info_off=0, tile_off=SEQ_INFO_FIELDS * B, block_table=self.kv.block_table.table,
                mask_words=self.words, batch=B, num_tiles=B * self.tiles_per_seq, block_size=self.kv.block_size,
                group=self.model.num_heads // self.model.num_kv_heads, block_m=self.block_m,
                num_splits=self.splits)
        causal = causal_mask(W)
        prefix = [torch.from_numpy(s) for s in self.host_slots]
        prefix += [torch.zeros(0, dtype=torch.long)] * (B - len(prefix))
        return StepLayout(tuple(range(0, B * W, W)), (W,) * B, tuple(prefix), (causal,) * B)

    def _compute(self) -> None:
        model = self.model
        tokens, positions, slots, feature_rows, takes_own_h, last_row = self._rows()
        g = model.project(self.features_in.device[feature_rows])
        g = torch.where(takes_own_h[:, None], self.request_h[self.row_request], g)
        q, k, v = model.attention_inputs(tokens, g, positions)
        attn = model.attention(q, k, v, self.kv.k[0], self.kv.v[0], self._plan(), model.scale)
        h = model.finish(attn, g)
        self.kv.k[0].view(-1, *k.shape[1:])[slots] = k
        self.kv.v[0].view(-1, *v.shape[1:])[slots] = v
        self.last_h.copy_(h[last_row])

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._compute()

    def _capture(self) -> None:
        t0 = time.perf_counter()
        [self.graph] = capture_graphs(self._compute)  # the warm-up runs padding only: it writes nothing but trash
        log.info("captured the draft catch-up graph for batch %d in %.2f s", self.batch, time.perf_counter() - t0)
