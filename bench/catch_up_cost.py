"""What a request's wake-up costs the draft: the catch-up of a gap of tokens without features.

    python bench/catch_up_cost.py                 # Llama-3.1-8B-shaped EAGLE-3 head, random weights, cuda bf16
    python bench/catch_up_cost.py --tiny          # CPU smoke run of the same code

(with the package installed, `pip install -e .`, or PYTHONPATH set to the repo root).

A request that slept while `auto` decoded plainly, or whose tokens came from a plain grant, wakes with
a run of tokens the target sent no features for, then a step's token with features. The draft computes
the run in segments (draft_service.engine._segments: exact positions one forward each, a long run's
approximate head in one forward and its last EXACT_TAIL positions one by one). Each segment of at most
WIDTH positions can take the fixed-width catch-up (one CUDA graph replay) instead of an eager forward;
this times the whole catch-up both ways, alternated in one process on one model, for each (batch, gap).
With --busy-gpu another process keeps the GPU busy meanwhile, as the target's steps do in a serve (two
processes share a GPU by time slices): the eager path's dozens of launches may each wait where a replay's one
does. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.draft_step import add_head_arguments, head_device, head_from_args, sync
from draft_service.engine import DraftEngine
from draft_service.types import IngestItem

# A stand-in for the target's steps: a CUDA graph of large GEMMs (about as long as a batch-1 step of an 8B model on
# the H200, ~4-5 ms), replayed back to back until the process is killed. It says "busy" once it runs.
BUSY_GPU = """
import sys, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
def step():
    x = a
    for _ in range(40):
        x = x @ w
    return x
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    step()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    step()
print("busy", flush=True)
while True:
    g.replay()
    torch.cuda.synchronize()
