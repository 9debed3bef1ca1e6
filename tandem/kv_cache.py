"""A paged KV cache: fixed-size blocks handed to sequences by a free-list allocator."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class OutOfBlocks(RuntimeError):
    pass


@dataclass(eq=False)
class SequenceKV:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is written
    row: int = -1  # this sequence's row of the device block table (when the cache keeps one)


class BlockTable:
    """The block lists of all sequences as one device tensor [rows + 1, max_blocks]
    (int32), changed by what each step adds rather than rebuilt: reserve() records
    (flat index, block) pairs, and the next step applies them on the device (the
    target engine copies them in with the step's inputs). The last row is a
    padding row that no sequence owns.
    """

    def __init__(self, rows: int, max_blocks: int, device: torch.device | str):
        self.rows = rows
        self.max_blocks = max_blocks
        self.table = torch.zeros(rows + 1, max_blocks, dtype=torch.int32, device=device)
        # The same on the host, always current (the device copy lags by the pending entries):
        # the step packer reads each node's cache slot from it.
        self.host = np.zeros((rows + 1, max_blocks), dtype=np.int64)
        self._free_rows = list(range(rows - 1, -1, -1))
        # row * max_blocks + column -> block; a dict, so a slot changed twice before a step
        # (a row released and reused) carries only its last value to the device.
        self.pending: dict[int, int] = {}

    @property
    def padding_row(self) -> int:
        return self.rows

    def take_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def give_row(self, row: int) -> None:
        self._free_rows.append(row)

    def take_pending(self) -> dict[int, int]:
        pending, self.pending = self.pending, {}
        return pending

    def flush(self) -> None:
        """Apply the pending entries to the device table now (callers that do not pack them
        into a step's input)."""
        pending = self.take_pending()
        if pending:
            # Queued in stream order without waiting for the GPU: a copy from pageable memory is
            # staged by the driver before the call returns, so the host tensors may go at once.
            entries = torch.tensor([list(pending.keys()), list(pending.values())], dtype=torch.long)
            entries = entries.to(self.table.device, non_blocking=True)
            self.table.view(-1)[entries[0]] = entries[1].to(self.table.dtype)


class PagedKVCache:
    """K and V for `num_layers` layers in blocks of `block_size` tokens.

    Storage: one tensor each for K and V, [num_layers, num_blocks + 1, block_size,
    kv_heads, head_dim]; k[layer] / v[layer] are per-layer views. A sequence owns a
    list of blocks; token t lives in block blocks[t // block_size] at slot
    t % block_size. The extra last block is trash: rows of a step that are not
    kept are written there, so one fixed-shape write serves every step.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))
        self.block_size = block_size
        self._block_offsets = np.arange(block_size, dtype=np.int64)  # a token's slot within its block
        self.num_blocks = num_blocks
        self.trash_slot = num_blocks * block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[str, SequenceKV] = {}
        self.block_table: BlockTable | None = None

    def keep_block_table(self, max_seqs: int, max_tokens_per_seq: int) -> BlockTable:
        """Mirror every sequence's blocks in a device table (before any sequence exists)."""
        if self.seqs:
            raise RuntimeError("the block table must be set up before sequences are created")
        self.block_table = BlockTable(max_seqs, self.blocks_for(max_tokens_per_seq), self.k_all.device)
        return self.block_table

    # --- accounting -------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, seq_id: str | None, new_length: int) -> int:
        held = len(self.seqs[seq_id].blocks) if seq_id in self.seqs else 0
        return max(0, self.blocks_for(new_length) - held)

    # --- lifecycle --------------------------------------------------------
    @property
    def free_rows(self) -> int:
        """Sequences that can still be created (unbounded without a block table)."""
        return len(self.block_table._free_rows) if self.block_table is not None else 1 << 30

    def create(self, seq_id: str) -> SequenceKV:
        if seq_id in self.seqs:
            raise KeyError(f"sequence {seq_id!r} exists")
        seq = SequenceKV()
        if self.block_table is not None:
            row = self.block_table.take_row()
            if row is None:
                raise OutOfBlocks(f"all {self.block_table.rows} sequence slots are in use")
            seq.row = row
        self.seqs[seq_id] = seq
        return seq

    def reserve(self, seq_id: str, new_length: int) -> None:
        """Make sure blocks cover `new_length` tokens."""
        seq = self.seqs[seq_id]
        need = self.blocks_for(new_length) - len(seq.blocks)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        table = self.block_table
        if table is not None and len(seq.blocks) + need > table.max_blocks:
            raise OutOfBlocks(f"a sequence of {new_length} tokens needs more than {table.max_blocks} blocks")
        for _ in range(need):
            block = self._free.pop()
            if table is not None:
                table.pending[seq.row * table.max_blocks + len(seq.blocks)] = block
                table.host[seq.row, len(seq.blocks)] = block
            seq.blocks.append(block)

    def trim(self, seq_id: str) -> None:
        """Give back blocks beyond the sequence's written length."""
        seq = self.seqs[seq_id]
        keep = self.blocks_for(seq.length)
        while len(seq.blocks) > keep:
            self._free.append(seq.blocks.pop())

    def release(self, seq_id: str) -> bool:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        self._free.extend(reversed(seq.blocks))
        if self.block_table is not None:
            self.block_table.give_row(seq.row)
        return True

    # --- data -------------------------------------------------------------
    def host_slots(self, seq_id: str, start: int, stop: int) -> np.ndarray:
        """Flat slot indices (block * block_size + offset) of tokens [start, stop), on the host."""
        seq = self.seqs[seq_id]
        # The block table's host row is the block list as an array already (no list to convert).
        held = self.block_table.host[seq.row] if self.block_table is not None else np.asarray(seq.blocks, np.int64)
        # Whole blocks' slots, then the span: three array operations where dividing every
        # position by the block size took five (a CPU step builds its prefix's slots each time).
        first = start // self.block_size
        slots = (held[first: -(-stop // self.block_size), None] * self.block_size + self._block_offsets).reshape(-1)
        return slots[start - first * self.block_size: stop - first * self.block_size]

    def slots(self, seq_id: str, start: int, stop: int) -> torch.Tensor:
        """host_slots on the cache's device."""
        return torch.from_numpy(self.host_slots(seq_id, start, stop)).to(self.k[0].device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [len(slots), kv_heads, head_dim]."""
        self.k[layer].view(-1, *self.k[layer].shape[2:])[slots] = k
        self.v[layer].view(-1, *self.v[layer].shape[2:])[slots] = v

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat_k = self.k[layer].view(-1, *self.k[layer].shape[2:])
        flat_v = self.v[layer].view(-1, *self.v[layer].shape[2:])
        return flat_k[slots], flat_v[slots]
