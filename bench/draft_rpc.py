"""What a Draft call costs the gateway on the wire: unary calls against DraftStream with packed trees.

    python bench/draft_rpc.py [--device cpu] [--calls 200] [--out draft_rpc.json]

Starts a draft service on the demo pair, ingests one request per batch slot, then
times from the gateway's side (gateway.clients) a call with an empty budget (the
RPC alone, no tree grown) and a call with the 5/4/8 tree, as unary Draft calls
with one DraftTree message per tree (the old path) and as messages on one
DraftStream with packed trees (DraftClient.draft). Median milliseconds per call.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from draft_service.types import DraftBudget, IngestItem  # noqa: E402
from gateway.clients import DraftClient  # noqa: E402
from tandem.v1 import draft_pb2  # noqa: E402
from tests.services import Service  # noqa: E402

DEMO = REPO / "demo"


def unary(client: DraftClient, calls: list[tuple[str, DraftBudget, int]]) -> list:
    req = draft_pb2.DraftRequest()
    for rid, b, n in calls:
        req.items.add(request_id=rid, num_tokens=n).budget.CopyFrom(
            draft_pb2.DraftBudget(steps=b.steps, topk=b.topk, num_draft_tokens=b.num_draft_tokens))
    reply = client.stub.Draft(req, timeout=30)
    return [(list(t.tokens), list(t.parents), list(t.depths), list(t.logprobs), list(t.scores)) for t in reply.trees]


def median_ms(fn, n: int, think_s: float = 0.0) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        time.sleep(think_s)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--metrics", action="store_true", help="the draft service records its metrics (--metrics-port), "
                    "as `tandem serve` runs it")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="pause between calls, where the gateway would run the target's step (default 0: back to back)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tmp = Path(f"/tmp/tandem-draft-rpc-{time.time_ns()}")
    tmp.mkdir(parents=True)
    svc = Service(["draft", "--model", str(DEMO / "draft"), "--target-model", str(DEMO / "target"), "--device",
                   args.device, *(["--metrics-port", "0"] if args.metrics else [])], tmp, "draft")
    rows = []
    try:
        svc.wait_serving()
        client = DraftClient(svc.address)
        prompt = tuple(range(10, 60))
        for batch in (int(b) for b in args.batches.split(",")):
            ids = [f"b{batch}-{i}" for i in range(batch)]
            client.ingest([IngestItem(rid, 0, prompt) for rid in ids], catch_up=True)
            for name, budget in (("empty", DraftBudget(0, 0, 0)), ("5/4/8", DraftBudget(5, 4, 8))):
                calls = [(rid, budget, len(prompt)) for rid in ids]
                for path, fn in (("unary", lambda calls=calls: unary(client, calls)),
                                 ("stream+packed", lambda calls=calls: client.draft([], calls))):
                    ms = median_ms(fn, args.calls, args.think_ms / 1000)
                    rows.append({"batch": batch, "budget": name, "path": path, "ms": ms})
                    print(f"batch {batch:>3} budget {name:>5} {path:>14}: {ms:7.3f} ms per call", flush=True)
            client.release(ids)
        client.close()
    finally:
        svc.stop()
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "calls": args.calls, "metrics": args.metrics,
                                        "think_ms": args.think_ms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
