from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepLane(_message.Message):
    __slots__ = ("path", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    token: str
    def __init__(self, path: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class KvLoad(_message.Message):
    __slots__ = ("num_sequences", "block_size", "total_blocks", "free_blocks", "free_token_slots")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    block_size: int
    total_blocks: int
    free_blocks: int
    free_token_slots: int
    def __init__(self, num_sequences: _Optional[int] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., free_token_slots: _Optional[int] = ...) -> None: ...
