"""What delivering one step's command to another rank costs: two gloo broadcasts (the TP
path before) against one message on a pipe (the path now), each followed by an
acknowledgement on a pipe, between two processes of this machine.

    python bench/tp_control.py [--iters 500] [--bytes 600]

Prints the median microseconds per command, acknowledgement included. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _other(rendezvous: str, iters: int, commands, acks) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=1, world_size=2)
    for _ in range(iters):
        sizes = torch.zeros(2, dtype=torch.long)
        dist.broadcast(sizes, 0)
        payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        dist.broadcast(payload, 0)
        acks.send_bytes(b"k")
    for _ in range(iters):
        commands.recv_bytes()
        acks.send_bytes(b"k")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--bytes", type=int, default=600, help="a step's packed columns (600 B: a few sequences)")
    args = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rendezvous = str(Path(tempfile.mkdtemp(prefix="tandem-tpc-")) / "rendezvous")
    ctx = mp.get_context("spawn")
    cmd_theirs, cmd_ours = ctx.Pipe(duplex=False)
    ack_ours, ack_theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_other, args=(rendezvous, args.iters, cmd_theirs, ack_theirs))
    proc.start()
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=2)
    header, payload = b"{}", bytes(args.bytes)
    gloo = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        dist.broadcast(torch.tensor([len(header), len(payload)]), 0)
        dist.broadcast(torch.frombuffer(bytearray(header + payload), dtype=torch.uint8), 0)
        ack_ours.recv_bytes()
        gloo.append(time.perf_counter() - t0)
    pipe = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        cmd_ours.send_bytes(header + payload)
        ack_ours.recv_bytes()
        pipe.append(time.perf_counter() - t0)
    proc.join()
    dist.destroy_process_group()
    print(f"two gloo broadcasts: {1e6 * statistics.median(gloo):8.1f} us per command (acknowledged)")
    print(f"one pipe message:    {1e6 * statistics.median(pipe):8.1f} us per command (acknowledged)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
