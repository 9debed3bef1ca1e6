"""Wait for a socket to become readable by spinning in C, without the GIL.

A thread that sleeps through a wait runs its next host work cold: on the H100's host a woken receiver's round
trip was 241 us against 101 for one that polled, and its work 157 against 79 us (bench/host_wake.py). Polling
from Python keeps the poller hot but takes the GIL between polls, and another thread of the same process then
ran its twenty small torch ops in twice the time (bench/results/cpu_2026-12-07_session63/gil_spin.py). Here the
loop is C's: a ctypes call releases the GIL for its whole length, so the waiting thread stays on its core and
the others run as if it slept. The source is below; it is built once per host with the C compiler (as Triton
builds its launchers) into a cache directory; where that fails, the lanes' reads block (tandem/lane.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = r"""
#include <poll.h>
#include <time.h>

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 1 once fd is readable (or its peer hung up), 0 when spin_ns passed first, -1 on an error. */
int tandem_wait_readable(int fd, long long spin_ns) {
    struct pollfd p = {fd, POLLIN, 0};
    long long end = now_ns() + spin_ns;
    for (;;) {
        int ready = poll(&p, 1, 0);
        if (ready != 0)
            return ready > 0 ? 1 : -1;
        if (now_ns() >= end)
            return 0;
    }
}
"""

CACHE_ENV = "TANDEM_CACHE_DIR"


def cache_dir() -> Path:
    """Where built helpers are kept: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tandem"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source = Path(work) / "spin_wait.c"
        source.write_text(SOURCE)
        built = Path(work) / target.name
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: services starting together may build it at once


@functools.cache
def native_waiter() -> Callable[[int, float], int] | None:
    """wait(fd, seconds) -> 1 readable, 0 timed out, -1 error, spinning in C without the GIL; None where it
    cannot be built or loaded (said once in the log)."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    target = cache_dir() / f"spin_wait-{digest}.so"
    try:
        if not target.is_file():
            _build(target)
        lib = ctypes.CDLL(str(target))  # CDLL, not PyDLL: each call releases the GIL
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the C spin (tandem/spin_wait.py) could not be built or loaded: %s", exc)
        return None
    wait = lib.tandem_wait_readable
    wait.argtypes = [ctypes.c_int, ctypes.c_longlong]
    wait.restype = ctypes.c_int
    return lambda fd, seconds: wait(fd, int(seconds * 1e9))
