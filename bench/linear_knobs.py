"""Whether other values of the batch-invariant linear kernel's "how" constants (stages, warps, K steps)
leave its results bitwise unchanged, on the GPU: each weight of the 8B shapes at several row counts,
the default output against the output with each setting.

    python bench/linear_knobs.py --specs "NUM_STAGES=4;SMALL_BLOCK_K=128" --rows 1,8,64,512

A setting that changes no bit can replace the default without touching any equality measured with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import kernels.matmul as matmul  # noqa: E402
from bench.engine_step import MATMUL_KNOBS, set_kernel_config  # noqa: E402
from bench.linear_cost import CONFIGS, weight_shapes  # noqa: E402
from kernels.matmul import linear_invariant  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", required=True, help="semicolon-separated NAME=VALUE,... settings of kernels.matmul")
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("linear_knobs.py needs a CUDA device")
    defaults = {name: getattr(matmul, name) for name in MATMUL_KNOBS}
    rows_list = [int(x) for x in args.rows.split(",")]
    g = torch.Generator("cuda").manual_seed(0)
    for name, (n, k) in weight_shapes(CONFIGS["8b"], args.tp).items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            reference = linear_invariant(x, weight)
            for spec in args.specs.split(";"):
                set_kernel_config(matmul, MATMUL_KNOBS, spec)
                same = torch.equal(linear_invariant(x, weight), reference)
                for knob, value in defaults.items():
                    setattr(matmul, knob, value)
                print(f"{name:13s} {n:6d}x{k:<6d} rows {rows:4d}  {spec:24s} bitwise the default: {same}", flush=True)
        del weight


if __name__ == "__main__":
    main()
