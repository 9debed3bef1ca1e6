"""Triton, or a stand-in when it is not installed.

The torch references must keep working on CPU installs without Triton, and the
kernel modules define their @triton.jit functions at import time. The stand-in
lets those definitions import; calling a kernel then fails with a clear error.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    HAS_TRITON = False

    class _MissingTriton:
        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            def stub(*__: Any, **___: Any) -> Any:
                raise RuntimeError("triton is not installed: use the torch backend")

            if fn is None:  # used as @triton.jit(...)
                return lambda _fn: _Launchable(stub)
            return _Launchable(stub)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    class _Launchable:
        def __init__(self, stub: Any):
            self.stub = stub

        def __getitem__(self, _grid: Any) -> Any:
            return self.stub

    class _MissingLanguage:
        constexpr = Any

    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingLanguage()  # type: ignore[assignment]



def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (on CPU)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def _squeeze_scalar_index() -> None:
    """Triton 3.6's interpreter (the H200 image's) holds a scalar argument as a one-element 1-D
    array and takes it as an index with int(array), which NumPy 2 refuses, so a loop over
    range(0, ARG, STEP) fails there; Triton 3.8's squeezes the array first. Do as 3.8 does, for
    the interpreter only (on a one-GPU machine the TP=2 tests run their kernels interpreted)."""
    try:
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):  # another Triton: nothing to do
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


def _row_invariant_dot() -> None:
    """The interpreter's tl.dot is NumPy's matmul, and with NumPy 2.4.6's OpenBLAS (0.3.31, Haswell
    kernel) a row of a 64x64 product comes out a few ulps different at some positions of the block
    (row 7 differs from the same row at 0; row 15 does not), so a kernel whose tiles do not depend
    on the batch still gave a row another result among others. On the GPU a tile's dot reduces
    every row alike. Under the interpreter, take the product with einsum, whose own loops (no BLAS
    without `optimize`) sum every output over K the same way, wherever its row sits."""
    try:
        import numpy as np
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
        original = InterpreterBuilder.create_dot
    except (ImportError, AttributeError):  # another Triton: nothing to do
        return

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8/int8: as Triton does it
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_dtype = d.data.dtype
        a_data = a.data.astype(acc_dtype, copy=False)
        b_data = b.data.astype(acc_dtype, copy=False)
        product = np.einsum("...mk,...kn->...mn", a_data, b_data)
        return TensorHandle(product + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


if HAS_TRITON and interpreting():
    _squeeze_scalar_index()
    _row_invariant_dot()


__all__ = ["HAS_TRITON", "interpreting", "triton", "tl"]
