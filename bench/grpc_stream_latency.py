"""What one call on a bidirectional gRPC stream costs beside the server's work, as the
gateway's step stream uses it: back to back, and after the server worked for a while.

    python bench/grpc_stream_latency.py [--work-ms 0,1,7] [--calls 300] [--transports tcp,unix,socket]

A server process answers each StepCall with a StepReply after --work-ms of work
(the GIL held, as a step's kernel launches hold it; --sleep: released, as while
a GPU runs), sync (grpc.server, our services) and asyncio (grpc.aio) servers
alike; the client is the gateway's kind (a queue-fed request iterator, blocking
next()). Prints the median round trip minus the work. --transports: over TCP on the
loopback, over a Unix domain socket (gRPC's unix: addresses), or each in turn; and
`socket`, no gRPC at all: the same messages on a step lane (tandem/lane.py, as the
services serve StepStream with --step-lane: a 5-byte header each, the client's thread
writes and reads, one server thread serves; the `--servers` kind does not apply to it).
The call is a one-request verify step of --nodes nodes, its
reply that step's results, as the gateway and the target exchange them. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from tandem.lane import LaneMethod, LaneServer, LaneStream  # noqa: E402
from tandem.tensors import array_to_proto  # noqa: E402
from tandem.v1 import target_pb2, target_pb2_grpc  # noqa: E402
from target_service.step_batch import StepBatch  # noqa: E402
from target_service.types import SequenceStep  # noqa: E402
from target_service.wire import batch_to_proto  # noqa: E402


def verify_call(nodes: int) -> target_pb2.StepCall:
    """A one-request step of a root and nodes - 1 drafted children in a chain."""
    item = SequenceStep("req-0001", tuple(range(1, nodes + 1)), tuple(range(-1, nodes - 1)), num_fixed=1)
    return target_pb2.StepCall(step=target_pb2.PackedStep(items=batch_to_proto(StepBatch.from_items([item])),
                                                          feature_layers=[2, 16, 29], hold_features=True))


def verify_reply(nodes: int) -> target_pb2.StepReply:
    """What such a step gives back: four accepted, the bonus token, their log-probs."""
    results = target_pb2.PackedResults(
        item_index=array_to_proto(np.zeros(1, np.int32)), num_accepted=array_to_proto(np.full(1, 4, np.int32)),
        accepted_nodes=array_to_proto(np.arange(1, 5, dtype=np.int32)),
        tokens=array_to_proto(np.arange(5, dtype=np.int32)), logprobs=array_to_proto(np.zeros(5, np.float32)),
        num_committed=array_to_proto(np.full(1, 1029, np.int64)))
    return target_pb2.StepReply(step_index=1, done=True, results=results, step_seconds=0.005)


def _work(seconds: float, sleep: bool) -> None:
    if sleep:
        time.sleep(seconds)
        return
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def _listen(server, port_file: str, transport: str) -> str:
    """Binds the server where the transport says; returns the address a client dials."""
    if transport == "unix":
        address = f"unix:{Path(port_file).parent / 'echo.sock'}"
        server.add_insecure_port(address)
        return address
    return f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"


def _serve_lane(port_file: str, seconds: float, sleep: bool, nodes: int) -> None:
    """The same echo on a step lane (tandem/lane.py), as the services serve StepStream there."""
    def echo(calls, context):
        for _ in calls:
            _work(seconds, sleep)
            yield verify_reply(nodes)

    lane = LaneServer(Path(port_file).parent / "lane.sock", {"StepStream": LaneMethod(echo, target_pb2.StepCall)})
    lane.start()
    Path(port_file).write_text(f"{lane.path}\n{lane.token}")
    threading.Event().wait()  # the lane's threads serve until the process is stopped


def _serve(kind: str, port_file: str, seconds: float, sleep: bool, transport: str, nodes: int) -> None:
    if transport == "socket":
        _serve_lane(port_file, seconds, sleep, nodes)
        return
    if kind == "sync":
        from concurrent import futures

        class Sync(target_pb2_grpc.TargetServiceServicer):
            def StepStream(self, request_iterator, context):
                for _ in request_iterator:
                    _work(seconds, sleep)
                    yield verify_reply(nodes)

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        target_pb2_grpc.add_TargetServiceServicer_to_server(Sync(), server)
        address = _listen(server, port_file, transport)
        server.start()
        Path(port_file).write_text(address)
        server.wait_for_termination()
        return

    class Aio(target_pb2_grpc.TargetServiceServicer):
        async def StepStream(self, request_iterator, context):
            async for _ in request_iterator:
                _work(seconds, sleep)
                yield verify_reply(nodes)

    async def main() -> None:
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(Aio(), server)
        address = _listen(server, port_file, transport)
        await server.start()
        Path(port_file).write_text(address)
        await server.wait_for_termination()

    asyncio.run(main())


def _lane_round_trips(where: str, call: target_pb2.StepCall, calls: int) -> list[float]:
    path, token = where.split("\n")
    stream = LaneStream(path, token, "StepStream", target_pb2.StepReply)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        stream.send(call)
        stream.reply()
        times.append(time.perf_counter() - t0)
    stream.close()
    return times


def _grpc_round_trips(address: str, call: target_pb2.StepCall, calls: int) -> list[float]:
    channel = grpc.insecure_channel(address)
    calls_in: queue.Queue = queue.Queue()
    replies = target_pb2_grpc.TargetServiceStub(channel).StepStream(iter(calls_in.get, None))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        calls_in.put(call)
        next(replies)
        times.append(time.perf_counter() - t0)
    calls_in.put(None)
    channel.close()
    return times


def _measure(kind: str, seconds: float, sleep: bool, calls: int, switch_ms: float | None, transport: str,
             nodes: int) -> float:
    port_file = Path(tempfile.mkdtemp(prefix="tandem-echo-")) / "port"
    cmd = [sys.executable, __file__, "--serve", kind, "--port-file", str(port_file), "--work-ms",
           str(seconds * 1e3), "--transports", transport, "--nodes", str(nodes)] + (["--sleep"] if sleep else [])
    if switch_ms is not None:
        cmd += ["--switch-ms", str(switch_ms)]
    server = subprocess.Popen(cmd)
    try:
        while not (port_file.exists() and port_file.read_text()):
            time.sleep(0.05)
        round_trips = _lane_round_trips if transport == "socket" else _grpc_round_trips
        times = round_trips(port_file.read_text(), verify_call(nodes), calls)
        return 1e6 * (statistics.median(times[calls // 10:]) - seconds)
    finally:
        server.terminate()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", default="0,1,7", help="the server's work per call, ms (comma-separated)")
    ap.add_argument("--sleep", action="store_true", help="the work sleeps (GIL released) instead of spinning")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--switch-ms", default="",
                    help="also run with these GIL switch intervals (sys.setswitchinterval, ms, comma-separated; "
                         "set in the client and the server); Python's default is 5")
    ap.add_argument("--servers", default="sync,aio", help="sync, aio or both")
    ap.add_argument("--transports", default="tcp",
                    help="tcp, unix (gRPC on a Unix socket), socket (no gRPC: framed messages on a Unix socket); "
                         "comma-separated")
    ap.add_argument("--nodes", type=int, default=9, help="nodes of the verify step each call carries")
    ap.add_argument("--serve", choices=["sync", "aio"], help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve and args.switch_ms:
        sys.setswitchinterval(float(args.switch_ms) / 1e3)
    if args.serve:
        _serve(args.serve, args.port_file, float(args.work_ms) / 1e3, args.sleep, args.transports, args.nodes)
        return 0
    switches = [None] + [float(ms) for ms in args.switch_ms.split(",") if ms]
    default_switch = sys.getswitchinterval()
    print(f"{'switch ms':>9} {'work ms':>8} {'server':>6} {'transport':>9} {'round trip minus work, us':>26}  "
          f"({'sleep' if args.sleep else 'GIL held'})")
    for switch_ms in switches:
        sys.setswitchinterval(default_switch if switch_ms is None else switch_ms / 1e3)
        for work in (float(w) for w in args.work_ms.split(",")):
            for transport in args.transports.split(","):
                # A bare socket has no gRPC server kind: measured once, shown as "-".
                for kind in args.servers.split(",") if transport != "socket" else ["sync"]:
                    took = _measure(kind, work / 1e3, args.sleep, args.calls, switch_ms, transport, args.nodes)
                    label = f"{1e3 * sys.getswitchinterval():g}"
                    shown = kind if transport != "socket" else "-"
                    print(f"{label:>9} {work:>8g} {shown:>6} {transport:>9} {took:>26.1f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
