"""torch tensors <-> the packed-bytes Tensor message."""

from __future__ import annotations

import array
import math

import numpy as np
import torch

from tandem.errors import InvalidArgument
from tandem.v1 import common_pb2

_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name of a dtype (Tensor.dtype, RingRows.dtype)."""
    if dtype not in _NAMES:
        raise TypeError(f"cannot pack dtype {dtype}")
    return _NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a wire name stands for; InvalidArgument for one it does not know."""
    if name not in _DTYPES:
        raise InvalidArgument(f"unknown tensor dtype {name!r}")
    return _DTYPES[name]


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().contiguous().cpu()
    name = dtype_name(t.dtype)
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return common_pb2.Tensor(dtype=name, shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    dtype = dtype_from_name(msg.dtype)
    shape = tuple(msg.shape)
    count = math.prod(shape)
    if len(msg.data) != count * dtype.itemsize:
        raise InvalidArgument(f"tensor of shape {list(shape)} and dtype {msg.dtype} needs "
                              f"{count * dtype.itemsize} bytes, got {len(msg.data)}")
    if dtype == torch.bfloat16:
        arr = np.frombuffer(msg.data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    np_dtype = {torch.bool: np.bool_}.get(dtype) or torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(msg.data, dtype=np_dtype).copy()).reshape(shape)


_NP_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64",
             np.dtype(np.int32): "int32", np.dtype(np.uint8): "uint8", np.dtype(np.bool_): "bool"}
_NP_DTYPES = {name: dtype for dtype, name in _NP_NAMES.items()}


def array_to_proto(a: np.ndarray) -> common_pb2.Tensor:
    """A numpy array as a packed Tensor (no torch on the way: the hot path's columns)."""
    a = np.ascontiguousarray(a)
    if a.dtype not in _NP_NAMES:
        raise TypeError(f"cannot pack dtype {a.dtype}")
    return common_pb2.Tensor(dtype=_NP_NAMES[a.dtype], shape=list(a.shape), data=a.tobytes())


def array_from_proto(msg: common_pb2.Tensor, dtype: str, what: str) -> np.ndarray:
    """The Tensor's values as a read-only numpy array of the dtype the caller expects;
    InvalidArgument names `what` when the message does not hold that."""
    if msg.dtype != dtype:
        raise InvalidArgument(f"{what}: expected {dtype} values, got {msg.dtype or 'none'!r}")
    np_dtype = _NP_DTYPES[dtype]
    # math.prod, not np.prod: on a protobuf repeated field numpy's costs ~0.1 ms, and every step
    # decodes about a dozen columns on each side.
    shape = tuple(msg.shape)
    count = math.prod(shape) if shape else 0
    if len(msg.data) != count * np_dtype.itemsize:
        raise InvalidArgument(f"{what}: shape {list(msg.shape)} needs {count * np_dtype.itemsize} bytes, "
                              f"got {len(msg.data)}")
    return np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)


# Plain-list columns through the stdlib's array module: the hot path's small columns (a call's few trees, a
# push's few sequences) turn into Python lists with no numpy op on the way. A served hop runs cold, after a
# wait, where each numpy op costs tens of microseconds: a tree's seven columns parsed this way took 95 against
# 185-245 us through numpy on the dev machine (BENCHMARKS.md, the sixty-second session).
_ARRAY_CODES = {"uint8": "B", "int32": "i", "int64": "q", "float32": "f"}


def list_from_proto(msg: common_pb2.Tensor, dtype: str, what: str) -> list:
    """array_from_proto(msg, dtype, what).tolist(), without numpy (uint8, int32, int64 and float32)."""
    if msg.dtype != dtype:
        raise InvalidArgument(f"{what}: expected {dtype} values, got {msg.dtype or 'none'!r}")
    values = array.array(_ARRAY_CODES[dtype])
    count = math.prod(msg.shape) if msg.shape else 0
    if len(msg.data) != count * values.itemsize:
        raise InvalidArgument(f"{what}: shape {list(msg.shape)} needs {count * values.itemsize} bytes, "
                              f"got {len(msg.data)}")
    values.frombytes(msg.data)
    return values.tolist()


def list_to_proto(values, dtype: str) -> common_pb2.Tensor:
    """A flat column of Python numbers as a packed Tensor of dtype (uint8, int32, int64 or float32), without numpy."""
    packed = array.array(_ARRAY_CODES[dtype], values)
    return common_pb2.Tensor(dtype=dtype, shape=[len(packed)], data=packed.tobytes())
