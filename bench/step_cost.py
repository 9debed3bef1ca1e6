"""Cost of one target step on a Llama-3.1-8B-shaped target with random weights.

    python bench/step_cost.py --out step_cost.json              # one GPU: bf16, triton attention
    python bench/step_cost.py --tiny --out /tmp/step_cost.json  # CPU smoke run of the same code
    python bench/step_cost.py --batches 1,64 --nodes 8 --l2-prefetch-mb 0,32 --out pf.json  # L2 prefetch A/B

(with the package installed, `pip install -e .`, or PYTHONPATH set to the repo root).

For every batch size, times a plain decode step (one node per request) and
verify steps (a draft tree of N nodes per request), eagerly and, on CUDA, as a
replayed CUDA graph (one graph per (batch, nodes) shape), and prints them
against two floors measured on the same device: memory, (weight bytes + KV
bytes read) / device-copy bandwidth, and the roofline, max(memory floor,
FLOPs / bf16 matmul rate). Figures are from the "8B-shaped random weights"
track (or "tiny random" with --tiny); the JSON says which.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.l2_prefetch import WeightPrefetch
from kernels.tree_attention import StepLayout
from tandem.kv_cache import PagedKVCache
from tandem.model_config import LlamaConfig
from tandem.tree import ancestor_mask, depths
from target_service.model import LlamaModel
from target_service.random_model import LLAMA_31_8B, random_llama_model

TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position=4096,
                   tie_word_embeddings=False)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class Step:
    tokens: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout
    logit_rows: torch.Tensor
    nodes_seen: int  # sum over nodes of the step nodes each one attends to


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    ap.add_argument("--tiny", action="store_true", help="tiny model and shapes (runs on CPU)")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,8,32,64,128)")
    ap.add_argument("--nodes", default=None, help="verify tree sizes, comma-separated (default 4,8,16,32)")
    ap.add_argument("--prefix", type=int, default=None, help="committed tokens per request (default 1024)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4, help="children per tree node")
    ap.add_argument("--backend", default=None, help="torch|triton|flashinfer (default: the device's)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--l2-prefetch-mb", default="0", metavar="MIB,...",
                    help="time each step with each of these L2 prefetch caps (kernels.l2_prefetch; 0: off), one "
                         "after the other on the same model: e.g. 0,32 (default 0)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile N replays of each step (the graph where there is one) and print its "
                         "kernels: count and device time per step, grouped, beside the step's wall time")
    args = ap.parse_args()
    small = args.tiny
    args.batches = [int(b) for b in (args.batches or ("1,4" if small else "1,8,32,64,128")).split(",")]
    args.nodes = [int(n) for n in (args.nodes or ("4,8" if small else "4,8,16,32")).split(",")]
    args.prefix = args.prefix if args.prefix is not None else (40 if small else 1024)
    args.iters = args.iters or (2 if small else 20)
    args.l2_prefetch_mb = [int(mb) for mb in args.l2_prefetch_mb.split(",")]
    if any(mb < 0 for mb in args.l2_prefetch_mb):
        ap.error("--l2-prefetch-mb: caps must be >= 0")
    return args


# --- measuring ------------------------------------------------------------


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> list[float]:
    """Milliseconds per call, each call timed on its own."""
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(timed(lambda: dst.copy_(src), 10, device))
    return 2 * nbytes / (ms / 1e3)


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matrix product on random data."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):
        a @ b
    ms = statistics.median(timed(lambda: a @ b, 10, device))
    return 2 * n ** 3 / (ms / 1e3)


def weight_bytes(model: LlamaModel) -> int:
    # Every layer's weights, the final norm and lm_head are read once per step;
    # the embedding only for the step's rows (negligible).
    tensors = [w for layer in model.layers for w in layer.values() if w is not None]
    return sum(t.numel() * t.element_size() for t in tensors + [model.norm, model.lm_head])


def step_flops(model: LlamaModel, step: Step, prefix: int) -> float:
    cfg, T = model.cfg, step.tokens.shape[0]
    per_layer = sum(model.layers[0][k].numel() for k in ("qkv", "o", "gate_up", "down"))
    linear = 2 * T * per_layer * cfg.num_layers + 2 * step.logit_rows.shape[0] * model.lm_head.numel()
    # QK^T and PV: 4 * keys seen * head_dim per query head.
    keys = T * prefix + step.nodes_seen
    attention = 4 * keys * model.heads_local * cfg.head_dim * cfg.num_layers
    return float(linear + attention)


# --- the step ---------------------------------------------------------------


def tree_parents(nodes: int, topk: int) -> list[int]:
    # Node 0 is the pending token; the drafted nodes fill a topk-ary tree below it.
    return [-1] + [(i - 1) // topk for i in range(1, nodes)]


def make_step(kv: PagedKVCache, seq_ids: list[str], nodes: int, topk: int, vocab: int,
              device: torch.device) -> Step:
    parents = tree_parents(nodes, topk)
    d = depths(parents)
    mask = ancestor_mask(parents)  # on the host: the metadata is packed there
    starts, slots, tables, positions = [], [], [], []
    for r, sid in enumerate(seq_ids):
        length = kv.seqs[sid].length
        starts.append(r * nodes)
        slots.append(kv.slots(sid, 0, length))
        tables.append(kv.seqs[sid].blocks)
        positions.extend(length + x for x in d)
    T = nodes * len(seq_ids)
    layout = StepLayout(tuple(starts), (nodes,) * len(seq_ids), tuple(slots), (mask,) * len(seq_ids),
                        block_tables=tuple(tables))
    g = torch.Generator().manual_seed(nodes)
    tokens = torch.randint(0, vocab, (T,), generator=g).to(device)
    # Logits from the last fixed node on: every node of a tree, the one node of a decode.
    return Step(tokens, torch.tensor(positions, device=device), layout, torch.arange(T, device=device),
                int(mask.sum()) * len(seq_ids))


def time_step(model: LlamaModel, kv: PagedKVCache, step: Step, args: argparse.Namespace) -> dict:
    device = model.device

    def plan():
        return model.attention.plan(step.layout, block_size=kv.block_size, num_q_heads=model.heads_local,
                                    num_kv_heads=model.kv_heads_local, device=device)

    def plan_and_wait():
        plan()
        if device.type == "cuda":  # the metadata's host-to-device copies are part of it
            torch.cuda.synchronize()

    plan_ms = statistics.median(timed(plan_and_wait, max(3, args.iters // 4), device))
    meta = plan()  # built once per step, as the engine does; passed to forward as the layout

    def forward():
        return model.forward(step.tokens, step.positions, meta, kv, step.logit_rows)

    for _ in range(args.warmup):
        forward()
    eager = timed(forward, args.iters, device)
    result = {"plan_ms": plan_ms, "eager_ms": statistics.median(eager), "graph_ms": None, "kernels": None}
    if device.type == "cuda" and not args.no_graphs and model.attention.name == "triton":
        result["graph_ms"], result["kernels"] = time_graph(forward, args, device)
    elif args.profile:
        result["kernels"] = profile_kernels(forward, args.profile, device)
    return result


def kernel_group(name: str) -> str:
    """A kernel's part of the forward, from its name (cuBLAS's GEMMs and ours are named as they are)."""
    low = name.lower()
    if any(key in low for key in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "matmul"
    if "attention" in low or "attn" in low or "merge" in low:
        return "attention"
    if "norm" in low:
        return "norm"
    if "rope" in low or "rotary" in low:
        return "rope"
    return "other"


def profile_kernels(fn: Callable[[], object], iters: int, device: torch.device) -> dict:
    """Device time per step of each kernel fn launches, from torch.profiler over `iters` calls; with
    the wall time of the same calls, the difference is the time the GPU sat between kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        wall_us = sum(timed(fn, iters, device)) * 1e3 / iters
    kernels = []
    for avg in prof.key_averages():
        # On the CPU the "kernels" are the top-level torch ops: a smoke run of the same code.
        us = avg.self_device_time_total if cuda else avg.self_cpu_time_total
        if us <= 0:
            continue
        kernels.append({"name": avg.key, "group": kernel_group(avg.key), "calls_per_step": avg.count / iters,
                        "us_per_step": us / iters})
    kernels.sort(key=lambda k: -k["us_per_step"])
    groups: dict[str, dict] = {}
    for k in kernels:
        g = groups.setdefault(k["group"], {"calls_per_step": 0.0, "us_per_step": 0.0})
        g["calls_per_step"] += k["calls_per_step"]
        g["us_per_step"] += k["us_per_step"]
    busy = sum(k["us_per_step"] for k in kernels)
    return {"wall_us_per_step": wall_us, "kernel_us_per_step": busy, "idle_us_per_step": wall_us - busy,
            "groups": groups, "kernels": kernels}


