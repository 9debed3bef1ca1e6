"""Compile kernels for a GPU architecture on a machine without one: a check before device time.

    python bench/compile_for_gpu.py [--arch 90]

The CPU tests run the Triton kernels interpreted, which checks what they compute but not that they
compile: a kernel the interpreter runs can still fail in Triton's compiler, and on the H200 that
costs a device call. This compiles the kernels named below for the architecture (sm_90: the H200)
with the Triton installed here (its own ptxas; no GPU or driver needed) and prints each variant's
size. Triton's compile API is internal and moves between releases: this is a tool, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.rope as rope  # noqa: E402
import kernels.tree_level as tree_level  # noqa: E402

I64, F32, F64, I32 = "*i64", "*fp32", "*fp64", "i32"
# (kernel, signature, constexpr variants, warps)
KERNELS = [
    (tree_level._grow_level_kernel,
     {"ChildLp": F32, "ChildIds": I64, "Frontier": I64, "CandToken": I64, "CandParent": I64, "CandLevel": I64,
      "CandLp": F32, "CandScore": F64, "D2t": I64, "Lengths": I64, "Words": I64, "OutFrontier": I64,
      "OutParent": I64, "OutToken": I64, "OutPositions": I64, "C": I32, "R": I32, "K": I32, "created": I32,
      "run": I32, "has_next": I32, "BLOCK": "constexpr"},
     [{"BLOCK": 16}, {"BLOCK": 64}, {"BLOCK": 1024}], 1),
    (tree_level._select_kernel,
     {"CandToken": I64, "CandParent": I64, "CandLevel": I64, "CandLp": F32, "CandScore": F64, "D2t": I64,
      "Out": "*i32", "C": I32, "n": I32, "BLOCK": "constexpr"},
     [{"BLOCK": 128}, {"BLOCK": 4096}], 1),
    (rope._rope_qkv_kernel,
     {"QKV": "*bf16", "Pos": I64, "Cos": F32, "Sin": F32, "QOut": "*bf16", "KOut": "*bf16", "VOut": "*bf16",
      "Rows": I64, "s_qkv": I32, "s_q": I32, "s_k": I32, "s_v": I32, "sc": I32, "ss": I32, "QH": "constexpr",
      "KVH": "constexpr", "HALF": "constexpr", "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr",
      "HAS_ROWS": "constexpr"},
     [{"QH": 32, "KVH": 8, "HALF": 64, "BLOCK_H": 32, "BLOCK_HALF": 64, "HAS_ROWS": rows} for rows in (False, True)],
     4),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90: H100/H200)")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    failed = 0
    for kernel, signature, variants, warps in KERNELS:
        for constexprs in variants:
            name = f"{kernel.fn.__name__} {constexprs}"
            try:
                compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                          target=target, options={"num_warps": warps})
            except Exception as exc:  # a compile error is what this looks for: report it and go on
                failed += 1
                print(f"FAILED {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            print(f"ok     {name}: {len(compiled.asm['cubin'])} bytes of cubin")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