"""


def start_busy_gpu() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUSY_GPU], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "busy":
        proc.kill()
        raise SystemExit("--busy-gpu: the process that keeps the GPU busy did not start")
    return proc


def time_wake_ups(engine: DraftEngine, batch: int, gap: int, prefix: int, iters: int, device: str,
                  around: tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager] | None = None
                  ) -> tuple[float, float]:
    """Median seconds of one wake-up's catch-up (`batch` requests, each `gap` tokens without features after a
    computed prefix, then one position with features), and of the prefixes' own catch-up before it: `batch`
    prompts of `prefix` tokens with features, one eager forward, as a joining prompt's. `around`: entered for
    the last iteration's prompts and wake-up (profilers)."""
    width, vocab, dtype = engine.model.cfg.feature_width, engine.model.cfg.target_vocab_size, engine.model.dtype
    times, prompts = [], []
    for it in range(iters + 2):
        last = around is not None and it == iters + 1
        ids = [f"w{batch}-{gap}-{it}-{i}" for i in range(batch)]
        prompt = [IngestItem(r, 0, tuple(torch.randint(0, vocab, (prefix + 1,)).tolist()),
                             torch.randn(prefix, width, dtype=dtype)) for r in ids]
        with around[0] if last else contextlib.nullcontext():
            sync(device)
            t0 = time.perf_counter()
            engine.ingest(prompt, catch_up=True)
            sync(device)
        prompts.append(time.perf_counter() - t0)
        engine.ingest([IngestItem(r, prefix + 1, tuple(torch.randint(0, vocab, (gap,)).tolist()), None)
                       for r in ids])
        # The step: its position's features (prefix + gap, the first after the gap) and the token after it.
        step = [IngestItem(r, prefix + gap, (engine.requests[r].tokens[-1], int(torch.randint(0, vocab, ()))),
                           torch.randn(1, width, dtype=dtype)) for r in ids]
        with around[1] if last else contextlib.nullcontext():
            sync(device)
            t0 = time.perf_counter()
            engine.ingest(step, catch_up=True)
            sync(device)
        times.append(time.perf_counter() - t0)
        engine.release(ids)
    return statistics.median(times[2:]), statistics.median(prompts[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_arguments(ap)
    ap.add_argument("--batches", default="1,4,16", help="requests waking together (default 1,4,16)")
    ap.add_argument("--gaps", default="1,4,7,8,12,16,64",
                    help="tokens without features per request (default 1,4,7,8,12,16,64)")
    ap.add_argument("--prefix", type=int, default=512, help="computed tokens per request before the gap (default 512)")
    ap.add_argument("--iters", type=int, default=10, help="wake-ups timed per (batch, gap) and side (default 10)")
    ap.add_argument("--turns", type=int, default=3, help="turns of eager then fixed-width per shape (default 3)")
    ap.add_argument("--busy-gpu", action="store_true",
                    help="another process replays GEMMs on the same GPU throughout, as a serving target does (CUDA "
                         "only)")
    ap.add_argument("--out", type=Path, help="also write JSON")
    ap.add_argument("--profile", type=Path, metavar="FILE",
                    help="instead of the table: one prompt catch-up and one wake-up of the first batch and gap "
                         "(fixed-width on a GPU), each under torch.profiler after a warm-up, their ops by device "
                         "time and by host time into FILE")
    args = ap.parse_args(argv)
    if args.busy_gpu and not head_device(args).startswith("cuda"):
        ap.error("--busy-gpu keeps a GPU busy: it needs --device cuda")
    prefix = min(args.prefix, 64) if args.tiny else args.prefix
    batches = [int(b) for b in args.batches.split(",")]
    gaps = [int(g) for g in args.gaps.split(",")]
    model, device, dtype, _, track = head_from_args(args)
    blocks = max(batches) * (prefix + max(gaps) + 32) // 16 + 64
    engines = {}
    for fixed in (False, True):
        engine = engines[fixed] = DraftEngine(model, num_blocks=blocks, block_size=16)
        engine.fixed_catch_up = engine.fixed_wake_ups = fixed
    if args.profile:
        profile_catch_ups(engines[device.startswith("cuda")], batches[0], gaps[0], prefix, device, args.profile)
        return 0
    busy = start_busy_gpu() if args.busy_gpu else None
    try:
        rows = run_shapes(engines, batches, gaps, prefix, args, device, track, dtype, busy is not None)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    if args.out:
        args.out.write_text(json.dumps({"track": track, "device": device, "dtype": str(dtype), "prefix": prefix,
                                        "busy_gpu": busy is not None, "rows": rows}, indent=2))
    return 0


def profile_catch_ups(engine: DraftEngine, batch: int, gap: int, prefix: int, device: str, path: Path) -> None:
    """Where a joining prompt's catch-up and a wake-up's go, by op: device time (kernels) and host time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profilers = (torch.profiler.profile(activities=activities), torch.profiler.profile(activities=activities))
    wake, prompt = time_wake_ups(engine, batch, gap, prefix, 1, device, around=profilers)  # 2 warm-ups, then 1
    device_key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    parts = []
    for name, prof, seconds in (("prompt catch-up", profilers[0], prompt), ("wake-up", profilers[1], wake)):
        ops = prof.key_averages()
        kernels = sum(e.count for e in ops if e.self_cpu_time_total == 0 and e.self_device_time_total > 0)
        device_ms = sum(e.self_device_time_total for e in ops) / 1000
        by_device = ops.table(sort_by=device_key, row_limit=40)
        by_host = ops.table(sort_by="self_cpu_time_total", row_limit=30)
        parts.append(f"== {name}: {batch} requests, {prefix if name.startswith('prompt') else gap} positions "
                     f"each; the profiled call: wall {1000 * seconds:.2f} ms (with the profiler's own cost), kernels "
                     f"{kernels}, device time {device_ms:.3f} ms\n\nby device time:\n{by_device}\n\n"
                     f"by host time:\n{by_host}\n")
    path.write_text("\n".join(parts))
    print(f"profile: {path}")


def run_shapes(engines: dict[bool, DraftEngine], batches: list[int], gaps: list[int], prefix: int,
               args: argparse.Namespace, device: str, track: str, dtype: torch.dtype, busy: bool) -> list[dict]:
    print(f"track: {track}; {device} {str(dtype).removeprefix('torch.')}; prefix {prefix}; a wake-up's catch-up "
          f"(the gap, then one position with features), ms: median of {args.turns} turns, each the median of "
          f"{args.iters} wake-ups; prompts: the requests' {prefix}-token prefixes caught up in one eager forward"
          f"{'; another process keeps the GPU busy' if busy else ''}", flush=True)
    # Flushed: on a fresh GPU machine Triton's first compiles take a minute before the first row.
    print(f"{'batch':>6} {'gap':>5} {'eager':>8} {'fixed':>8} {'f/e':>6} {'prompts':>8}  turns eager / fixed",
          flush=True)
    rows = []
    for batch in batches:
        for gap in gaps:
            turns: dict[bool, list[float]] = {False: [], True: []}
            prompts = []  # the prefixes' catch-up (eager on both sides)
            for _ in range(args.turns):
                for fixed, engine in engines.items():
                    wake, prompt = time_wake_ups(engine, batch, gap, prefix, args.iters, device)
                    turns[fixed].append(1000 * wake)
                    prompts.append(1000 * prompt)
            eager, fixed, prompt = (statistics.median(turns[False]), statistics.median(turns[True]),
                                    statistics.median(prompts))
            rows.append({"batch": batch, "gap": gap, "eager_ms": eager, "fixed_ms": fixed, "prompts_ms": prompt,
                         "eager_turns": turns[False], "fixed_turns": turns[True]})
            spread = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(turns[False], turns[True]))
            print(f"{batch:>6} {gap:>5} {eager:>8.2f} {fixed:>8.2f} {fixed / eager:>6.2f} {prompt:>8.2f}  {spread}",
                  flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
