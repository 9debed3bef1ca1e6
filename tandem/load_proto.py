"""The KvLoad message from either service's load dataclass (they share its four fields)."""

from __future__ import annotations

from typing import Protocol

from tandem.v1 import common_pb2


class HasKvLoad(Protocol):
    num_sequences: int
    block_size: int
    total_blocks: int
    free_blocks: int


def load_to_proto(load: HasKvLoad) -> common_pb2.KvLoad:
    return common_pb2.KvLoad(num_sequences=load.num_sequences, block_size=load.block_size,
                             total_blocks=load.total_blocks, free_blocks=load.free_blocks,
                             free_token_slots=load.free_blocks * load.block_size)
