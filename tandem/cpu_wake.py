"""The host's CPU wake-up latency limit (Linux PM QoS, /dev/cpu_dma_latency), held while a process runs.

While a process keeps /dev/cpu_dma_latency open with a value written, the kernel keeps every core out of
idle states whose exit latency is above it (0: poll only). Deep idle states power a core down and flush its
caches, so the first host work after a wait runs cold, and a speculative round is about 25 hops, each after
a wait. On the dev machine holding the limit at 0 cut a torch op's first run after a 20 ms sleep 3-5x
(bench/host_wake.py --cpu-latency-us 0); on the H100 device host, a VM that lists no idle states, it
changed nothing (its cold ops are the thread's own: BENCHMARKS.md, the sixty-third session). So it is for
bare-metal hosts whose cores idle deeply, as latency-tuned hosts are set (tuned's latency-performance
profile). It costs power: the cores no longer sleep deeply, so it is something a deployment asks for.
Needs root, or write access to the device; the limit lapses when the file is closed (the process exits).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

DEVICE = Path("/dev/cpu_dma_latency")
CPUIDLE = Path("/sys/devices/system/cpu/cpu0/cpuidle")


def idle_states(cpuidle: Path = CPUIDLE) -> list[tuple[str, int]]:
    """cpu0's idle states as (name, exit latency in us); [] where the kernel lists none."""
    states = []
    for state in sorted(cpuidle.glob("state*"), key=lambda p: int(p.name[5:])):
        try:
            states.append(((state / "name").read_text().strip(), int((state / "latency").read_text())))
        except (OSError, ValueError):
            continue
    return states


@contextlib.contextmanager
def held_wake_latency(limit_us: int | None, device: Path = DEVICE) -> Iterator[str]:
    """Hold the wake-up latency limit at `limit_us` microseconds for the block (None: leave the host's).
    Yields what was done, as words for a log: "held at N us", or "not held: why"; never raises for a
    device that cannot be opened (an unprivileged container), so a caller decides what that means."""
    if limit_us is None:
        yield "not held"
        return
    if limit_us < 0:
        raise ValueError(f"a wake-up latency limit is 0 or more microseconds, got {limit_us}")
    try:
        fd = os.open(device, os.O_WRONLY)
    except OSError as exc:
        yield f"not held: {device}: {exc.strerror}"
        return
    try:
        os.write(fd, struct.pack("<i", limit_us))
        yield f"held at {limit_us} us"
    finally:
        os.close(fd)
