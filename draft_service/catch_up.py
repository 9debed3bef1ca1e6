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

import itertools
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
        # A call's inputs, each in one non-blocking copy: the attention's ints; the rows' tokens,
        # positions, cache slots, feature rows and whether a row takes its own h, then each request's
        # last row; the features, packed.
        self.ints_in = StagedInput((SEQ_INFO_FIELDS * batch + 3 * batch * self.tiles_per_seq,), torch.int32, dev)
        self.ints = self.ints_in.device
        self.longs_in = StagedInput((5 * rows + batch,), torch.long, dev)
        self.tokens, self.positions, self.slots, self.feature_rows, self.takes_own_h = (
            self.longs_in.device[: 5 * rows].view(5, rows))
        self.last_row = self.longs_in.device[5 * rows:]
        # Each request's h before its segment, which its rows without features take (copied on the device,
        # outside the graph, only by calls that have such rows: a verify's catch-up never does), and each row's
        # request.
        self.request_h = torch.zeros(batch, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.row_request = torch.arange(rows, device=dev) // W
        self.slots.fill_(kv.trash_slot)  # the capture's warm-up runs before any load: it writes only trash
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
        B, W, bs = self.batch, WIDTH, self.kv.block_size
        n = len(tokens)
        counts = np.zeros(B, dtype=np.int64)
        counts[:n] = [len(t) for t in tokens]
        table = self.kv.block_table
        seq_rows = np.full(B, table.padding_row, dtype=np.int64)
        seq_rows[:n] = table_rows
        ints = self.ints_in.host().numpy()
        info = ints[: SEQ_INFO_FIELDS * B].reshape(B, SEQ_INFO_FIELDS)
        info[:] = 0
        info[:, 1] = np.arange(B) * W
        info[:n, 0] = starts
        info[:, 2] = counts
        info[:, 3] = seq_rows
        tiles = ints[SEQ_INFO_FIELDS * B:].reshape(B, self.tiles_per_seq, 3)
        first = np.arange(self.tiles_per_seq) * self.per_tile
        tiles[:, :, 0] = np.arange(B)[:, None]
        tiles[:, :, 1] = first
        tiles[:, :, 2] = np.clip(counts[:, None] - first[None, :], 0, self.per_tile)
        longs = self.longs_in.host().numpy()
        token, position, slot, feature_row, takes_own = longs[: 5 * B * W].reshape(5, B, W)
        used = np.arange(W)[None, :] < counts[:, None]  # [B, W]: the rows that compute a position
        start = np.zeros(B, dtype=np.int64)
        start[:n] = starts
        at = np.where(used, start[:, None] + np.arange(W)[None, :], 0)
        total = int(counts.sum())
        token[:] = 0
        token[used] = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=total)
        position[:] = at
        # The block table's host mirror is current: every slot of the call in one gather.
        slot[:] = np.where(used, table.host[seq_rows[:, None], at // bs] * bs + at % bs, self.kv.trash_slot)
        has = np.fromiter(itertools.chain.from_iterable(featured), dtype=bool, count=total)
        takes_own[:] = 0
        takes_own[used] = ~has
        feature_row[:] = 0
        feature_row[used] = np.cumsum(has) - 1
        np.maximum(feature_row, 0, out=feature_row)
        longs[5 * B * W:] = np.arange(B) * W + np.maximum(counts, 1) - 1
        rows = 0
        if features:  # features arrive on the host (from the target's messages, or its ring)
            host = self.features_in.host()
            for run in features:
                host[rows: rows + run.shape[0]].copy_(run)
                rows += run.shape[0]
        if rows < total:  # a wake-up's rows: their requests' h, copied on the device (no wait for it)
            self.request_h[:n].copy_(torch.stack(own_h))
        self.ints_in.send()
        self.longs_in.send()
        self.features_in.send(rows)
        self.host_slots = host_prefix or []

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
        g = model.project(self.features_in.device[self.feature_rows])
        g = torch.where(self.takes_own_h[:, None] != 0, self.request_h[self.row_request], g)
        q, k, v = model.attention_inputs(self.tokens, g, self.positions)
        attn = model.attention(q, k, v, self.kv.k[0], self.kv.v[0], self._plan(), model.scale)
        h = model.finish(attn, g)
        self.kv.k[0].view(-1, *k.shape[1:])[self.slots] = k
        self.kv.v[0].view(-1, *v.shape[1:])[self.slots] = v
        self.last_h.copy_(h[self.last_row])

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._compute()

    def _capture(self) -> None:
        t0 = time.perf_counter()
        [self.graph] = capture_graphs(self._compute)  # the warm-up runs padding only: it writes nothing but trash
        log.info("captured the draft catch-up graph for batch %d in %.2f s", self.batch, time.perf_counter() - t0)
