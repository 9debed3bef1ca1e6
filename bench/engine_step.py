"""Wall time of a whole TargetEngine.step (host work, forward, acceptance, KV commit), graphs vs eager.

    python bench/engine_step.py --out engine_step.json     # 8B-shaped random bf16 target on a GPU
    python bench/engine_step.py --tiny                     # CPU smoke run (eager only)
    python bench/engine_step.py --tp 2 --modes graphs      # the same steps on a TP=2 engine (2 GPUs)

bench/step_cost.py times the model's forward alone; this times what the target
service does per Step call minus gRPC: build the layout, pack the attention
metadata, run the forward (a replayed CUDA graph, or eager), move the argmax and
log-probs to the host, walk acceptance, write the accepted KV. Every request has
a committed prefix (default 1024 tokens); decode steps are one node, verify
steps a tree of N nodes (a chain of N/2 with a sibling per level). A benchmark,
not a test; figures are from the "8B-shaped random weights" track.

With --tp N > 1 the engine is the served target's own tensor-parallel one
(target_service.parallel.ParallelEngine: rank 0 in this process, ranks 1..N-1
spawned, NCCL on CUDA, gloo on CPU), built from a config.json of the same shape
and the same random weights, and each time is rank 0's whole step as the server
sees it, including sending the step's command to the other ranks. Its graphs are
those `tandem target` captures (node buckets up to 64, batch up to the largest
--batches); the buckets timed are the same as at TP=1. The graph replays alone
("replay" rows) are not timed at N > 1: a replay on rank 0 alone would wait on
all-reduces the other ranks never join.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.call_clock import CallClock  # noqa: E402
from bench.served_pause import wait_as_served  # noqa: E402
from kernels.l2_prefetch import WeightPrefetch  # noqa: E402
from target_service.cuda_graphs import GraphConfig  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from target_service.parallel import EngineSpec, ParallelEngine  # noqa: E402
from target_service.random_model import LLAMA_31_8B, RandomInit, random_llama_model  # noqa: E402
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


def parallel_engine(cfg, args, device: str, blocks: int, graph_max_batch: int | None,
                    model_dir: Path) -> ParallelEngine:
    """A TP=args.tp engine of `cfg` with the random weights random_llama_model draws at TP=1
    (every rank draws each tensor whole from its own seed, then takes its slice)."""
    from bench.scale_track import hf_config  # the scale track's config.json, whose weights are drawn

    raw = dict(hf_config(cfg, max_position=cfg.max_position), tandem_random_init=dataclasses.asdict(RandomInit()))
    (model_dir / "config.json").write_text(json.dumps(raw))
    spec = EngineSpec(model_dir=str(model_dir), dtype="bfloat16" if device == "cuda" else "float32", device=device,
                      num_blocks=blocks, block_size=16, max_model_len=4096, random_weights=True,
                      cuda_graphs=graph_max_batch is not None, graph_max_batch=graph_max_batch or 1,
                      batch_invariant=args.deterministic)
    t0 = time.perf_counter()
    engine = ParallelEngine(spec, tp_size=args.tp)
    captured = engine.engine.graphs
    print(f"TP={args.tp} engine built in {time.perf_counter() - t0:.1f} s"
          + (f" ({len(captured.keys)} graphs captured on each rank)" if captured is not None else ""), flush=True)
    return engine


def prefill(engine: TargetEngine, batch: int, prefix: int) -> list[str]:
    ids = [f"b{batch}-{i}" for i in range(batch)]
    g = torch.Generator().manual_seed(batch)
    for rid in ids:  # one eager chunk per request
        tokens = torch.randint(0, engine.model.cfg.vocab_size, (prefix,), generator=g).tolist()
        engine.step([SequenceStep.chain(rid, tokens, create=True)])
    return ids


def time_steps(engine: TargetEngine, ids: list[str], nodes: int, iters: int, device: str,
               features: bool = False, pause_s: float = 0.0) -> float:
    """ms per step (median). features: every item asks for the target's features (the model's default
    layers), and the committed rows are copied to the host as the served target does before a
    step's reply (target_service.feature_sinks.split_features): a step that feeds a draft. pause_s:
    each step after that long a wait (bench/served_pause.py)."""
    from target_service.engine import batch_of_items
    from target_service.feature_sinks import split_features

    last = {rid: 1 for rid in ids}
    times = []
    for _ in range(iters + 3):
        items = [SequenceStep(rid, *tree(last[rid], nodes), 1, return_features=features) for rid in ids]
        wait_as_served(pause_s, device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if features:
            batch = batch_of_items(items)
            results, _ = split_features(engine.run(batch))
            out = results.sequence_results()
        else:
            out = engine.step(items)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        last = {r.request_id: r.tokens[-1] for r in out}
    return 1000 * statistics.median(times[3:])


def time_join(engine: TargetEngine, ids: list[str], prompt: int, iters: int, device: str) -> float:
    """ms per step (median) of the batch's decode steps with a new request's whole prompt of `prompt`
    tokens beside them, its features asked (a prompt that feeds a draft), as a request joins a batch."""
    g = torch.Generator().manual_seed(prompt)
    last = {rid: 1 for rid in ids}
    times = []
    for i in range(iters + 3):
        tokens = torch.randint(0, engine.model.cfg.vocab_size, (prompt,), generator=g).tolist()
        joining = f"join-{i}"
        items = [SequenceStep.chain(rid, [last[rid]]) for rid in ids[:-1]]
        items.append(SequenceStep.chain(joining, tokens, create=True, return_features=True))
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.step(items)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        last.update({r.request_id: r.tokens[-1] for r in out})
        engine.release([joining])
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


class HostPhases:
    """--phases: wall time of each part of a TargetEngine step, by wrapping the parts of this
    engine (and the graph and stream calls they make). Parts nest: `run` holds `validate`,
    `execute`; `execute` holds `pack`, `load_inputs`, `replay`, `read_results`; `read_results`
    holds `gpu_wait` (the one synchronize: the GPU's time not hidden behind host work). What a
    part holds beyond its listed children is its own host work."""

    def __init__(self, engine: TargetEngine):
        import target_service.cuda_graphs as cuda_graphs
        import target_service.engine as engine_module
        from target_service.step_batch import StepResults

        self.clock = CallClock()
        self.seconds = self.clock.seconds
        for owner, name, label in ((engine_module, "batch_of_items", "batch_of_items"), (engine, "run", "run"),
                                   (engine, "_validate", "validate"), (engine, "_execute", "execute"),
                                   (engine, "pack", "pack"), (cuda_graphs.BucketGraph, "load_inputs", "load_inputs"),
                                   (cuda_graphs.BucketGraph, "replay", "replay"),
                                   (engine, "_read_results", "read_results"),
                                   (torch.cuda.Stream, "synchronize", "gpu_wait"),
                                   (StepResults, "sequence_results", "sequence_results")):
            self.clock.wrap(owner, name, label)

    def measure(self, engine: TargetEngine, ids: list[str], nodes: int, iters: int, device: str,
                features: bool = False) -> dict[str, float]:
        """Microseconds per step of each part, over `iters` + 3 steps (after 4 untimed ones);
        features: as time_steps takes it."""
        time_steps(engine, ids, nodes, 1, device, features)  # warm-up
        self.seconds.clear()
        t0 = time.perf_counter()
        time_steps(engine, ids, nodes, iters, device, features)
        steps = iters + 3
        total = time.perf_counter() - t0
        parts = {label: round(1e6 * s / steps, 1) for label, s in self.seconds.items()}
        parts["whole"] = round(1e6 * total / steps, 1)
        return parts

    def close(self) -> None:
        self.clock.restore()


def run_mode(engine: TargetEngine | ParallelEngine, mode: str, batches: list[int], nodes: list[int], args,
             device: str, rows: list[dict]) -> None:
    for b in batches:
        ids = prefill(engine, b, args.prefix)
        for n in nodes:
            for pause in args.pause_ms:
                after = f" after {pause:g} ms waits" if pause else ""
                ms = time_steps(engine, ids, n, args.iters, device, pause_s=pause / 1e3)
                rows.append({"mode": mode, "batch": b, "nodes": n, "ms": ms, "pause_ms": pause})
                print(f"{mode:>6} batch {b:>4} nodes {n:>3}: {ms:8.2f} ms per step{after}", flush=True)
                if args.features:
                    ms = time_steps(engine, ids, n, args.iters, device, features=True, pause_s=pause / 1e3)
                    rows.append({"mode": mode, "batch": b, "nodes": n, "features": True, "ms": ms, "pause_ms": pause})
                    print(f"{mode:>6} batch {b:>4} nodes {n:>3}: {ms:8.2f} ms per step with features{after}",
                          flush=True)
            # Right after steps of this shape: the shared input buffer holds this bucket's layout.
            replay = time_replays(engine, b, n, args.iters) if mode == "graphs" and args.tp == 1 else None
            if replay is not None:
                rows.append({"mode": "replay", "batch": b, "nodes": n, **replay})
                print(f"replay batch {b:>4} nodes {n:>3}: forward {replay['forward']:.2f} ms, "
                      f"forward+tail {replay['forward+tail']:.2f} ms", flush=True)
        for prompt in args.prompt_tokens if args.tp == 1 else ():
            # The batch's last request sits out: b - 1 decode items and a joining prompt make b sequences.
            # The same engine with prompt chunks kept out of the graphs, and with ragged buckets as
            # `tandem target --graph-ragged-rows` serves (its buffers were sized for them); "ms" is the default.
            chains_eager = ragged = None
            cfg = engine.graphs.cfg if engine.graphs is not None else None
            if cfg is not None:
                default = dataclasses.replace(cfg, ragged_rows=0)
                engine.graphs.cfg = dataclasses.replace(default, max_chain_rows=0)
                chains_eager = time_join(engine, ids, prompt, args.iters, device)
                if cfg.ragged_rows:
                    engine.graphs.cfg = cfg
                    ragged = time_join(engine, ids, prompt, args.iters, device)
                engine.graphs.cfg = default
            ms = time_join(engine, ids, prompt, args.iters, device)
            if cfg is not None:
                engine.graphs.cfg = cfg
            row = {"mode": mode, "batch": b, "prompt": prompt, "ms": ms}
            note = ""
            if chains_eager is not None:
                row["chains_eager_ms"] = chains_eager
                note = f" (prompt chunks kept out of the graphs: {chains_eager:.2f} ms"
                if ragged is not None:
                    row["ragged_ms"] = ragged
                    note += f"; with ragged graphs of up to {cfg.ragged_rows} rows: {ragged:.2f} ms"
                note += ")"
            rows.append(row)
            print(f"{mode:>6} batch {b:>4} joining prompt {prompt:>3}: {ms:8.2f} ms per step{note}", flush=True)
        if args.phases and args.tp == 1:
            phases = HostPhases(engine)
            try:
                for n in nodes:
                    parts = phases.measure(engine, ids, n, max(args.iters, 8), device, args.features)
                    rows.append({"mode": f"{mode}-phases", "batch": b, "nodes": n, "features": args.features,
                                 "us": parts})
                    asked = " with features" if args.features else ""
                    print(f"phases batch {b:>4} nodes {n:>3}{asked}: "
                          + ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
                          + " us per step", flush=True)
            finally:
                phases.close()
        if args.grant:
            ms = time_grant(engine, ids, args.grant, device)
            if ms is not None:
                rows.append({"mode": mode, "batch": b, "nodes": 1, "grant": args.grant, "ms": ms})
                print(f"{mode:>6} batch {b:>4} grant {args.grant:>2}: {ms:8.2f} ms per step", flush=True)
        if args.profile and b == batches[-1]:
            profile_steps(engine, ids, nodes[-1], device, args.profile, f"{mode}, batch {b}, {nodes[-1]} nodes")
        engine.release(ids)


def profile_steps(engine: TargetEngine | ParallelEngine, ids: list[str], nodes: int, device: str, path: Path,
                  what: str) -> None:
    """Where a step's time goes, by kernel (device time) and by op (host time), over 5 steps of
    `nodes` nodes per request: torch.profiler (on CUDA it sees the kernels inside graph replays)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        time_steps(engine, ids, nodes, 2, device)  # 3 unrecorded warm-up steps + 2: 5 steps
    ops = prof.key_averages()
    device_key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    path.write_text(f"{what}, 5 steps\n\nby device time:\n{ops.table(sort_by=device_key, row_limit=40)}\n\n"
                    f"by host time:\n{ops.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
    print(f"profile: {path}", flush=True)


MATMUL_KNOBS = ("MIN_PROGRAMS", "SPLIT_K_PROGRAMS", "SPLITS_POWER_OF_TWO", "BLOCK_M", "BLOCK_N", "NUM_WARPS",
                "NUM_STAGES", "WIDE_FROM_M", "WIDE_BLOCK_M", "WIDE_BLOCK_N", "WIDE_NUM_WARPS", "WIDE_NUM_STAGES",
                "WIDE_BLOCK_K", "WIDE_TMA", "WIDE_SPLITS_IN_PROGRAM", "SUMMING_BLOCK_N", "SUMMING_NUM_STAGES",
                "SMALL_BLOCK_K")
ATTENTION_KNOBS = ("BLOCK_N", "NUM_WARPS", "NUM_STAGES", "PROGRAMS_PER_SM", "ROWS_PER_PROGRAM",
                   "TREE_ROWS_PER_PROGRAM")
# Knobs that may be 0 (off).
ZERO_OK = {"MIN_PROGRAMS", "SPLITS_POWER_OF_TWO", "WIDE_FROM_M", "TREE_ROWS_PER_PROGRAM", "WIDE_TMA",
           "WIDE_SPLITS_IN_PROGRAM"}


def set_kernel_config(module, knobs: tuple[str, ...], spec: str) -> dict[str, int]:
    """Set a kernel module's constants from "NAME=VALUE,...". Each is read at every call, so a value set
    before the engine exists holds for every call (still one rule for all rows, which is what keeps the
    kernels batch-invariant)."""
    config = {}
    for part in (part.strip() for part in spec.split(",")):
        if not part:
            continue
        name, _, value = part.partition("=")
        name = name.strip().upper()
        if name not in knobs:
            raise ValueError(f"unknown constant {name!r} (known: {', '.join(knobs)})")
        try:
            config[name] = int(value)
        except ValueError:
            raise ValueError(f"{name} needs an integer, got {value!r}") from None
        if config[name] < 0 or (name not in ZERO_OK and config[name] == 0):
            raise ValueError(f"{name} must be positive, got {config[name]}")
    for name, value in config.items():
        setattr(module, name, value)
    return config


def set_matmul_config(spec: str) -> dict[str, int]:
    """kernels.matmul's constants from "NAME=VALUE,..." or the older "MIN_PROGRAMS,SPLIT_K_PROGRAMS"."""
    import kernels.matmul as matmul
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if parts and all("=" not in part for part in parts):
        if len(parts) != 2:
            raise ValueError(f"expected MIN_PROGRAMS,SPLIT_K_PROGRAMS or NAME=VALUE pairs, got {spec!r}")
        spec = f"MIN_PROGRAMS={parts[0]},SPLIT_K_PROGRAMS={parts[1]}"
    return set_kernel_config(matmul, MATMUL_KNOBS, spec)


def set_attention_config(spec: str) -> dict[str, int]:
    """kernels.invariant_attention's constants from "NAME=VALUE,..."."""
    import kernels.invariant_attention as invariant_attention
    return set_kernel_config(invariant_attention, ATTENTION_KNOBS, spec)


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
    ap.add_argument("--matmul", metavar="NAME=VALUE,...",
                    help="with --deterministic: try another configuration of the invariant linear kernel, as "
                         "kernels.matmul constants (MIN_PROGRAMS, SPLIT_K_PROGRAMS, BLOCK_M, BLOCK_N, NUM_WARPS, "
                         "NUM_STAGES for calls of few rows; WIDE_FROM_M, WIDE_BLOCK_M, WIDE_BLOCK_N, WIDE_NUM_WARPS, "
                         "WIDE_NUM_STAGES for the rest), e.g. WIDE_BLOCK_N=128; the older form "
                         "MIN_PROGRAMS,SPLIT_K_PROGRAMS (0,1: 64-wide tiles, no split-K) still works")
    ap.add_argument("--attention", metavar="NAME=VALUE,...",
                    help="with --deterministic: try another configuration of the invariant attention, as "
                         "kernels.invariant_attention constants (BLOCK_N: keys per tile, NUM_WARPS, NUM_STAGES, "
                         "PROGRAMS_PER_SM, ROWS_PER_PROGRAM, TREE_ROWS_PER_PROGRAM)")
    ap.add_argument("--attention-rows", type=int, metavar="R",
                    help="with --deterministic: step rows of one sequence per program of the invariant attention "
                         "for every call (kernels.invariant_attention.ROWS_PER_PROGRAM, TREE_ROWS_PER_PROGRAM off; "
                         "1: one row per program)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel degree: N > 1 times rank 0's whole steps on the served target's "
                         "ParallelEngine over N GPUs (N processes, gloo on CPU with --tiny); graph replays alone "
                         "are not timed there (default 1: a TargetEngine in this process)")
    ap.add_argument("--profile", type=Path, metavar="FILE",
                    help="also profile 5 steps of the last batch and tree size of each mode (torch.profiler) and "
                         "write the tables (kernels by device time, ops by host time) to FILE")
    ap.add_argument("--phases", action="store_true",
                    help="also time each part of a step (validate, pack, graph replay, the wait for the GPU, "
                         "results...) in microseconds per step, TP=1 only")
    ap.add_argument("--features", action="store_true",
                    help="also time each step with every item asking for features (the model's default layers), "
                         "the committed rows copied to the host as the served target does: a step that feeds a draft")
    ap.add_argument("--feature-pick-bytes", type=int, default=None, metavar="BYTES",
                    help="with --features: a verify step whose rows' features take at most BYTES sends every row "
                         "to the host and keeps the committed ones there; larger ones compact them on the device "
                         "first (tandem target --feature-pick-kib in bytes; default the engine's, "
                         "target_service.engine.FEATURE_PICK_BYTES; 0: always on the device). TP=1 only")
    ap.add_argument("--prompt-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    metavar="N,...", help="also time a step in which a new request's prompt of N tokens joins "
                    "b - 1 decoding ones, with its features asked; with graphs, also with prompt chunks kept out "
                    "of them (GraphConfig.max_chain_rows = 0)")
    ap.add_argument("--ragged-rows", type=int, default=0, metavar="ROWS",
                    help="with --prompt-tokens and graphs, also time the joining prompt with ragged graphs of up "
                    "to ROWS rows (GraphConfig.ragged_rows, as tandem target --graph-ragged-rows serves), "
                    "captured in the warm-up steps")
    ap.add_argument("--l2-prefetch-mb", type=int, default=0, metavar="MIB",
                    help="ask L2 for up to MIB MiB of each GEMM's weight ahead of it (kernels.l2_prefetch, as "
                    "tandem target --l2-prefetch-mb serves; default 0: off; TP=1 on CUDA only)")
    ap.add_argument("--pause-ms", type=lambda v: [float(x) for x in v.split(",")], default=[0.0], metavar="MS,...",
                    help="wait this long before each timed step, the host asleep and the GPU busy, as a served step "
                         "comes after the draft's call and the gateway's hops (bench/served_pause.py); several "
                         "(0,2,0,2): each shape timed after each, in turn (default 0: back to back)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.l2_prefetch_mb < 0:
        ap.error("--l2-prefetch-mb must be >= 0")
    if args.feature_pick_bytes is not None:
        if args.feature_pick_bytes < 0 or args.tp > 1:
            ap.error("--feature-pick-bytes must be >= 0, and is timed at TP=1")
    if args.l2_prefetch_mb and (args.tp > 1 or args.tiny):
        ap.error("--l2-prefetch-mb is timed at TP=1 on CUDA")
    if args.tp > 1 and (args.matmul or args.attention or args.attention_rows is not None):
        ap.error("--matmul, --attention and --attention-rows set module globals in this process only, not on the "
                 "other ranks")
    try:
        if args.matmul:
            set_matmul_config(args.matmul)
        if args.attention:
            set_attention_config(args.attention)
    except ValueError as exc:
        ap.error(str(exc))
    if args.attention_rows is not None:
        # Read by every plan and call: set before the engine (and its graphs) exist.
        import kernels.invariant_attention as invariant_attention
        invariant_attention.ROWS_PER_PROGRAM = args.attention_rows
        invariant_attention.TREE_ROWS_PER_PROGRAM = 0  # R for every call
    device = "cpu" if args.tiny else "cuda"
    cfg = LLAMA_31_8B
    if args.tiny:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16)
        args.batches, args.nodes, args.prefix, args.iters = "1,4", "1,4", 32, 2
        args.grant = args.grant and 4
    batches = [int(b) for b in args.batches.split(",")]
    nodes = [int(n) for n in args.nodes.split(",")]
    model = None
    if args.tp == 1:  # at TP > 1 every rank draws its own share
        model = random_llama_model(cfg, torch.bfloat16 if device == "cuda" else torch.float32, device,
                                   batch_invariant=args.deterministic)
        if args.l2_prefetch_mb:
            model.weight_prefetch = WeightPrefetch(model.device, args.l2_prefetch_mb << 20)
    # + the joining-prompt steps' decode items (a token a step, in up to three timings a prompt length: chunks
    # kept out, ragged graphs, the default; two only made 64 x 96 run out on an H100), and room for one joining
    # prompt
    join_tokens = len(args.prompt_tokens) * 3 * (args.iters + 3)
    blocks = (max(batches) * (args.prefix + len(nodes) * max(nodes) * (args.iters + 4)) // 16 + 64
              + (max(batches) * (-(-join_tokens // 16) + 1) + max(args.prompt_tokens) // 16 + 1
                 if args.prompt_tokens else 0))
    wanted = ["eager"] if args.tiny else args.modes.split(",")
    # Node buckets up to the longest joining prompt too (the served target's go up to 64).
    modes = {mode: GraphConfig(max_batch=max(batches), max_nodes=max(nodes + args.prompt_tokens),
                               ragged_rows=args.ragged_rows) if mode == "graphs" else None
             for mode in wanted}
    rows = []
    if args.tp > 1 and "graphs" in modes:
        print(f"TP={args.tp}: graph replays alone (\"replay\" rows) are not timed; rank 0 cannot replay "
              "them without the other ranks", flush=True)
    for mode, graphs in modes.items():
        if args.tp > 1:
            with tempfile.TemporaryDirectory(prefix="engine-step-tp") as model_dir:
                engine = parallel_engine(cfg, args, device, blocks, graphs.max_batch if graphs else None,
                                         Path(model_dir))
            try:
                run_mode(engine, mode, batches, nodes, args, device, rows)
            finally:
                engine.shutdown()
        else:
            pick = {} if args.feature_pick_bytes is None else {"feature_pick_bytes": args.feature_pick_bytes}
            engine = TargetEngine(model, num_blocks=blocks, block_size=16, max_model_len=4096, graphs=graphs, **pick)
            if engine.graphs is not None:
                print(f"captured {len(engine.graphs.keys)} graphs in {engine.graphs.capture_all():.1f} s",
                      flush=True)
            run_mode(engine, mode, batches, nodes, args, device, rows)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"track": "8B-shaped random weights" if not args.tiny else "tiny",
                                        "prefix": args.prefix, "tp": args.tp, "deterministic": args.deterministic,
                                        "attention_rows": args.attention_rows, "matmul": args.matmul,
                                        "attention": args.attention, "rows": rows},
                                       indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
