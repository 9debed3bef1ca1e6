"""What a hop costs a host that waits between hops: cold host ops and a woken process.

    python bench/host_wake.py [--pause-ms 5] [--samples 200] [--cpu-latency-us N] [--out FILE]

A round's hops each run after a wait (the GPU's step, the other services' work), and the served
timelines show the host work after a hop several times slower than the same work timed in a warm
loop (the push's store: about 0.25 ms served on the H200's host against about 0.06 ms in a loop on
the dev machine). Two measurements say why, and what would help:

  ops    one host op (Python, numpy, torch on the CPU, a protobuf parse) timed in a warm loop, after
         a 20 ms sleep, after 20 ms spent spinning on the same thread, and after the sleep then 0.3 ms
         of spinning: a cold op that spinning keeps warm is the core's idle state (C-states, frequency)
         or the thread's being descheduled; one that stays cold is caches evicted by other work. The
         last column says whether spinning only at a wait's end (tandem/lane.py's spinning reads) is
         enough.
  wake   two processes on a Unix socket pair (as the step lane's): every pause-ms one sends 64 bytes,
         the other runs a fixed piece of host work (twenty small torch ops) and answers. The round trip
         and the work's own time, medians, with the receiver blocking in recv, busy-polling recv,
         blocking with both processes pinned to one core each, sleeping until 0.3 ms before the
         message is due, then polling ("tail"), and spinning in C without the GIL ("c-spin",
         tandem/spin_wait.py, as the lanes' spinning reads do). The sender waits for the answer as the
         receiver waits for the message.

With --cpu-latency-us N both run with the host's wake-up latency limit held at N us
(tandem/cpu_wake.py: no core idles in a state slower to leave), to show what deep idle states cost.
Microseconds throughout. A benchmark, not a test: it prints numbers (and writes them as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

COLD_PAUSE_S = 0.02
TAIL_SPIN_S = 0.0003  # a spin at a wait's end only
REPLY = struct.Struct("<d")  # the receiver's work time, seconds


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def op_kinds() -> dict[str, Callable[[], object]]:
    import numpy as np
    import torch

    from tandem.v1 import target_pb2

    ints = np.arange(64, dtype=np.int64)
    rows = torch.zeros(64, 768)
    raw = np.zeros(4096, np.uint8)
    buffer = torch.zeros(4096, dtype=torch.uint8)
    message = target_pb2.FeatureRows(request_ids=["r0"] * 8).SerializeToString()
    return {
        "python: a list comprehension of 64": lambda: [i * 2 for i in range(64)],
        "numpy: slice, cumsum, tolist": lambda: np.cumsum(ints[1:9]).tolist(),
        "torch: slice and clone": lambda: rows[1:3].clone(),
        "torch: from_numpy and view": lambda: torch.from_numpy(raw).view(torch.int32),
        "torch: tensor from a list": lambda: torch.tensor([1, 2, 3, 4], dtype=torch.int64),
        "torch: copy into a buffer": lambda: buffer[:64].copy_(torch.from_numpy(raw[:64])),
        "protobuf: parse a small message": lambda: target_pb2.FeatureRows.FromString(message),
    }


def time_op(fn: Callable[[], object], samples: int, before: Callable[[], None] | None) -> float:
    """Median microseconds of fn's first run after `before` (none: back to back)."""
    times = []
    for _ in range(samples):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def measure_ops(samples: int) -> dict[str, dict[str, float]]:
    result = {}
    for name, fn in op_kinds().items():
        fn()
        result[name] = {
            "warm_us": time_op(fn, 10 * samples, None),
            "after_sleep_us": time_op(fn, samples // 4, lambda: time.sleep(COLD_PAUSE_S)),
            "after_spin_us": time_op(fn, samples // 4, lambda: _spin(COLD_PAUSE_S)),
            "after_sleep_then_spin_us": time_op(fn, samples // 4,
                                                lambda: (time.sleep(COLD_PAUSE_S), _spin(TAIL_SPIN_S))),
        }
    return result


def _work() -> None:
    """The receiver's host work per message: twenty small torch ops, as a hop's parse and load make."""
    import torch

    t = torch.zeros(16, 64)
    for i in range(10):
        t[i: i + 2].clone()
        torch.tensor([i, i + 1], dtype=torch.int64)


def _recv(conn: socket.socket, size: int, poll: bool, waiter=None) -> bytes:
    data = b""
    while len(data) < size:
        if waiter is not None:
            if waiter(conn.fileno(), 0.05) <= 0:
                continue
            chunk = conn.recv(size - len(data))
        elif poll:
            try:
                chunk = conn.recv(size - len(data), socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
        else:
            chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _receiver(conn: socket.socket, poll: bool, core: int | None, sleep_s: float = 0.0, waiter=None) -> None:
    """sleep_s: after each answer, sleep that long (woken early by a message) before polling."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    _work()
    try:
        while True:
            if sleep_s > 0:
                select.select([conn], [], [], sleep_s)
            _recv(conn, 64, poll, waiter)
            t0 = time.perf_counter()
            _work()
            conn.sendall(REPLY.pack(time.perf_counter() - t0))
    except (EOFError, OSError):
        pass


def measure_wake(mode: str, pause_s: float, samples: int) -> dict[str, float]:
    poll = mode in ("poll", "tail")
    waiter = None
    if mode == "c-spin":
        from tandem.spin_wait import native_waiter

        waiter = native_waiter()  # built here, before the fork
        if waiter is None:
            return {"round_trip_us": float("nan"), "round_trip_p90_us": float("nan"), "receiver_work_us": float("nan")}
    cores = sorted(os.sched_getaffinity(0))
    pinned = mode == "pinned" and len(cores) >= 2
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        ours.close()
        # "tail": the next message is due pause_s after this answer reached the sender; poll for its last 0.3 ms.
        _receiver(theirs, poll, cores[1] if pinned else None, pause_s - TAIL_SPIN_S if mode == "tail" else 0.0,
                  waiter)
        os._exit(0)
    theirs.close()
    before = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {cores[0]})
    trips, works = [], []
    try:
        for i in range(samples + 5):
            time.sleep(pause_s)
            t0 = time.perf_counter_ns()
            ours.sendall(bytes(64))
            (work_s,) = REPLY.unpack(_recv(ours, REPLY.size, poll, waiter))
            if i >= 5:
                trips.append((time.perf_counter_ns() - t0) / 1e3)
                works.append(work_s * 1e6)
    finally:
        ours.close()
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, before)
    return {"round_trip_us": statistics.median(trips), "round_trip_p90_us": sorted(trips)[int(0.9 * len(trips))],
            "receiver_work_us": statistics.median(works)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pause-ms", type=float, default=5.0, help="the sender's pause between messages")
    parser.add_argument("--samples", type=int, default=200, help="samples per figure")
    parser.add_argument("--cpu-latency-us", type=int, help="hold the host's wake-up latency limit at this "
                        "many microseconds throughout (tandem/cpu_wake.py; needs root)")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tandem.cpu_wake import held_wake_latency, idle_states

    with held_wake_latency(args.cpu_latency_us) as held:
        print(f"wake-up latency limit {held}; cpu0 idle states: "
              + ", ".join(f"{name} ({latency} us)" for name, latency in idle_states()))
        # The wake measurement forks: before any torch op has started threads in this process.
        wake = {mode: measure_wake(mode, args.pause_ms / 1e3, args.samples)
                for mode in ("block", "poll", "pinned", "tail", "c-spin")}
        ops = measure_ops(args.samples)
    print(f"one op, microseconds (median): warm loop, after a {COLD_PAUSE_S * 1e3:.0f} ms sleep, after as long "
          f"spinning, after the sleep then {TAIL_SPIN_S * 1e3:g} ms spinning")
    for name, figures in ops.items():
        print(f"  {name:36s} {figures['warm_us']:8.2f} {figures['after_sleep_us']:8.2f} "
              f"{figures['after_spin_us']:8.2f} {figures['after_sleep_then_spin_us']:8.2f}")
    print(f"a message every {args.pause_ms:g} ms, answered after twenty small torch ops; microseconds (median)")
    for mode, figures in wake.items():
        print(f"  receiver {mode:7s} round trip {figures['round_trip_us']:8.1f} (p90 "
              f"{figures['round_trip_p90_us']:8.1f}), of which its work {figures['receiver_work_us']:8.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"pause_ms": args.pause_ms, "samples": args.samples, "cpu_latency": held,
                                        "idle_states": dict(idle_states()), "ops": ops, "wake": wake}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
