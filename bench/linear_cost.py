"""The linear layers of one decoder layer and the lm_head: cuBLAS (F.linear) against the batch-invariant
Triton kernel (kernels/matmul.py), per weight shape and number of rows, on one GPU.

    python bench/linear_cost.py --shape 8b --rows 1,8,64 --out linear.json
    python bench/linear_cost.py --wide "128,256,8,3,64,0,0;128,128,8,4,64,1,1" --rows 512 --out wide.json

--wide times the invariant kernel's wide calls (WIDE_FROM_M rows or more) in several configurations,
each "BLOCK_M,BLOCK_N,WARPS,STAGES,BLOCK_K,TMA,SPLITS_IN_PROGRAM", and checks each one's output
bitwise against the first configuration's and three of its rows against the same rows computed alone
(the small tiles): a configuration may only change speed.

Each figure is the median of --iters timings of --reps back-to-back calls (CUDA events), in
microseconds per call, with the bandwidth the weight read implies (bytes of the weight / time): at a
few rows a linear layer is a read of its weight, so that figure says how far a kernel is from HBM speed.
The split-K the invariant kernel picks for the shape is shown beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import kernels.matmul as matmul  # noqa: E402
from kernels.matmul import block_n_for, k_splits_for, linear_invariant  # noqa: E402
from target_service.random_model import LLAMA_31_8B, LLAMA_31_70B  # noqa: E402

CONFIGS = {"8b": LLAMA_31_8B, "70b": LLAMA_31_70B}


def weight_shapes(cfg, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each linear weight one rank holds at this TP degree."""
    hidden, inter, head = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * head
    return {"qkv_proj": (qkv // tp, hidden), "o_proj": (hidden, cfg.num_heads * head // tp),
            "gate_up_proj": (2 * inter // tp, hidden), "down_proj": (hidden, inter // tp),
            "lm_head": (cfg.vocab_size, hidden)}


def time_us(fn, iters: int, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(1000 * start.elapsed_time(end) / reps)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(CONFIGS), default="8b")
    parser.add_argument("--tp", type=int, default=1, help="shard the weights as one rank of this TP degree holds them")
    parser.add_argument("--rows", default="1,8,64", help="comma-separated numbers of rows (tokens in the step)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--configs", default=f"{matmul.MIN_PROGRAMS},{matmul.SPLIT_K_PROGRAMS}",
                        help="semicolon-separated MIN_PROGRAMS,SPLIT_K_PROGRAMS pairs of kernels.matmul to time the "
                             "invariant kernel with (0,1: 64-wide column tiles, no split-K)")
    parser.add_argument("--wide", metavar="CONFIGS",
                        help="semicolon-separated BLOCK_M,BLOCK_N,WARPS,STAGES,BLOCK_K,TMA,SPLITS_IN_PROGRAM "
                             "configurations of the wide calls to time and check (the first is the reference)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("linear_cost.py needs a CUDA device")
    if args.wide:
        return wide_sweep(args)
    rows_list = [int(x) for x in args.rows.split(",")]
    results = []
    configs = [tuple(int(v) for v in pair.split(",")) for pair in args.configs.split(";")]
    print(f"{'weight':13s} {'N x K':>13s} {'config':>8s} {'BN':>3s} {'splits':>6s} {'rows':>5s} "
          f"{'cuBLAS us':>10s} {'GB/s':>6s} {'invariant us':>13s} {'GB/s':>6s} {'ratio':>6s}")
    for name, (n, k) in weight_shapes(CONFIGS[args.shape], args.tp).items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        gbytes = weight.numel() * weight.element_size() / 1e9
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_us(lambda x=x, weight=weight: F.linear(x, weight), args.iters, args.reps)
            for min_programs, aim in configs:
                matmul.MIN_PROGRAMS, matmul.SPLIT_K_PROGRAMS = min_programs, aim  # read at every call
                splits = k_splits_for(n, k)[0]
                invariant = time_us(lambda x=x, weight=weight: linear_invariant(x, weight), args.iters, args.reps)
                row = {"weight": name, "n": n, "k": k, "rows": rows, "min_programs": min_programs,
                       "split_programs": aim, "splits": splits,
                       "block_n": block_n_for(n), "cublas_us": cublas, "invariant_us": invariant,
                       "cublas_gb_s": gbytes / (cublas * 1e-6), "invariant_gb_s": gbytes / (invariant * 1e-6)}
                results.append(row)
                print(f"{name:13s} {n:6d}x{k:<6d} {f'{min_programs},{aim}':>8s} {block_n_for(n):3d} {splits:6d} "
                      f"{rows:5d} {cublas:10.1f} "
                      f"{row['cublas_gb_s']:6.0f} {invariant:13.1f} {row['invariant_gb_s']:6.0f} "
                      f"{invariant / cublas:6.2f}")
        del weight
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "tp": args.tp, "device": torch.cuda.get_device_name(),
                                        "results": results}, indent=1))


