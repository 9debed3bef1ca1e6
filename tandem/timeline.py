"""Timestamps of a round's hops across the three processes, for `bench/round_timeline.py`.

Off unless `TANDEM_TIMELINE` names a directory when the process starts; then every
`mark(label)` keeps (CLOCK_MONOTONIC ns, label), and the marks go to
`DIR/timeline-<pid>.txt` every few thousand marks and at exit. CLOCK_MONOTONIC is one
clock for every process of a host, so the gateway's, the draft's and the target's marks
merge into one timeline: where a round's wall time goes between the services' own
timers (the gateway's phases and the services' step times cannot say which hop it is).
While it is off a mark is one global read and a return.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

DIRECTORY = os.environ.get("TANDEM_TIMELINE") or None
FLUSH_EVERY = 4096
MAX_MARKS = 4_000_000  # about 100 MB of text; later marks are dropped

_marks: list[tuple[int, str]] = []
_written = 0
_lock = threading.Lock()


def mark(label: str) -> None:
    """Note that `label` happened now (no-op unless TANDEM_TIMELINE is set)."""
    if DIRECTORY is None:
        return
    _marks.append((time.monotonic_ns(), label))
    if len(_marks) >= FLUSH_EVERY:
        flush()


def flush() -> None:
    """Append the marks kept so far to this process's file."""
    global _written
    if DIRECTORY is None:
        return
    with _lock:
        taken = _marks[:]
        del _marks[: len(taken)]
        if not taken or _written >= MAX_MARKS:
            return
        _written += len(taken)
        os.makedirs(DIRECTORY, exist_ok=True)
        with open(os.path.join(DIRECTORY, f"timeline-{os.getpid()}.txt"), "a") as out:
            out.writelines(f"{ns} {label}\n" for ns, label in taken)


if DIRECTORY is not None:
    atexit.register(flush)
