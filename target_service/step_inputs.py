"""One step's inputs as one int32 buffer: packed on the host, copied to the device once.

A step's rows are its sequences' tree nodes, sequence after sequence. Each
sequence's *tree part* is its last fixed node (the root) and the drafted nodes
below it; acceptance works on the tree parts as a [B, M] grid. Everything the
forward, acceptance and the KV commit read sits in one buffer, region after
region (InputLayout says where), so a step costs one host-to-device copy. With
a bucket's padded shape the layout is fixed, and a CUDA graph captured over its
device views replays for any later step of that bucket.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kernels.tree_metadata import SEQ_INFO_FIELDS, packed_mask
from target_service.step_batch import StepBatch

# Row markers in row_tree: >= 0 is a drafted node's flat tree index (b * M + m).
FIXED_ROW = -1  # committed unconditionally
PADDING_ROW = -2  # not a node: never committed


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class InputShape:
    """The (padded) sizes of one step's inputs."""

    rows: int  # R: tree nodes of every sequence
    seqs: int  # B
    tree: int  # M: root + drafted nodes per sequence
    tiles: int  # attention programs along the node axis
    updates: int  # block-table entries this step sets
    words: int  # 64-bit ancestor-mask words per row


# Regions of the buffer, in order, and their lengths in int32 words.
_REGIONS = (
    ("tokens", lambda s: s.rows), ("positions", lambda s: s.rows),
    ("row_seq", lambda s: s.rows),  # the row's sequence, -1 for padding
    ("row_tree", lambda s: s.rows),  # FIXED_ROW, PADDING_ROW, or the drafted node's b * M + m
    ("row_slot", lambda s: s.rows),  # the cache slot of the row's position (the trash slot for padding)
    ("seq_info", lambda s: SEQ_INFO_FIELDS * s.seqs),  # prefix_len, first row, node count, table row
    ("tiles", lambda s: 3 * s.tiles),  # sequence, first node, node count
    ("tree_row", lambda s: s.seqs * s.tree),  # [B, M]: the step row of tree node m
    ("tree_parent", lambda s: s.seqs * s.tree),  # [B, M]: parent's m (the root's own: 0)
    ("tree_size", lambda s: s.seqs),  # nodes in each tree part (0 for padding)
    ("update_index", lambda s: s.updates), ("update_block", lambda s: s.updates),
    ("temperature", lambda s: s.seqs), ("top_k", lambda s: s.seqs), ("top_p", lambda s: s.seqs),
    ("seed_lo", lambda s: s.seqs), ("seed_hi", lambda s: s.seqs), ("greedy", lambda s: s.seqs),
    ("mask", lambda s: 2 * s.rows * s.words),  # int64 [R, W]; kept last
)
# Every region starts on 16 bytes. Triton specialises a kernel on whether each pointer is
# 16-byte aligned; regions packed end to end moved between the classes with the step's rows
# (the demo target compiled its tree attention for 0.77 s while serving, its mask words' view
# 8 bytes off), so a served step could wait for a compile.
REGION_ALIGN_WORDS = 4
# What only sampling reads (pack_step's `sampling`); a greedy step decided on the host skips them.
SAMPLING_REGIONS = ("temperature", "top_k", "top_p", "seed_lo", "seed_hi", "greedy")
_FLOATS = {"temperature", "top_p"}


