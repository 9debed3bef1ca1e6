"""Python's cyclic garbage collector, kept out of the step loop.

A full (generation 2) collection walks every object the collector tracks. A service that has
imported torch and transformers tracks about 400 thousand before it serves anything, and one walk
of them took 175 ms on the 2-core dev machine (2026-12-03). The collector runs in whichever thread
allocates when its thresholds trip, so the step in flight waits for the whole walk, and every
request in that step with it.

Once a service is ready, `GcWatch.ready` collects once and freezes the heap (`gc.freeze`): what was
allocated until then moves to the permanent generation, which later collections skip. What is
allocated while serving is still collected, in walks of that much alone. `GcWatch` also times every
full collection and logs a slow one as a warning once the service serves, so that a run's logs say
whether a stall was the collector. TANDEM_GC_FREEZE=0 leaves the heap unfrozen (to measure what the
freeze is worth); the watch stays.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

FREEZE_ENV = "TANDEM_GC_FREEZE"
SLOW_COLLECTION_S = 0.02  # a decode step on the H200 is about 5 ms: 20 ms is four of them


class GcWatch:
    """Times full collections through `gc.callbacks`, and freezes the heap once the service is ready."""

    def __init__(self, log: logging.Logger, slow_s: float = SLOW_COLLECTION_S):
        self.log = log
        self.slow_s = slow_s
        self.serving = False
        self.full_collections = 0
        self.full_collection_seconds = 0.0
        self.slow_while_serving = 0
        self._started: float | None = None

    def install(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def ready(self) -> bool:
        """The service is about to serve: collect once, freeze what is left (unless TANDEM_GC_FREEZE=0),
        and from now on log slow full collections as warnings. True where the heap was frozen."""
        frozen = os.environ.get(FREEZE_ENV, "1").strip() != "0"
        if frozen:
            started = time.perf_counter()
            gc.collect()
            gc.freeze()
            self.log.info("froze %d objects out of the garbage collector's walks in %.2f s",
                          gc.get_freeze_count(), time.perf_counter() - started)
        else:
            self.log.info("garbage collector heap left unfrozen (%s=0)", FREEZE_ENV)
        self.serving = True
        return frozen

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return  # young collections walk only what was allocated lately: short
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return  # installed between a start and its stop
        seconds = time.perf_counter() - self._started
        self._started = None
        self.full_collections += 1
        self.full_collection_seconds += seconds
        if self.serving and seconds >= self.slow_s:
            self.slow_while_serving += 1
            self.log.warning("a full garbage collection took %.0f ms while serving (a step in flight waited for "
                             "it; %d objects collected, %d frozen)", seconds * 1e3, info.get("collected", 0),
                             gc.get_freeze_count())
