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

from kernels.tree_attention import StepLayout
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
        self.ints_host = np.zeros(SEQ_INFO_FIELDS * batch + 3 * batch * self.tiles_per_seq, dtype=np.int32)
        self.ints = torch.zeros(len(self.ints_host), dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.full((rows,), kv.trash_slot, dtype=torch.long, device=dev)
        self.last_row = torch.zeros(batch, dtype=torch.long, device=dev)
        self.features = torch.zeros(rows, model.cfg.feature_width, dtype=model.dtype, device=dev)
        # Row j of a request sees its rows 0..j: the same causal words for every call.
        own = torch.arange(W, device=dev)
        self.words = ((torch.ones_like(own) << (own + 1)) - 1).repeat(batch)[:, None].contiguous()
        self.last_h = torch.zeros(batch, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.splits = choose_num_splits(batch * self.tiles_per_seq * model.num_kv_heads, model.max_position, dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.host_slots: list[np.ndarray] = []
        self.counts: list[int] = []
        if capture:
            self._capture()

    def load(self, tokens: list[list[int]], positions: list[int], features: list[torch.Tensor], slots: np.ndarray,
             table_rows: list[int], padding_row: int, host_prefix: list[np.ndarray] | None = None) -> None:
        """Request b computes len(tokens[b]) positions from positions[b] (its computed length):
        tokens[b] are the next tokens of those positions, features[b] their target features,
        slots its rows' cache slots (all requests' together, in order)."""
        B, W = self.batch, WIDTH
        n = len(tokens)
        counts = [len(t) for t in tokens]
        info = self.ints_host[: SEQ_INFO_FIELDS * B].reshape(B, SEQ_INFO_FIELDS)
        info[:] = (0, 0, 0, padding_row)
        info[:, 1] = np.arange(B) * W
        info[:n, 0] = positions
        info[:n, 2] = counts
        info[:n, 3] = table_rows
        tiles = self.ints_host[SEQ_INFO_FIELDS * B:].reshape(B, self.tiles_per_seq, 3)
        first = np.arange(self.tiles_per_seq) * self.per_tile
        tiles[:, :, 0] = np.arange(B)[:, None]
        tiles[:, :, 1] = first
        count = np.zeros(B, dtype=np.int64)
        count[:n] = counts
        tiles[:, :, 2] = np.clip(count[:, None] - first[None, :], 0, self.per_tile)
        self.ints.copy_(torch.from_numpy(self.ints_host))
        flat_tokens = np.zeros(B * W, dtype=np.int64)
        flat_positions = np.zeros(B * W, dtype=np.int64)
        flat_slots = np.full(B * W, self.kv.trash_slot, dtype=np.int64)
        at = 0
        for b, (toks, start) in enumerate(zip(tokens, positions)):
            k = len(toks)
            flat_tokens[b * W: b * W + k] = toks
            flat_positions[b * W: b * W + k] = np.arange(start, start + k)
            flat_slots[b * W: b * W + k] = slots[at: at + k]
            at += k
        self.tokens.copy_(torch.from_numpy(flat_tokens))
        self.positions.copy_(torch.from_numpy(flat_positions))
        self.slots.copy_(torch.from_numpy(flat_slots))
        self.last_row.copy_(torch.tensor([b * W + max(c, 1) - 1 for b, c in enumerate(counts + [1] * (B - n))]))
        stacked = torch.zeros(B, W, self.features.shape[1], dtype=self.features.dtype)
        for b, f in enumerate(features):
            stacked[b, : f.shape[0]] = f.to(self.features.dtype)
        self.features.copy_(stacked.view(B * W, -1))
        self.counts = counts
        self.host_slots = host_prefix or []

    def _plan(self):
        B, W = self.batch, WIDTH
        if self.model.attention.name == "triton":
            return TreeAttnMetadata(
                ints=self.ints, info_off=0, tile_off=SEQ_INFO_FIELDS * B, block_table=self.kv.block_table.table,
                mask_words=self.words, batch=B, num_tiles=B * self.tiles_per_seq, block_size=self.kv.block_size,
                group=self.model.num_heads // self.model.num_kv_heads, block_m=self.block_m,
                num_splits=self.splits)
        causal = torch.ones(W, W, dtype=torch.bool).tril()
        prefix = [torch.from_numpy(s) for s in self.host_slots]
        prefix += [torch.zeros(0, dtype=torch.long)] * (B - len(prefix))
        return StepLayout(tuple(range(0, B * W, W)), (W,) * B, tuple(prefix), (causal,) * B)

    def _compute(self) -> None:
        model = self.model
        g = model.project(self.features)
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
