"""What a verify step costs the gateway beyond the target's own step, over the real stream.

    python bench/verify_call.py [--device cpu] [--calls 200] [--out verify_call.json]

Starts a target service on the demo pair's target with metrics on (as `tandem serve` runs it),
subscribes to its pushed features as a draft replica does (draft_service.target_features), and
from the gateway's side (gateway.clients.TargetClient) sends verify steps of one request with
an 8-node tree, its features held and pushed to the subscriber, as `always` does at one request,
with --think-ms between calls where the gateway would update and call the draft.
Per call: the round trip the gateway waits for (its execute phase) and the engine's own step
time the reply carries; the difference is the call's path outside the engine (packing and
parsing on both sides, the features split off and pushed, metrics, gRPC). Median milliseconds.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.engine_step import tree  # noqa: E402  (a chain of nodes/2 with a sibling per level)
from draft_service.target_features import TargetFeatureReader  # noqa: E402
from gateway.clients import TargetClient  # noqa: E402
from target_service.types import SequenceStep  # noqa: E402
from tests.services import Service  # noqa: E402

DEMO = REPO / "demo"


def subscribe(address: str) -> int:
    """The pushed features' reader (--subscribe ADDRESS): prints its sink name once live, then
    takes rows until terminated, and then whether it was still live."""
    reader = TargetFeatureReader(address)
    deadline = time.monotonic() + 30
    while not reader.live and time.monotonic() < deadline:
        time.sleep(0.01)
    print(reader.sink, flush=True)

    def stop(*_) -> None:
        print("live" if reader.live else "not live", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--subscribe"]:
        return subscribe(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--features", choices=("push", "hold", "none"), default="push",
                    help="the tree's features pushed to a subscriber (as `always` runs), held at the target for a "
                         "pull, or not asked for")
    ap.add_argument("--think-ms", type=float, default=5.0,
                    help="the gateway's time between two verify calls (its update and the draft call: about 5 ms "
                         "at one request on the H200 scale track); the target's work after a reply overlaps it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tmp = Path(f"/tmp/tandem-verify-call-{time.time_ns()}")
    tmp.mkdir(parents=True)
    svc = Service(["target", "--model", str(DEMO / "target"), "--device", args.device, "--metrics-port", "0"],
                  tmp, "target")
    try:
        svc.wait_serving()
        client = TargetClient(svc.address)
        # The subscriber lives in a process of its own, as in a draft service: in this one it would
        # take the GIL from the client as the features arrive, just when the reply does.
        reader = subprocess.Popen([sys.executable, __file__, "--subscribe", svc.address], stdout=subprocess.PIPE,
                                  text=True, cwd=REPO) if args.features == "push" else None
        sink = reader.stdout.readline().strip() if reader is not None else ""
        layers = client.info().default_feature_layers
        rid, last = "verify-0", 1
        client.step([SequenceStep.chain(rid, list(range(10, 60)), create=True)], layers)
        round_trips, engine = [], []
        for i in range(args.calls + 10):
            tokens, parents = tree(last, args.nodes)
            step = SequenceStep(rid, tokens, parents, 1, return_features=args.features != "none")
            t0 = time.perf_counter()
            results, _, seconds = client.step([step], layers, hold_features=args.features != "none",
                                              feature_sinks=[sink] if sink else None)
            if i >= 10:
                round_trips.append(time.perf_counter() - t0)
                engine.append(seconds)
            last = results[0].tokens[-1]
            time.sleep(args.think_ms / 1000)
            if results[0].num_committed > 3000:  # stay below the model's length: start a new sequence
                client.release([rid])
                rid = f"verify-{i}"
                client.step([SequenceStep.chain(rid, list(range(10, 60)), create=True)], layers)
        client.close()
        pushed = None
        if reader is not None:
            reader.terminate()
            pushed = reader.communicate(timeout=10)[0].strip()
    finally:
        svc.stop()
    trip, own = 1000 * statistics.median(round_trips), 1000 * statistics.median(engine)
    outside = 1000 * statistics.median(t - e for t, e in zip(round_trips, engine, strict=True))
    print(f"{args.nodes}-node verify at one request, features {args.features}, {args.calls} calls: round trip "
          f"{trip:.3f} ms, engine step {own:.3f} ms, outside the engine {outside:.3f} ms"
          + (f" (subscriber: {pushed})" if pushed else ""), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "calls": args.calls, "nodes": args.nodes,
                                        "features": args.features, "think_ms": args.think_ms,
                                        "round_trip_ms": trip, "engine_ms": own, "outside_ms": outside}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
