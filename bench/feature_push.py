"""What a step's pushed features cost on their way from the target to a draft on the same host.

    python bench/feature_push.py [--batches 1,8,64] [--rows 4] [--width 12288] [--out FILE]

Starts the target's gRPC servicer alone (SubscribeFeatures needs no model) and, per batch size, times
from the push of one step's rows (as TargetServicer._after_reply pushes them) until the draft side
holds every row, three ways:
  messages  one FeatureRows per sequence (a subscriber that does not ask for batches: the old path)
  batched   one FeatureRows per step, the rows in the message (TargetFeatureReader, no ring)
  ring      one FeatureRows per step, the rows in a shared-memory ring (TargetFeatureReader's default)
Defaults: 4 rows per sequence (a round that accepts 3 tokens), 12288 values a row (Llama-3.1-8B's three
feature layers), bf16. Median ms per step. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from draft_service.target_features import DEFAULT_RING_BYTES, TargetFeatureReader  # noqa: E402
from tandem.feature_store import FeatureStore  # noqa: E402
from tandem.tensors import tensor_from_proto  # noqa: E402
from tandem.v1 import target_pb2, target_pb2_grpc  # noqa: E402
from target_service.feature_sinks import CommittedRows  # noqa: E402
from target_service.server import TargetServicer  # noqa: E402


class PerSequenceSubscriber:
    """A subscriber that takes one message per sequence, as drafts did before batches."""

    def __init__(self, address: str):
        self.sink = "per-sequence"
        self.pushed = FeatureStore(1 << 20)
        self.live = False
        self._channel = grpc.insecure_channel(address)
        self._call = target_pb2_grpc.TargetServiceStub(self._channel).SubscribeFeatures(
            target_pb2.SubscribeFeaturesRequest(sink=self.sink))
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for msg in self._call:
                if msg.request_id:
                    self.pushed.hold(msg.request_id, msg.start_position, tensor_from_proto(msg.features))
                else:
                    self.live = True
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def time_pushes(servicer: TargetServicer, subscriber, batch: int, rows: int, width: int, steps: int) -> float:
    while not subscriber.live:
        time.sleep(0.01)
    features = torch.randn(batch * rows, width).to(torch.bfloat16)  # one step's rows, as split_features leaves them
    times = []
    for step in range(steps):
        pushed = [CommittedRows(f"r{b}", step * rows, features[b * rows: (b + 1) * rows]) for b in range(batch)]
        t0 = time.perf_counter()
        if not servicer.feature_sinks.push(subscriber.sink, pushed):
            raise SystemExit("the subscription went away")
        for b in range(batch):
            if not subscriber.pushed.wait_for(f"r{b}", (step + 1) * rows, 10.0):
                raise SystemExit(f"step {step}: rows of r{b} never arrived")
        times.append(time.perf_counter() - t0)
        for b in range(batch):
            subscriber.pushed.read(f"r{b}", step * rows, (step + 1) * rows)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64", help="sequences per step (default 1,8,64)")
    ap.add_argument("--rows", type=int, default=4, help="rows per sequence per step (default 4)")
    ap.add_argument("--width", type=int, default=12288, help="values per row (default 12288)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, help="also write JSON")
    args = ap.parse_args(argv)
    servicer = TargetServicer(REPO)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    ways = {"messages": lambda: PerSequenceSubscriber(address),
            "batched": lambda: TargetFeatureReader(address, ring_bytes=0),
            "ring": lambda: TargetFeatureReader(address, ring_bytes=DEFAULT_RING_BYTES)}
    print(f"{args.rows} rows of {args.width} bf16 values per sequence per step; median ms per step")
    print(f"{'batch':>6} {'MB':>6} " + " ".join(f"{way:>9}" for way in ways))
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = {"batch": batch, "mb": batch * args.rows * args.width * 2 / 1e6}
        for way, make in ways.items():
            subscriber = make()
            try:
                row[way] = 1000 * time_pushes(servicer, subscriber, batch, args.rows, args.width, args.steps)
                if way == "ring" and subscriber.ring is None:
                    raise SystemExit("the target did not attach the ring")
            finally:
                subscriber.close()
        results.append(row)
        print(f"{batch:>6} {row['mb']:>6.1f} " + " ".join(f"{row[way]:>9.2f}" for way in ways))
    server.stop(0)
    if args.out:
        args.out.write_text(json.dumps({"rows": args.rows, "width": args.width, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