WIDE_KNOBS = ("WIDE_BLOCK_M", "WIDE_BLOCK_N", "WIDE_NUM_WARPS", "WIDE_NUM_STAGES", "WIDE_BLOCK_K", "WIDE_TMA",
              "WIDE_SPLITS_IN_PROGRAM")


def wide_sweep(args: argparse.Namespace) -> None:
    configs = [tuple(int(v) for v in spec.split(",")) for spec in args.wide.split(";")]
    if any(len(config) != len(WIDE_KNOBS) for config in configs):
        raise SystemExit(f"each --wide configuration is {','.join(WIDE_KNOBS)}")
    rows_list = [int(x) for x in args.rows.split(",")]
    if min(rows_list) < matmul.WIDE_FROM_M:
        raise SystemExit(f"wide calls have at least WIDE_FROM_M = {matmul.WIDE_FROM_M} rows")
    results = []
    print(f"{'weight':13s} {'N x K':>13s} {'rows':>5s} {'config':>22s} {'cuBLAS us':>10s} {'us':>8s} "
          f"{'TFLOP/s':>8s} {'/cuBLAS':>8s} {'same':>5s} {'alone':>6s}")
    for name, (n, k) in weight_shapes(CONFIGS[args.shape], args.tp).items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_us(lambda x=x, weight=weight: F.linear(x, weight), args.iters, args.reps)
            picked = (0, rows // 2 + 1, rows - 1)
            alone = [linear_invariant(x[i:i + 1], weight) for i in picked]
            reference = None
            for config in configs:
                for knob, value in zip(WIDE_KNOBS, config):
                    setattr(matmul, knob, value)
                # The tiles given are those of whichever wide kernel the call takes.
                matmul.SUMMING_BLOCK_N, matmul.SUMMING_NUM_STAGES = matmul.WIDE_BLOCK_N, matmul.WIDE_NUM_STAGES
                try:
                    out = linear_invariant(x, weight)
                    spent = time_us(lambda x=x, weight=weight: linear_invariant(x, weight), args.iters, args.reps)
                except Exception as exc:  # a configuration the device cannot run (shared memory, registers)
                    print(f"{name:13s} {n:6d}x{k:<6d} {rows:5d} {','.join(map(str, config)):>22s} failed: "
                          f"{type(exc).__name__}: {str(exc)[:120]}")
                    results.append({"weight": name, "n": n, "k": k, "rows": rows, "config": config,
                                    "error": f"{type(exc).__name__}: {exc}"})
                    continue
                reference = out if reference is None else reference
                same = bool(torch.equal(out, reference))
                same_alone = all(torch.equal(out[i], row[0]) for i, row in zip(picked, alone))
                tflops = 2 * rows * n * k / (spent * 1e-6) / 1e12
                results.append({"weight": name, "n": n, "k": k, "rows": rows, "config": config,
                                "splits": k_splits_for(n, k)[0], "cublas_us": cublas, "invariant_us": spent,
                                "tflops": tflops, "same_as_first": same, "rows_equal_alone": same_alone})
                print(f"{name:13s} {n:6d}x{k:<6d} {rows:5d} {','.join(map(str, config)):>22s} {cublas:10.1f} "
                      f"{spent:8.1f} {tflops:8.0f} {spent / cublas:8.2f} {str(same):>5s} {str(same_alone):>6s}",
                      flush=True)
        del weight
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "tp": args.tp, "device": torch.cuda.get_device_name(),
                                        "knobs": WIDE_KNOBS, "results": results}, indent=1))


if __name__ == "__main__":
    main()