class InputLayout:
    """Offsets of every region for one InputShape (layout_for caches them)."""

    def __init__(self, shape: InputShape):
        self.shape = shape
        self.spans: dict[str, tuple[int, int]] = {}
        at = 0
        for name, length in _REGIONS:
            at = -(-at // REGION_ALIGN_WORDS) * REGION_ALIGN_WORDS
            n = length(shape)
            self.spans[name] = (at, n)
            at += n
        self.size = at

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        views = {}
        for name, (at, n) in self.spans.items():
            part = buf[at: at + n]
            if name in _FLOATS:
                part = part.view(np.float32)
            elif name == "mask":
                part = part.view(np.int64).reshape(self.shape.rows, self.shape.words)
            views[name] = part
        return views

    def device_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, (at, n) in self.spans.items():
            part = buf[at: at + n]
            if name in _FLOATS:
                part = part.view(torch.float32)
            elif name == "mask":
                part = part.view(torch.int64).view(self.shape.rows, self.shape.words)
            views[name] = part
        return views


@functools.lru_cache(maxsize=256)
def layout_for(shape: InputShape) -> InputLayout:
    return InputLayout(shape)


@functools.lru_cache(maxsize=4096)
def tree_depths(tree_parents: tuple[int, ...]) -> np.ndarray:
    depth = np.zeros(len(tree_parents), dtype=np.int32)
    for m in range(1, len(tree_parents)):
        depth[m] = depth[tree_parents[m]] + 1
    return depth


@functools.lru_cache(maxsize=4096)
def _tree_mask_rows(num_fixed: int, tree_parents: tuple[int, ...], words: int) -> np.ndarray:
    """Packed ancestor-or-self rows [num_fixed - 1 + M, words] of a chain then a tree."""
    n = num_fixed - 1 + len(tree_parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(num_fixed):
        mask[i, : i + 1] = True
    root = num_fixed - 1
    for m in range(1, len(tree_parents)):
        i = root + m
        mask[i] = mask[root + tree_parents[m]]
        mask[i, i] = True
    return packed_mask(mask, words)


def _chain_mask_words(local: np.ndarray, words: int) -> np.ndarray:
    """[len(local), words] int64: row with local index l sees nodes 0..l."""
    first = np.arange(words, dtype=np.int64) * 64  # node index of bit 0 of each word
    seen = np.clip(local[:, None].astype(np.int64) + 1 - first[None, :], 0, 64)  # bits set per word
    full = seen == 64
    bits = np.where(full, 0, (np.left_shift(np.uint64(1), seen.astype(np.uint64) % np.uint64(64))
                              - np.uint64(1)).astype(np.uint64))
    return np.where(full, np.int64(-1), bits.view(np.int64))


def shape_for(batch: StepBatch, tree: int, updates: int, per_tile: int) -> InputShape:
    """The exact (unpadded) shape of a validated step (every item has a node)."""
    rows = len(batch.tokens)
    if rows == batch.size:  # one node each: a tile and a mask word each
        return InputShape(rows=rows, seqs=rows, tree=tree, tiles=max(rows, 1), updates=max(updates, 1), words=1)
    n = batch.num_nodes.astype(np.int64)
    tiles = int(((n + per_tile - 1) // per_tile).sum())
    return InputShape(rows=rows, seqs=batch.size, tree=tree, tiles=max(tiles, 1), updates=max(updates, 1),
                      words=max(1, _cdiv(int(n.max(initial=1)), 64)))


def max_tree(batch: StepBatch) -> int:
    """The most nodes of any item's tree part (its root and drafted nodes), from the batch's
    cached trees: no array operation for plain decode."""
    return max(map(len, batch.drafted_trees.values()), default=1)


def _pack_attention_metadata(batch: StepBatch, views: dict[str, np.ndarray], shape: InputShape,
                             local: np.ndarray | None, *, per_tile: int, prefix_lens: np.ndarray,
                             table_rows: np.ndarray, padding_row: int) -> None:
    """The Triton attention's regions: each sequence's facts, the tiles of nodes its programs
    take, and each row's ancestor mask words. local: each row's index within its sequence
    (None when every sequence has one node)."""
    B, R = batch.size, len(batch.tokens)
    n, starts = batch.num_nodes.astype(np.int64), batch.starts
    tiles = views["tiles"].reshape(shape.tiles, 3)
    mask = views["mask"]
    mask[:] = 0
    if local is None:  # one node each: one tile each, and a row sees itself
        mask[:R, 0] = 1
        tiles[:B, 0] = np.arange(B)
        tiles[:B, 1] = 0
        tiles[:B, 2] = 1
        tiles[B:] = 0
    else:
        chains = np.ones(R, dtype=bool)
        for b, parents in batch.drafted_trees.items():
            lo, hi = int(starts[b]), int(starts[b + 1])
            mask[lo:hi] = _tree_mask_rows(int(batch.num_fixed[b]), parents, shape.words)
            chains[lo:hi] = False
        if chains.any():
            mask[:R][chains] = _chain_mask_words(local[chains], shape.words)
        per_seq = (n + per_tile - 1) // per_tile
        tile_seq = np.repeat(np.arange(B), per_seq)
        first = (np.arange(len(tile_seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * per_tile
        tiles[: len(tile_seq), 0] = tile_seq
        tiles[: len(tile_seq), 1] = first
        tiles[: len(tile_seq), 2] = np.minimum(per_tile, n[tile_seq] - first)
        tiles[len(tile_seq):] = 0
    info = views["seq_info"].reshape(shape.seqs, SEQ_INFO_FIELDS)
    info[:B, 0] = prefix_lens
    info[:B, 1] = starts[:-1]
    info[:B, 2] = n
    info[:B, 3] = table_rows
    info[B:] = (0, 0, 0, padding_row)


def _pack_sampling(batch: StepBatch, views: dict[str, np.ndarray]) -> None:
    """Each sequence's sampling columns (SAMPLING_REGIONS)."""
    B = batch.size
    views["temperature"][:B] = batch.temperature
    views["top_k"][:B] = batch.top_k
    views["top_p"][:B] = np.where((batch.top_p > 0) & (batch.top_p < 1), batch.top_p, 1.0)
    seed = batch.seed.view(np.uint32).reshape(B, 2)  # little-endian: low word first
    views["seed_lo"][:B] = seed[:, 0]
    views["seed_hi"][:B] = seed[:, 1]
    views["greedy"][:B] = batch.greedy


def pack_step(batch: StepBatch, *, prefix_lens: np.ndarray, table_rows: np.ndarray, updates: dict[int, int],
              shape: InputShape, views: dict[str, np.ndarray], per_tile: int, padding_row: int,
              padding_update: int, host_table: np.ndarray, block_size: int, trash_slot: int,
              attention_metadata: bool = True, sampling: bool = True) -> None:
    """Write `batch` into host views of a buffer laid out for `shape` (>= the batch's own
    shape). prefix_lens / table_rows: per sequence, its committed length and its row of
    the block table (host_table: its host copy, blocks already reserved for the step);
    updates: device block-table entries to set before the forward. attention_metadata:
    also the regions that the Triton attention and the logits controls read (sequence info,
    tiles, mask words); the torch reference attention takes its own description, so a CPU's
    eager step without controls skips them. sampling: also the sampling columns (temperature,
    top-k, top-p, seeds, greedy flags), which only the device tail's sampling and result
    packing read; a CPU's greedy step decides on the host without them (SAMPLING_REGIONS)."""
    B, M = batch.size, shape.tree
    R = len(batch.tokens)
    if R > shape.rows or B > shape.seqs or max_tree(batch) > M or len(updates) > shape.updates:
        raise ValueError(f"a step of {R} rows, {B} sequences, trees of {max_tree(batch)} and {len(updates)} "
                         f"block-table updates does not fit {shape}")
    tree_parent = views["tree_parent"].reshape(shape.seqs, M)
    tree_parent[:] = 0
    tree_row = views["tree_row"].reshape(shape.seqs, M)
    row_tree = views["row_tree"]
    if R == B:  # every sequence one node (plain decode): one row, a root, no tree
        seq_of_row = np.arange(B)
        local = None
        views["positions"][:R] = prefix_lens
        row_tree[:R] = FIXED_ROW
        if M > 1 or B < shape.seqs:  # cells the sequences' roots do not fill (none in an exact shape)
            tree_row[:] = 0
        tree_row[:B, 0] = seq_of_row
        views["tree_size"][:B] = 1
        table_row_of_row = table_rows
    else:
        tree_row[:] = 0
        n = batch.num_nodes.astype(np.int64)
        nf = batch.num_fixed.astype(np.int64)
        starts = batch.starts
        seq_of_row = np.repeat(np.arange(B), n)
        local = np.arange(R) - starts[:-1][seq_of_row]
        nf_row = nf[seq_of_row]
        tree_idx = local - (nf_row - 1)  # >= 0 for the root and drafted rows
        depth = np.minimum(local, nf_row - 1)  # the chain part; drafted rows get their tree depth added below
        for b, parents in batch.drafted_trees.items():  # sequences with drafted nodes: few, shapes repeat
            lo, hi = int(starts[b]), int(starts[b + 1])
            tree_parent[b, : len(parents)] = parents
            depth[lo + int(nf[b]) - 1: hi] += tree_depths(parents)
        views["positions"][:R] = prefix_lens[seq_of_row] + depth
        row_tree[:R] = np.where(local >= nf_row, seq_of_row * M + tree_idx, FIXED_ROW)
        in_tree = local >= nf_row - 1
        tree_row.reshape(-1)[(seq_of_row * M + tree_idx)[in_tree]] = np.flatnonzero(in_tree)
        views["tree_size"][:B] = n - nf + 1
        table_row_of_row = table_rows[seq_of_row]
    if attention_metadata:
        _pack_attention_metadata(batch, views, shape, local, per_tile=per_tile, prefix_lens=prefix_lens,
                                 table_rows=table_rows, padding_row=padding_row)
    block, offset = np.divmod(views["positions"][:R], block_size)
    views["row_slot"][:R] = host_table[table_row_of_row, block] * block_size + offset
    views["tokens"][:R] = batch.tokens
    views["row_seq"][:R] = seq_of_row

    index, block = views["update_index"], views["update_block"]
    if updates:
        index[: len(updates)] = list(updates.keys())
        block[: len(updates)] = list(updates.values())
    index[len(updates):] = padding_update
    block[len(updates):] = 0

    if sampling:
        _pack_sampling(batch, views)
    # Padding (a graph bucket's shape is larger than its step); an exact shape (a CPU's eager
    # step) has none, and skipping its empty writes saves a dozen numpy calls a step.
    if R < shape.rows:
        views["row_slot"][R:] = trash_slot
        views["tokens"][R:] = 0
        views["positions"][R:] = 0
        views["row_seq"][R:] = -1
        row_tree[R:] = PADDING_ROW
    if B < shape.seqs:
        views["tree_size"][B:] = 0
        if sampling:
            views["temperature"][B:] = 0
            views["top_k"][B:] = 0
            views["top_p"][B:] = 1.0
            views["seed_lo"][B:] = 0
            views["seed_hi"][B:] = 0
            views["greedy"][B:] = 1
