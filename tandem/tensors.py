"""torch tensors <-> the packed-bytes Tensor message."""

from __future__ import annotations

import numpy as np
import torch

from tandem.errors import InvalidArgument
from tandem.v1 import common_pb2

_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().contiguous().cpu()
    if t.dtype not in _NAMES:
        raise TypeError(f"cannot pack dtype {t.dtype}")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return common_pb2.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    if msg.dtype not in _DTYPES:
        raise InvalidArgument(f"unknown tensor dtype {msg.dtype!r}")
    dtype = _DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    count = int(np.prod(shape)) if shape else 1
    if len(msg.data) != count * dtype.itemsize:
        raise InvalidArgument(f"tensor of shape {list(shape)} and dtype {msg.dtype} needs "
                              f"{count * dtype.itemsize} bytes, got {len(msg.data)}")
    if dtype == torch.bfloat16:
        arr = np.frombuffer(msg.data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    np_dtype = {torch.bool: np.bool_}.get(dtype) or torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(msg.data, dtype=np_dtype).copy()).reshape(shape)
