"""One-row linear layers on the GPU: F.linear (cuBLAS's GEMM, which splits K at one row and adds a
reduction kernel per call) against torch.mv (cuBLAS's GEMV, no second kernel), for each weight shape
of the 8B scale track.

    python bench/gemv_cost.py [--out FILE.json]

Each way is timed as one CUDA graph of `--layers` calls, each on its own copy of the weight (so no
call finds its weight in L2), replayed `--iters` times; microseconds per call and the bytes read per
second are printed. Both ways are checked against each other first (bf16, within 1e-2 relative).
Why: at batch 1 the forward is 1.34x its HBM floor (issue 11 asks 1.25x), and the eleventh session's
profile put 64 split-K reductions of 1.7 us each, and their gaps, among what is not weight traffic.
A benchmark, not a test.
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
sys.path.insert(0, str(REPO))  # run as `python3 bench/gemv_cost.py`, as the H200 call did

from tandem.graph_capture import capture_graphs  # noqa: E402

# (name, out_features, in_features) of Llama-3.1-8B's linear layers, q/k/v and gate/up fused as the target has them.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]


def time_graph(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Median ms of one replay."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="calls per graph, each on its own weight")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, n, k in SHAPES:
        layers = 1 if name == "lm_head" else args.layers
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, device=dev, dtype=dtype)
        outs = [torch.empty(1, n, device=dev, dtype=dtype) for _ in range(layers)]
        ref = F.linear(x, weights[0]).float()
        got = torch.mv(weights[0], x[0]).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()

        ways = {
            # as the model calls it (its output from the graph's pool)
            "linear": lambda weights=weights, x=x: [F.linear(x, w) for w in weights],
            "mm_out": lambda weights=weights, x=x, outs=outs: [torch.mm(x, w.t(), out=o)
                                                               for w, o in zip(weights, outs, strict=True)],
            "mv": lambda weights=weights, x=x, outs=outs: [torch.mv(w, x[0], out=o[0])
                                                           for w, o in zip(weights, outs, strict=True)],
        }
        row = {"name": name, "n": n, "k": k, "calls": layers, "mv_vs_linear_rel_err": err}
        for way, calls in ways.items():
            ms = time_graph(capture_graphs(calls)[0], args.iters)
            us = 1e3 * ms / layers
            row[f"{way}_us"] = round(us, 2)
            row[f"{way}_tb_s"] = round(2 * n * k / (us * 1e-6) / 1e12, 3)
        rows.append(row)
        print(f"{name:>8} {n:>6} x {k:>5}: linear {row['linear_us']:8.2f} us ({row['linear_tb_s']:.2f} TB/s), "
              f"mm out {row['mm_out_us']:8.2f} ({row['mm_out_tb_s']:.2f}), mv {row['mv_us']:8.2f} "
              f"({row['mv_tb_s']:.2f}); mv against linear {err:.1e}", flush=True)
        del weights, outs, ways
        torch.cuda.empty_cache()
    per_forward = {way: sum(r[f"{way}_us"] * (1 if r["name"] == "lm_head" else 32) for r in rows) / 1e3
                   for way in ("linear", "mm_out", "mv")}
    print("the forward's linear layers at batch 1 (32 layers and the lm_head), ms: "
          + ", ".join(f"{way} {ms:.3f}" for way, ms in per_forward.items()))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "per_forward_ms": per_forward}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
