"""Hold the host's CPU wake-up latency limit (PM QoS, /dev/cpu_dma_latency) while something runs.

    python bench/cpu_latency.py                 # print the cores' idle states and exit
    python bench/cpu_latency.py --hold-us 0     # hold the limit at 0 us until SIGTERM / Ctrl-C

While a process keeps /dev/cpu_dma_latency open with a value written, the kernel keeps every core out
of idle states whose exit latency is above it (0: poll only). Deep idle states power down a core and
flush its caches, so the first host work after a wait runs cold: on an H100 host a torch op took
82-164 us after a 20 ms sleep against 1.6-6.9 us warm (bench/host_wake.py, 2026-12-07), and a served
round runs about 25 hops, each after a wait. This is how latency-tuned hosts run (tuned's
latency-performance profile does the same); a benchmark option here, to measure what it is worth.
Needs root (or write access to the device); the limit lapses when the file is closed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

DEVICE = "/dev/cpu_dma_latency"
CPUIDLE = Path("/sys/devices/system/cpu/cpu0/cpuidle")


def idle_states() -> list[dict[str, object]]:
    """cpu0's idle states: name, exit latency (us), and whether disabled; [] where none are listed."""
    states = []
    for state in sorted(CPUIDLE.glob("state*"), key=lambda p: int(p.name[5:])):
        try:
            states.append({"name": (state / "name").read_text().strip(),
                           "latency_us": int((state / "latency").read_text()),
                           "disabled": (state / "disable").read_text().strip() == "1"})
        except OSError:
            continue
    return states


@contextlib.contextmanager
def held_cpu_latency(limit_us: int | None) -> Iterator[str]:
    """Hold the wake-up latency limit at `limit_us` for the block (None: leave it). Yields what was
    done, as a sentence for a log: the limit held, or why it could not be."""
    if limit_us is None:
        yield "not held"
        return
    try:
        fd = os.open(DEVICE, os.O_WRONLY)
    except OSError as exc:
        yield f"not held: {DEVICE}: {exc.strerror}"
        return
    try:
        os.write(fd, struct.pack("<i", limit_us))
        yield f"held at {limit_us} us"
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold-us", type=int, help="hold the limit at this many microseconds until stopped")
    args = parser.parse_args(argv)
    states = idle_states()
    print("cpu0 idle states: " + (", ".join(f"{s['name']} ({s['latency_us']} us{', disabled' if s['disabled'] else ''})"
                                            for s in states) or "none listed"), flush=True)
    if args.hold_us is None:
        return 0
    if args.hold_us < 0:
        parser.error("--hold-us must be 0 or more")
    with held_cpu_latency(args.hold_us) as done:
        print(f"cpu wake-up latency limit {done}", flush=True)
        if not done.startswith("held"):
            return 1
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
