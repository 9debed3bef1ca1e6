"""Wall time of a whole TargetEngine.step (host work, forward, acceptance, KV commit), graphs vs eager.

    python bench/engine_step.py --out engine_step.json     # 8B-shaped random bf16 target on a GPU
    python bench/engine_step.py --tiny                     # CPU smoke run (eager only)

bench/step_cost.py times the model's forward alone; this times what the target
service does per Step call minus gRPC: build the layout, pack the attention
metadata, run the forward (a replayed CUDA graph, or eager), move the argmax and
log-probs to the host, walk acceptance, write the accepted KV. Every request has
a committed prefix (default 1024 tokens); decode steps are one node, verify
steps a tree of N nodes (a chain of N/2 with a sibling per level). A benchmark,
not a test; figures are from the "8B-shaped random weights" track.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from target_service.cuda_graphs import GraphConfig  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from target_service.random_model import LLAMA_31_8B, random_llama_model  # noqa: E402
from target_service.types import SequenceStep  # noqa: E402


def tree(root: int, nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    tokens, parents, tip = [root], [-1], 0
    while len(tokens) < nodes:
        tokens.append(len(tokens) + 10)
        parents.append(tip)
        if len(tokens) < nodes:
            tokens.append(len(tokens) + 10)
            parents.append(tip)
        tip = len(tokens) - 1
    return tuple(tokens), tuple(parents)


def prefill(engine: TargetEngine, batch: int, prefix: int) -> list[str]:
    ids = [f"b{batch}-{i}" for i in range(batch)]
    g = torch.Generator().manual_seed(batch)
    for rid in ids:  # one eager chunk per request
        tokens = torch.randint(0, engine.model.cfg.vocab_size, (prefix,), generator=g).tolist()
        engine.step([SequenceStep.chain(rid, tokens, create=True)])
    return ids


def time_steps(engine: TargetEngine, ids: list[str], nodes: int, iters: int, device: str) -> float:
    last = {rid: 1 for rid in ids}
    times = []
    for _ in range(iters + 3):
        items = [SequenceStep(rid, *tree(last[rid], nodes), 1) for rid in ids]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.step(items)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        last = {r.request_id: r.tokens[-1] for r in out}
    return 1000 * statistics.median(times[3:])


def time_grant(engine: TargetEngine, ids: list[str], steps: int, device: str) -> float | None:
    """ms per step of a plain-decode grant of `steps` steps (two in flight on graphs), or None
    where the engine has no grant."""
    if not hasattr(engine, "grant"):
        return None
    import numpy as np

    from target_service.step_batch import StepBatch
    from target_service.wire import GrantStops

    batch = StepBatch.from_items([SequenceStep.chain(rid, [1]) for rid in ids])
    stops = GrantStops(max_new_tokens=np.full(len(ids), steps, dtype=np.int32),
                       stop_token_ids=(frozenset(),) * len(ids))
    for _ in range(2):  # the first grant warms up; the second is timed
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        replies = sum(1 for _ in engine.grant(batch, stops, steps, lambda: False))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return 1000 * seconds / replies


def time_replays(engine: TargetEngine, batch: int, nodes: int, iters: int) -> dict[str, float] | None:
    """ms per replay of a bucket's graphs alone, no host work: the forward, and forward + tail.
    What a step costs the GPU; a whole step minus this is host time."""
    graphs = getattr(engine, "graphs", None)
    bucket = getattr(graphs, "_buckets", {}).get((batch, nodes))
    if bucket is None or bucket.forward_graph is None:
        return None
    out = {}
    for name, graphs_run in (("forward", (bucket.forward_graph,)), ("forward+tail", (bucket.forward_graph,
                                                                                       bucket.tail_graph))):
        for _ in range(3):
            for g in graphs_run:
                g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            for g in graphs_run:
                g.replay()
        torch.cuda.synchronize()
        out[name] = 1000 * (time.perf_counter() - t0) / iters
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--nodes", default="1,4,8,16")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--grant", type=int, default=0, metavar="K",
                    help="also time plain-decode grants of K steps per batch (engines that have them)")
    ap.add_argument("--deterministic", action="store_true",
                    help="the batch-invariant kernels (tandem target --deterministic); on CPU needs TRITON_INTERPRET=1")
    ap.add_argument("--modes", default="graphs,eager", help="graphs, eager or both (default both; --tiny: eager)")
    ap.add_argument("--matmul", metavar="MIN_PROGRAMS,SPLIT_PROGRAMS",
                    help="with --deterministic: try another configuration of the invariant linear kernel "
                         "(kernels.matmul.MIN_PROGRAMS and SPLIT_K_PROGRAMS; 0,1: 64-wide tiles, no split-K)")
    ap.add_argument("--attention-rows", type=int, metavar="R",
                    help="with --deterministic: step rows of one sequence per program of the invariant attention "
                         "(kernels.invariant_attention.ROWS_PER_PROGRAM; 1: one row per program)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.matmul:
        import kernels.matmul as matmul
        matmul.MIN_PROGRAMS, matmul.SPLIT_K_PROGRAMS = (int(x) for x in args.matmul.split(","))
    if args.attention_rows is not None:
        # Read by every plan and call: set before the engine (and its graphs) exist.
        import kernels.invariant_attention as invariant_attention
        invariant_attention.ROWS_PER_PROGRAM = args.attention_rows
    device = "cpu" if args.tiny else "cuda"
    cfg = LLAMA_31_8B
    if args.tiny:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16)
        args.batches, args.nodes, args.prefix, args.iters = "1,4", "1,4", 32, 2
        args.grant = args.grant and 4
    batches = [int(b) for b in args.batches.split(",")]
    nodes = [int(n) for n in args.nodes.split(",")]
    model = random_llama_model(cfg, torch.bfloat16 if device == "cuda" else torch.float32, device,
                               batch_invariant=args.deterministic)
    blocks = max(batches) * (args.prefix + len(nodes) * max(nodes) * (args.iters + 4)) // 16 + 64
    wanted = ["eager"] if args.tiny else args.modes.split(",")
    modes = {mode: GraphConfig(max_batch=max(batches), max_nodes=max(nodes)) if mode == "graphs" else None
             for mode in wanted}
    rows = []
    for mode, graphs in modes.items():
        engine = TargetEngine(model, num_blocks=blocks, block_size=16, max_model_len=4096, graphs=graphs)
        if engine.graphs is not None:
            print(f"captured {len(engine.graphs.keys)} graphs in {engine.graphs.capture_all():.1f} s", flush=True)
        for b in batches:
            ids = prefill(engine, b, args.prefix)
            for n in nodes:
                ms = time_steps(engine, ids, n, args.iters, device)
                rows.append({"mode": mode, "batch": b, "nodes": n, "ms": ms})
                print(f"{mode:>6} batch {b:>4} nodes {n:>3}: {ms:8.2f} ms per step", flush=True)
                # Right after steps of this shape: the shared input buffer holds this bucket's layout.
                replay = time_replays(engine, b, n, args.iters) if mode == "graphs" else None
                if replay is not None:
                    rows.append({"mode": "replay", "batch": b, "nodes": n, **replay})
                    print(f"replay batch {b:>4} nodes {n:>3}: forward {replay['forward']:.2f} ms, "
                          f"forward+tail {replay['forward+tail']:.2f} ms", flush=True)
            if args.grant:
                ms = time_grant(engine, ids, args.grant, device)
                if ms is not None:
                    rows.append({"mode": mode, "batch": b, "nodes": 1, "grant": args.grant, "ms": ms})
                    print(f"{mode:>6} batch {b:>4} grant {args.grant:>2}: {ms:8.2f} ms per step", flush=True)
            engine.release(ids)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"track": "8B-shaped random weights" if not args.tiny else "tiny",
                                        "prefix": args.prefix, "deterministic": args.deterministic,
                                        "attention_rows": args.attention_rows, "rows": rows},
                                       indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
