"""Device metadata for tree attention: built once per step on the host, read by every layer.

Everything the kernel needs to know about the step's shape lives in two device
tensors (one int32, one int64), so a step costs two host-to-device copies. With
the padding arguments their shapes are fixed per bucket; a CUDA graph captured
over one metadata object replays for a later step after `copy_` of a new one
built with the same padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # tree_attention imports this module
    from kernels.tree_attention import StepLayout

# Rows of the query tile are (node, query head) pairs; the tile never exceeds
# this many rows unless a single GQA group is wider.
MAX_BLOCK_M = 64
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
# Flash-decoding: split a prefix only if each split still gets this many tokens.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class TreeAttnMetadata:
    """What one step's tree attention reads, identical for every layer.

    ints (int32, one buffer) holds, in order:
      block_tables [B, max_blocks]  physical block of each prefix block
      seq_info     [B, 3]           (prefix_len, first row in q/k/v, node count)
      tiles        [num_tiles, 3]   (sequence, first local node, node count);
                                    padding tiles have count 0 and do nothing
    mask_words [rows, W] int64: bit j%64 of word j//64 of row i is set when the
    sequence's own node j is visible to row i (its ancestor or itself).
    """

    ints: torch.Tensor
    mask_words: torch.Tensor
    batch: int
    max_blocks: int
    num_tiles: int
    block_size: int
    group: int  # query heads per kv head
    block_m: int  # query rows (node, head) per program
    num_splits: int  # programs sharing one prefix (flash-decoding); 1 = no split

    @property
    def nodes_per_tile(self) -> int:
        return self.block_m // self.group

    @property
    def block_tables(self) -> torch.Tensor:
        return self.ints[: self.batch * self.max_blocks].view(self.batch, self.max_blocks)

    @property
    def seq_info(self) -> torch.Tensor:
        start = self.batch * self.max_blocks
        return self.ints[start: start + 3 * self.batch].view(self.batch, 3)

    @property
    def tiles(self) -> torch.Tensor:
        start = self.batch * (self.max_blocks + 3)
        return self.ints[start: start + 3 * self.num_tiles].view(self.num_tiles, 3)

    def _static(self) -> tuple:
        return (self.batch, self.max_blocks, self.num_tiles, self.block_size, self.group,
                self.block_m, self.num_splits, tuple(self.ints.shape), tuple(self.mask_words.shape))

    def copy_(self, other: TreeAttnMetadata) -> TreeAttnMetadata:
        """Overwrite in place (e.g. a CUDA graph's static metadata) with a step of the same bucket."""
        if self._static() != other._static():
            raise ValueError(f"metadata of another bucket: {other._static()} vs {self._static()}")
        self.ints.copy_(other.ints, non_blocking=True)
        self.mask_words.copy_(other.mask_words, non_blocking=True)
        return self


def choose_block_m(max_nodes: int, group: int) -> int:
    lo = max(MIN_BLOCK_M, _next_pow2(group))
    hi = max(MAX_BLOCK_M, lo)
    return min(max(_next_pow2(max_nodes * group), lo), hi)


def choose_num_splits(num_programs: int, max_prefix: int, device: torch.device) -> int:
    """Split long prefixes when there are too few (tile, kv head) programs to fill the GPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_programs >= sms:
        return 1
    want = _cdiv(2 * sms, max(1, num_programs))
    return max(1, min(want, max_prefix // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _pack_mask(mask: torch.Tensor, words: int) -> torch.Tensor:
    """[n, n] bool -> [n, words] int64, bit j%64 of word j//64 = mask[:, j]."""
    n = mask.shape[0]
    padded = torch.zeros(n, words * 64, dtype=torch.int64)
    padded[:, :n] = mask.to(torch.int64)
    bits = torch.ones(64, dtype=torch.int64) << torch.arange(64, dtype=torch.int64)
    # Distinct powers of two: the sum is the bitwise or and cannot overflow
    # (bit 63 is the only negative term).
    return (padded.view(n, words, 64) * bits).sum(-1)


def _check_mask(mask: torch.Tensor, r: int) -> None:
    n = mask.shape[0]
    if mask.shape != (n, n):
        raise ValueError(f"sequence {r}: mask must be square, got {tuple(mask.shape)}")
    if not bool(mask.diagonal().all()):
        raise ValueError(f"sequence {r}: every node must see itself")
    # The kernel visits, for a tile of nodes, only own nodes up to the tile's
    # last one: ancestors must come before their descendants (tandem.tree does this).
    if bool(mask.triu(1).any()):
        raise ValueError(f"sequence {r}: a node sees a later node; ancestors must precede descendants")


def build_tree_metadata(block_tables: Sequence[Sequence[int]], prefix_lens: Sequence[int],
                        node_starts: Sequence[int], masks: Sequence[torch.Tensor], *,
                        block_size: int, num_q_heads: int, num_kv_heads: int,
                        device: torch.device | str, num_splits: int | None = None,
                        block_m: int | None = None, max_batch: int | None = None,
                        max_blocks: int | None = None, max_tiles: int | None = None,
                        max_rows: int | None = None, max_words: int | None = None) -> TreeAttnMetadata:
    """Pack one step. Sequence r has prefix_lens[r] committed tokens in the blocks
    block_tables[r] and len(masks[r]) nodes at rows node_starts[r].. of q/k/v.

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

    tables = torch.zeros(pB, pBlocks, dtype=torch.int32)
    info = torch.zeros(pB, 3, dtype=torch.int32)
    tile_t = torch.zeros(pTiles, 3, dtype=torch.int32)
    mask_words = torch.zeros(pRows, pWords, dtype=torch.int64)
    for r, (table, plen, start, mask) in enumerate(zip(block_tables, prefix_lens, node_starts, masks)):
        used = _cdiv(plen, block_size)
        tables[r, :used] = torch.as_tensor(list(table[:used]), dtype=torch.int32)
        info[r] = torch.tensor([plen, start, counts[r]], dtype=torch.int32)
        mask = mask.to("cpu", torch.bool)
        _check_mask(mask, r)
        mask_words[start: start + counts[r]] = _pack_mask(mask, pWords)
    if tiles:
        tile_t[: len(tiles)] = torch.tensor(tiles, dtype=torch.int32)
    ints = torch.cat((tables.flatten(), info.flatten(), tile_t.flatten()))
    pin = device.type == "cuda"
    if num_splits is None:
        num_splits = choose_num_splits(len(tiles) * num_kv_heads, max(prefix_lens, default=0), device)
    return TreeAttnMetadata(
        ints=(ints.pin_memory() if pin else ints).to(device, non_blocking=pin),
        mask_words=(mask_words.pin_memory() if pin else mask_words).to(device, non_blocking=pin),
        batch=pB, max_blocks=pBlocks, num_tiles=pTiles, block_size=block_size, group=group,
        block_m=block_m, num_splits=num_splits)


def block_tables_from_slots(prefix_slots: Sequence[torch.Tensor], block_size: int) -> list[list[int]]:
    """Recover each prefix's block table from its flat slots, checking they are paged in order."""
    tables = []
    for r, slots in enumerate(prefix_slots):
        slots = slots.to("cpu", torch.long)
        table = (slots[::block_size] // block_size)
        pos = torch.arange(len(slots))
        if not torch.equal(table[pos // block_size] * block_size + pos % block_size, slots):
            raise ValueError(f"sequence {r}: prefix slots are not token t at block_table[t // "
                             f"{block_size}] offset t % {block_size}")
        tables.append(table.tolist())
    return tables


def metadata_from_layout(layout: StepLayout, *, block_size: int, num_q_heads: int, num_kv_heads: int,
                         device: torch.device | str, **kwargs) -> TreeAttnMetadata:
    """The same step as a StepLayout describes it, packed for the kernel.

    Reads the layout's slots and masks back to the host: fine once per step, but
    a scheduler that already holds block tables should call build_tree_metadata.
    """
    for r, (count, mask) in enumerate(zip(layout.node_counts, layout.masks)):
        if mask.shape[0] != count:
            raise ValueError(f"sequence {r}: {count} nodes but a {tuple(mask.shape)} mask")
    return build_tree_metadata(
        block_tables_from_slots(layout.prefix_slots, block_size),
        [len(s) for s in layout.prefix_slots], layout.node_starts, layout.masks,
        block_size=block_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, device=device, **kwargs)
