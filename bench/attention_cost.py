"""Cost of the target's tree attention alone, one layer's launch as a forward runs it.

    python bench/attention_cost.py --out attention_cost.json          # one GPU: 8B shapes, bf16
    python bench/attention_cost.py --tiny --out /tmp/attention.json   # CPU smoke run (interpreter)

For every (batch, nodes) shape it captures one CUDA graph of 32 launches (a layer's
attention each, every layer over its own KV cache, so nothing is served from L2 that a
forward would read from HBM) and reports microseconds per launch (the split merge's
included), for each split count asked for ("auto": what the engine's graphs choose,
kernels.tree_metadata.choose_num_splits). Run from another checkout's root with its
PYTHONPATH to time that checkout's kernels. A benchmark, not a test: it prints numbers and
checks only that every split count gives the output of the first, within bf16 rounding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

import kernels.tree_attention as tree_attention
from kernels.tree_metadata import build_tree_metadata, choose_num_splits
from tandem.tree import ancestor_mask

LAYERS = 32


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated")
    ap.add_argument("--nodes", default="1,8", help="nodes per request (1: decode; N: a verify tree), comma-separated")
    ap.add_argument("--prefix", type=int, default=1024, help="committed tokens per request")
    ap.add_argument("--splits", default="auto,8,16,32",
                    help="prefix splits to time, comma-separated; auto: the graphs' choice for --max-model-len")
    ap.add_argument("--max-model-len", type=int, default=4096, help="what the engine sizes its graphs' splits for")
    ap.add_argument("--iters", type=int, default=30, help="graph replays timed per variant")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.nodes = [int(x) for x in args.nodes.split(",")]
    args.splits = args.splits.split(",")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        q_heads, kv_heads, head_dim, block, dtype, layers = 4, 2, 16, 4, torch.float32, 2
        args.prefix, args.iters = min(args.prefix, 24), 1
    else:
        q_heads, kv_heads, head_dim, block, dtype, layers = 32, 8, 128, 16, torch.bfloat16, LAYERS
    rows = []
    print(f"{'batch':>5} {'nodes':>5} {'splits':>6} {'asked':>6} {'us/launch':>9}", flush=True)
    for batch in args.batches:
        blocks_per_seq = -(-args.prefix // block)
        caches = [(torch.randn(batch * blocks_per_seq, block, kv_heads, head_dim, device=device).to(dtype),
                   torch.randn(batch * blocks_per_seq, block, kv_heads, head_dim, device=device).to(dtype))
                  for _ in range(layers)]
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        for nodes in args.nodes:
            parents = [-1] + [(i - 1) // 4 for i in range(1, nodes)]  # a 4-ary tree, as drafts grow
            mask = ancestor_mask(parents)
            total = batch * nodes
            q = torch.randn(total, q_heads, head_dim, device=device).to(dtype)
            k = torch.randn(total, kv_heads, head_dim, device=device).to(dtype)
            v = torch.randn(total, kv_heads, head_dim, device=device).to(dtype)
            first_out = None
            for splits_asked in args.splits:
                if splits_asked == "auto":
                    probe = build_tree_metadata(tables, [args.prefix] * batch, [i * nodes for i in range(batch)],
                                                [mask] * batch, block_size=block, num_q_heads=q_heads,
                                                num_kv_heads=kv_heads, device=device, num_splits=1)
                    splits = choose_num_splits(probe.num_tiles * kv_heads, args.max_model_len, device)
                else:
                    splits = int(splits_asked)
                meta = build_tree_metadata(tables, [args.prefix] * batch, [i * nodes for i in range(batch)],
                                           [mask] * batch, block_size=block, num_q_heads=q_heads,
                                           num_kv_heads=kv_heads, device=device, num_splits=splits)
                outs = [torch.empty_like(q) for _ in range(layers)]
                us = time_layers(partial(launch_layers, q, k, v, caches, meta, outs), args.iters, layers, device)
                same = None
                if first_out is None:
                    first_out = outs[0].float()
                else:
                    same = bool(torch.allclose(outs[0].float(), first_out, atol=2e-2, rtol=2e-2))
                rows.append({"batch": batch, "nodes": nodes, "splits": splits, "splits_asked": splits_asked,
                             "us_per_launch": us, "same_as_first": same})
                print(f"{batch:>5} {nodes:>5} {splits:>6} {splits_asked:>6} {us:9.2f}"
                      + ("" if same is not False else "  OUTPUT DIFFERS"), flush=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "dtype": str(dtype).removeprefix("torch."), "prefix": args.prefix, "layers": layers,
              "shapes": {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def launch_layers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  caches: list[tuple[torch.Tensor, torch.Tensor]], meta, outs: list[torch.Tensor]) -> None:
    for (cache_k, cache_v), out in zip(caches, outs):
        tree_attention.tree_attention_triton(q, k, v, cache_k, cache_v, meta, 0.088, out=out)


def time_layers(forward, iters: int, layers: int, device: torch.device) -> float:
    """Microseconds per launch: a graph of every layer's launch, replayed (eagerly on CPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        forward()
        return (time.perf_counter() - t0) / layers * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # compiles every variant before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(times)


if __name__ == "__main__":
    main()