def print_kernels(label: str, profile: dict, top: int = 12) -> None:
    print(f"  kernels of {label}: wall {profile['wall_us_per_step']:.0f} us per step, kernels "
          f"{profile['kernel_us_per_step']:.0f} us, GPU idle between them {profile['idle_us_per_step']:.0f} us")
    for name, g in sorted(profile["groups"].items(), key=lambda item: -item[1]["us_per_step"]):
        print(f"    {name:<10} {g['calls_per_step']:7.1f} launches {g['us_per_step']:9.1f} us")
    for k in profile["kernels"][:top]:
        print(f"      {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['name'][:90]}")


def time_graph(forward: Callable[[], object], args: argparse.Namespace,
               device: torch.device) -> tuple[float, dict | None]:
    # Static inputs: the step's tensors and metadata are captured as they are.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for _ in range(args.warmup):
        graph.replay()
    times = timed(graph.replay, args.iters, device)
    kernels = profile_kernels(graph.replay, args.profile, device) if args.profile else None
    del graph, out
    torch.cuda.empty_cache()
    return statistics.median(times), kernels


# --- main -----------------------------------------------------------------


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TINY if args.tiny else LLAMA_31_8B
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    track = "tiny random weights (smoke run)" if args.tiny else "8B-shaped random weights"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = random_llama_model(cfg, dtype, device, attention_backend=args.backend)
    print(f"model: {track}, {dtype}, attention {model.attention.name}, on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    bandwidth = measure_bandwidth(device, (1 << 31) if device.type == "cuda" else (64 << 20))
    flops_rate = measure_matmul(device, dtype, 8192 if device.type == "cuda" else 512)
    wbytes = weight_bytes(model)
    kv_token = model.kv_bytes_per_token()
    print(f"bandwidth {bandwidth / 1e9:.0f} GB/s, matmul {flops_rate / 1e12:.1f} TFLOP/s, "
          f"weights {wbytes / 1e6:.1f} MB, KV {kv_token / 1024:.1f} KiB/token, prefix {args.prefix}", flush=True)

    blocks_per_seq = -(-(args.prefix + max(args.nodes + [1])) // args.block_size)
    kv = model.new_kv_cache(max(args.batches) * blocks_per_seq + 1, args.block_size)
    # One per cap, made once (each makes a stream and compiles its kernel); 0 and the CPU: none.
    prefetches = {mb: WeightPrefetch(device, mb << 20) for mb in set(args.l2_prefetch_mb)
                  if mb and device.type == "cuda"}
    header = (f"{'batch':>5} {'nodes':>5} {'tokens':>6} {'L2 MiB':>6} {'plan ms':>8} {'eager ms':>9} {'graph ms':>9} "
              f"{'mem floor':>9} {'roofline':>9} {'best/roof':>9}")
    print(header)
    rows = []
    for batch in args.batches:
        seq_ids = [f"s{i}" for i in range(batch)]
        for sid in seq_ids:
            kv.create(sid)
            kv.reserve(sid, args.prefix + max(args.nodes + [1]))
            # Pretend the prefix is written: its content does not change the cost.
            kv.seqs[sid].length = args.prefix
        for nodes, prefetch_mb in itertools.product([1] + args.nodes, args.l2_prefetch_mb):
            model.weight_prefetch = prefetches.get(prefetch_mb)
            step = make_step(kv, seq_ids, nodes, args.topk, cfg.vocab_size, device)
            timing = time_step(model, kv, step, args)
            read = wbytes + batch * args.prefix * kv_token
            mem_floor = read / bandwidth * 1e3
            roofline = max(mem_floor, step_flops(model, step, args.prefix) / flops_rate * 1e3)
            best = timing["graph_ms"] or timing["eager_ms"]
            row = {"batch": batch, "nodes": nodes, "tokens": batch * nodes, "l2_prefetch_mb": prefetch_mb, **timing,
                   "bytes_read": read, "mem_floor_ms": mem_floor, "roofline_ms": roofline,
                   "step": "decode" if nodes == 1 else "verify"}
            rows.append(row)
            graph = f"{timing['graph_ms']:9.3f}" if timing["graph_ms"] is not None else f"{'-':>9}"
            print(f"{batch:>5} {nodes:>5} {batch * nodes:>6} {prefetch_mb:>6} {timing['plan_ms']:8.3f} "
                  f"{timing['eager_ms']:9.3f} {graph} {mem_floor:9.3f} {roofline:9.3f} {best / roofline:9.2f}",
                  flush=True)
            if timing["kernels"]:
                print_kernels(f"batch {batch} x {nodes} nodes, L2 prefetch {prefetch_mb} MiB", timing["kernels"])
        model.weight_prefetch = None
        for sid in seq_ids:
            kv.release(sid)

    result = {
        "track": track, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "attention_backend": model.attention.name,
        "config": dataclasses.asdict(cfg), "prefix": args.prefix, "block_size": args.block_size,
        "tree_topk": args.topk, "bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops_rate,
        "weight_bytes": wbytes, "kv_bytes_per_token": kv_token,
        "notes": "plan_ms: host time to pack a StepLayout into kernel metadata (once per step); "
                 "eager_ms/graph_ms: model.forward with that metadata; floors exclude the plan.",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
