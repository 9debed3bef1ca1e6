"""What one all-reduce of a decode step's activations costs at TP>1: NCCL against torch's
symmetric-memory one-shot and two-shot all-reduces (peer loads over NVLink, no multicast).

    python bench/allreduce_cost.py [--world 2] [--rows 1,8,64,128] [--hidden 4096] [--out F.json]

Spawns --world processes, one per GPU. For each row count, each method is timed
two ways, as the target runs it: eagerly, and replayed from a CUDA graph that
holds 64 back-to-back all-reduces (a Llama-8B step has two per layer, 64 in
all), each followed by a tiny add so that the reductions are not back to back
with nothing between them. Prints microseconds per all-reduce (median of
--iters replays) and checks that every method's sum equals NCCL's. A method
this torch or this machine lacks is reported as unavailable, not failed.
A benchmark, not a test: GPUs only (`bash bench/h200_hot_path.sh allreduce`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PER_STEP = 64  # all-reduces in one Llama-8B decode step (two per layer)


def _methods(group_name: str, numel: int, dtype: torch.dtype, device: torch.device):
    """name -> (prepare, all_reduce(x) -> the sum), for the methods this torch offers."""
    out = {"nccl": lambda x: (dist.all_reduce(x), x)[1]}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group_name)
    except Exception as exc:  # an older torch, or no peer access between these GPUs
        print(f"symmetric memory unavailable: {exc}", flush=True)
        return out

    def one_shot(x: torch.Tensor) -> torch.Tensor:
        flat = buf[: x.numel()]
        flat.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(flat, "sum", group_name, x.view(-1))
        return x

    def two_shot(x: torch.Tensor) -> torch.Tensor:
        flat = buf[: x.numel()]
        flat.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(flat, "sum", group_name)
        x.view(-1).copy_(flat)
        return x

    out["symm_one_shot"] = one_shot
    out["symm_two_shot"] = two_shot
    return out


def _time(fn, iters: int) -> float:
    """Median milliseconds of fn()."""
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def _rank(rank: int, world: int, rendezvous: str, args: argparse.Namespace, results: dict) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            device_id=device)
    group_name = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    rows_list = [int(r) for r in args.rows.split(",")]
    methods = _methods(group_name, max(rows_list) * args.hidden, dtype, device)
    found = []
    for rows in rows_list:
        x0 = torch.randn(rows, args.hidden, dtype=dtype, device=device, generator=torch.Generator(device).manual_seed(
            rank))
        expected = x0.clone()
        dist.all_reduce(expected)
        for name, reduce in methods.items():
            row = {"rows": rows, "method": name}
            try:
                x = x0.clone()
                got = reduce(x)
                torch.cuda.synchronize()
                # bf16 sums of `world` terms: the methods may add in different orders.
                row["max_abs_diff_vs_nccl"] = float((got.float() - expected.float()).abs().max())
                x = x0.clone()
                row["eager_us"] = 1000 * _time(lambda reduce=reduce, x=x: reduce(x), args.iters)
                graph = torch.cuda.CUDAGraph()
                x = x0.clone()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up outside the capture
                        reduce(x).mul_(0.5)
                    with torch.cuda.graph(graph, stream=stream):
                        for _ in range(PER_STEP):
                            reduce(x).mul_(0.5)
                torch.cuda.current_stream().wait_stream(stream)
                row["graph_us"] = 1000 * _time(graph.replay, args.iters) / PER_STEP
            except Exception as exc:  # e.g. an op that cannot be captured
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            found.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            dist.barrier()
    if rank == 0:
        results["rows"] = found
        results["world"] = world
        results["gpu"] = torch.cuda.get_device_name(device)
        results["torch"] = torch.__version__
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", default="1,8,64,128", help="rows of activations (batch x nodes) per all-reduce")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"error: {args.world} GPUs needed, {torch.cuda.device_count()} visible")
    rendezvous = str(Path(tempfile.mkdtemp(prefix="tandem-ar-")) / "rendezvous")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args.world, rendezvous, args, results), nprocs=args.world, join=True)
        found = dict(results)
    print(f"{'rows':>5} {'method':>14} {'eager us':>9} {'graph us':>9}")
    for row in found.get("rows", []):
        eager, graph = row.get("eager_us"), row.get("graph_us")
        print(f"{row['rows']:>5} {row['method']:>14} "
              f"{eager if eager is None else f'{eager:9.1f}'} {graph if graph is None else f'{graph:9.1f}'}"
              + (f"  {row['error']}" if "error" in row else ""))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
