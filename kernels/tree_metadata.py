"""Device metadata for tree attention: built once per step, read by every layer.

What the kernel needs to know about the step's shape lives in three device
tensors: an int32 buffer with per-sequence info and tiles, a block table, and
the packed ancestor masks (int64). build_tree_metadata packs them from host
lists (tests, benchmarks); the target engine instead points them at its own
device-resident block table and at views of the one buffer a step is copied in
as (target_service.step_batch), so a step costs one host-to-device copy. With
the padding arguments shapes are fixed per bucket; a CUDA graph captured over
one metadata object replays for a later step after `copy_` of a new one built
with the same padding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # tree_attention imports this module
    from kernels.tree_attention import StepLayout

# Rows of the query tile are (node, query head) pairs; the tile never exceeds
# this many rows unless a single GQA group is wider.
MAX_BLOCK_M = 64
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
# Flash-decoding: split a prefix only if each split still gets this many tokens
# (two kernel iterations; on an H200, 16 splits of a 1k prefix gave a 8B decode
# step at batch 1 of 6.85 ms against 7.04 ms with 4).
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 32
SEQ_INFO_FIELDS = 4  # prefix_len, first row, node count, block-table row


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class TreeAttnMetadata:
    """What one step's tree attention reads, identical for every layer.

    ints (int32) holds, from info_off and tile_off:
      seq_info [B, 4]          (prefix_len, first row in q/k/v, node count, block-table row)
      tiles    [num_tiles, 3]  (sequence, first local node, node count);
                               padding tiles have count 0 and do nothing
    block_table [rows, max_blocks] int32: physical block of each prefix block, one
    row per sequence slot (seq_info says which row a sequence reads).
    mask_words [rows, W] int64: bit j%64 of word j//64 of row i is set when the
    sequence's own node j is visible to row i (its ancestor or itself).
    """

    ints: torch.Tensor
    block_table: torch.Tensor
    mask_words: torch.Tensor
    batch: int
    num_tiles: int
    block_size: int
    group: int  # query heads per kv head
    block_m: int  # query rows (node, head) per program
    num_splits: int  # programs sharing one prefix (flash-decoding); 1 = no split
    info_off: int = 0
    tile_off: int | None = None  # default: right after seq_info

    def __post_init__(self) -> None:
        if self.tile_off is None:
            self.tile_off = self.info_off + SEQ_INFO_FIELDS * self.batch

    @property
    def nodes_per_tile(self) -> int:
        return self.block_m // self.group

    @property
    def seq_info(self) -> torch.Tensor:
        return self.ints[self.info_off: self.info_off + SEQ_INFO_FIELDS * self.batch].view(
            self.batch, SEQ_INFO_FIELDS)

    @property
    def tiles(self) -> torch.Tensor:
        return self.ints[self.tile_off: self.tile_off + 3 * self.num_tiles].view(self.num_tiles, 3)

    def _static(self) -> tuple:
        return (self.batch, self.num_tiles, self.block_size, self.group, self.block_m, self.num_splits,
                self.info_off, self.tile_off, tuple(self.ints.shape), tuple(self.block_table.shape),
                tuple(self.mask_words.shape))

    def copy_(self, other: TreeAttnMetadata) -> TreeAttnMetadata:
        """Overwrite in place (e.g. a CUDA graph's static metadata) with a step of the same bucket."""
        if self._static() != other._static():
            raise ValueError(f"metadata of another bucket: {other._static()} vs {self._static()}")
        self.ints.copy_(other.ints, non_blocking=True)
        self.block_table.copy_(other.block_table, non_blocking=True)
        self.mask_words.copy_(other.mask_words, non_blocking=True)
        return self


@functools.cache  # a step asks each time, for a few (nodes, group) pairs
def choose_block_m(max_nodes: int, group: int) -> int:
    lo = max(MIN_BLOCK_M, _next_pow2(group))
    hi = max(MAX_BLOCK_M, lo)
    return min(max(_next_pow2(max_nodes * group), lo), hi)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(num_programs: int, max_prefix: int, device: torch.device) -> int:
    """Split long prefixes when there are too few (tile, kv head) programs to fill the GPU."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1
    want = _cdiv(2 * sms, max(1, num_programs))
    return max(1, min(want, max_prefix // MIN_SPLIT_TOKENS, MAX_SPLITS))


def packed_mask(mask: np.ndarray, words: int, r: int = 0) -> np.ndarray:
    """Check an [n, n] bool mask and pack it to [n, words] int64: bit j%64 of word
    j//64 of row i is mask[i, j]."""
    n = mask.shape[0]
    if mask.shape != (n, n):
        raise ValueError(f"sequence {r}: mask must be square, got {tuple(mask.shape)}")
    if not mask.diagonal().all():
        raise ValueError(f"sequence {r}: every node must see itself")
    # The kernel visits, for a tile of nodes, only own nodes up to the tile's
    # last one: ancestors must come before their descendants (tandem.tree does this).
    if np.triu(mask, 1).any():
        raise ValueError(f"sequence {r}: a node sees a later node; ancestors must precede descendants")
    packed = np.zeros((n, words * 8), dtype=np.uint8)
    bits = np.packbits(mask, axis=1, bitorder="little")
    packed[:, : bits.shape[1]] = bits
    # Little-endian bytes: byte j//8, bit j%8 is bit j%64 of word j//64.
    return packed.view("<i8").astype(np.int64, copy=False)


def _as_bool_array(mask: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(mask, torch.Tensor):
        return mask.detach().to("cpu", torch.bool).numpy()
    return np.asarray(mask, dtype=bool)


def build_tree_metadata(block_tables: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                        node_starts: Sequence[int], masks: Sequence[torch.Tensor | np.ndarray], *,
                        block_size: int, num_q_heads: int, num_kv_heads: int,
                        device: torch.device | str, num_splits: int | None = None,
                        block_m: int | None = None, max_batch: int | None = None,
                        max_blocks: int | None = None, max_tiles: int | None = None,
                        max_rows: int | None = None, max_words: int | None = None) -> TreeAttnMetadata:
    """Pack one step. Sequence r has prefix_lens[r] committed tokens in the blocks
    block_tables[r] and len(masks[r]) nodes at rows node_starts[r].. of q/k/v;
    masks[r] is its [n, n] ancestor-or-self mask (host tensors or arrays are cheapest).

    The max_* arguments pad to fixed shapes (for CUDA graphs); num_splits and
    block_m then should be fixed by the caller too, since they set the grid.
    """
    device = torch.device(device)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    B = len(prefix_lens)
    if not len(block_tables) == len(node_starts) == len(masks) == B:
        raise ValueError("block_tables, prefix_lens, node_starts and masks must have one entry per sequence")
    counts = [int(m.shape[0]) for m in masks]
    for r, (table, plen) in enumerate(zip(block_tables, prefix_lens)):
        if len(table) * block_size < plen:
            raise ValueError(f"sequence {r}: {len(table)} blocks cannot hold a prefix of {plen}")
    block_m = block_m or choose_block_m(max(counts, default=1), group)
    if block_m < group:
        raise ValueError(f"block_m {block_m} is smaller than one GQA group ({group})")
    per_tile = block_m // group
    tiles = [(r, first, min(per_tile, n - first))
             for r, n in enumerate(counts) for first in range(0, n, per_tile)]
    rows = max((s + n for s, n in zip(node_starts, counts)), default=0)
    words = _cdiv(max(counts, default=1), 64)
    nblocks = max((_cdiv(p, block_size) for p in prefix_lens), default=0)

    def padded(value: int, limit: int | None, what: str) -> int:
        if limit is None:
            return max(value, 1)
        if value > limit:
            raise ValueError(f"step needs {value} {what}, over the padded size {limit}")
        return limit

    pB, pBlocks = padded(B, max_batch, "sequences"), padded(nblocks, max_blocks, "blocks per sequence")
    pTiles, pRows = padded(len(tiles), max_tiles, "tiles"), padded(rows, max_rows, "rows")
    pWords = padded(words, max_words, "mask words")

    # Host work in numpy: this runs once per step for up to hundreds of sequences.
    tables = np.zeros((pB, pBlocks), dtype=np.int32)
    info = np.zeros((pB, SEQ_INFO_FIELDS), dtype=np.int32)
    tile_t = np.zeros((pTiles, 3), dtype=np.int32)
    mask_words = np.zeros((pRows, pWords), dtype=np.int64)
    packed_by_mask: dict[tuple, np.ndarray] = {}  # a batch repeats few tree shapes
    for r, (table, plen, start, mask) in enumerate(zip(block_tables, prefix_lens, node_starts, masks)):
        used = _cdiv(plen, block_size)
        tables[r, :used] = table[:used]
        info[r] = (plen, start, counts[r], r)
        m = _as_bool_array(mask)
        key = (m.shape, m.tobytes())
        if key not in packed_by_mask:
            packed_by_mask[key] = packed_mask(m, pWords, r)
        mask_words[start: start + counts[r]] = packed_by_mask[key]
    if tiles:
        tile_t[: len(tiles)] = tiles
    ints = torch.from_numpy(np.concatenate((info.ravel(), tile_t.ravel())))
    pin = device.type == "cuda"

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if pin else t).to(device, non_blocking=pin)

    if num_splits is None:
        num_splits = choose_num_splits(len(tiles) * num_kv_heads, max(prefix_lens, default=0), device)
    return TreeAttnMetadata(
        ints=to_device(ints), block_table=to_device(torch.from_numpy(tables)),
        mask_words=to_device(torch.from_numpy(mask_words)), batch=pB, num_tiles=pTiles,
        block_size=block_size, group=group, block_m=block_m, num_splits=num_splits)


def _host_split(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[np.ndarray]:
    """Tensors (any device) as host arrays, with one device-to-host copy for all of them."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]).cpu().numpy()
    sizes = np.cumsum([t.numel() for t in tensors])[:-1]
    return [part.reshape(t.shape) for part, t in zip(np.split(flat, sizes), tensors)]


def block_tables_from_slots(prefix_slots: Sequence[torch.Tensor], block_size: int) -> list[np.ndarray]:
    """Recover each prefix's block table from its flat slots, checking they are paged in order."""
    if not prefix_slots:
        return []
    # Vectorised over the whole batch: one device-to-host copy, no per-token Python.
    lengths = np.array([s.numel() for s in prefix_slots])
    flat = torch.cat([s.reshape(-1).long() for s in prefix_slots]).cpu().numpy()
    seq_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = np.arange(len(flat)) - seq_start
    tables_flat = flat[pos % block_size == 0] // block_size
    nblocks = -(-lengths // block_size)
    block_start = np.repeat(np.cumsum(nblocks) - nblocks, lengths)
    expected = tables_flat[block_start + pos // block_size] * block_size + pos % block_size
    bad = np.flatnonzero(expected != flat)
    if len(bad):
        r = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise ValueError(f"sequence {r}: prefix slots are not token t at block_table[t // "
                         f"{block_size}] offset t % {block_size}")
    return np.split(tables_flat, np.cumsum(nblocks)[:-1])


def metadata_from_layout(layout: StepLayout, *, block_size: int, num_q_heads: int, num_kv_heads: int,
                         device: torch.device | str, **kwargs) -> TreeAttnMetadata:
    """The same step as a StepLayout describes it, packed for the kernel.

    Without layout.block_tables the prefix slots are read back to the host and
    checked; masks on the device are read back too (one copy for all). Host masks
    and block tables in the layout skip both round trips.
    """
    for r, (count, mask) in enumerate(zip(layout.node_counts, layout.masks)):
        if mask.shape[0] != count:
            raise ValueError(f"sequence {r}: {count} nodes but a {tuple(mask.shape)} mask")
    tables = layout.block_tables
    if tables is None:
        tables = block_tables_from_slots(layout.prefix_slots, block_size)
    return build_tree_metadata(
        tables,
        [len(s) for s in layout.prefix_slots], layout.node_starts,
        layout.masks if all(m.device.type == "cpu" for m in layout.masks) else _host_split(layout.masks, torch.bool),
        block_size=block_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, device=device, **kwargs)
