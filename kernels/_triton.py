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


if HAS_TRITON and interpreting():
    _squeeze_scalar_index()


__all__ = ["HAS_TRITON", "interpreting", "triton", "tl"]
