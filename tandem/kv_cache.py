"""A paged KV cache: fixed-size blocks handed to sequences by a free-list allocator."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class SequenceKV:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is written


class PagedKVCache:
    """K and V for `num_layers` layers in blocks of `block_size` tokens.

    Storage per layer: [num_blocks, block_size, kv_heads, head_dim]. A sequence
    owns a list of blocks; token t lives in block blocks[t // block_size] at
    slot t % block_size.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[str, SequenceKV] = {}

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
    def create(self, seq_id: str) -> SequenceKV:
        if seq_id in self.seqs:
            raise KeyError(f"sequence {seq_id!r} exists")
        seq = self.seqs[seq_id] = SequenceKV()
        return seq

    def reserve(self, seq_id: str, new_length: int) -> None:
        """Make sure blocks cover `new_length` tokens."""
        seq = self.seqs[seq_id]
        need = self.blocks_for(new_length) - len(seq.blocks)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            seq.blocks.append(self._free.pop())

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
        return True

    # --- data -------------------------------------------------------------
    def host_slots(self, seq_id: str, start: int, stop: int) -> np.ndarray:
        """Flat slot indices (block * block_size + offset) of tokens [start, stop), on the host."""
        pos = np.arange(start, stop)
        blocks = np.asarray(self.seqs[seq_id].blocks, dtype=np.int64)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

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
