"""Which Triton kernels compile while a service runs, and how long each took.

A Triton kernel compiles the first time a launch meets a new specialisation of it: other
constexprs, an integer argument that is 1 or a multiple of 16 where it was not before, a pointer
that is or is not 16-byte aligned. At start-up that is expected (warm-up, graph capture). Once a
service serves, the step that meets one waits for the whole compile (a second or more), and every
request in that step with it: a stall that looks like noise in a benchmark. `CompileWatch` logs
every compile with its time, as a warning once the service has said it is serving, so that a run's
logs name the kernel and the specialisation to warm up or to stop specialising.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kernels._triton import HAS_TRITON, interpreting, triton


class CompileWatch:
    """Times Triton's compiles through its JIT hooks (`triton.knobs.runtime`); one per process."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self.serving = False
        self.compiles = 0
        self.compiles_while_serving = 0
        self.seconds_while_serving = 0.0
        self._started: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook Triton's compiles; False where there is nothing to watch (no Triton, the interpreter,
        or a Triton without runtime hooks)."""
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if not HAS_TRITON or interpreting() or runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        runtime.jit_cache_hook = self._before_compile
        runtime.jit_post_compile_hook = self._after_compile
        return True

    def mark_serving(self) -> None:
        """From now on a compile is a step's stall: it is logged as a warning."""
        self.serving = True

    @staticmethod
    def _key(fn: Any, key: Any) -> tuple[str, str]:
        return getattr(fn, "name", str(fn)), str(key)

    def _before_compile(self, *, key: Any, fn: Any, **_: Any) -> bool:
        with self._lock:
            self._started[self._key(fn, key)] = time.perf_counter()
        return False  # True would tell Triton to skip the compile

    def _after_compile(self, *, key: Any, fn: Any, **_: Any) -> bool:
        now = time.perf_counter()
        # The key holds each argument's specialisation in order (type, and for ints and pointers
        # "D" for divisible by 16, "1" for one): what makes this variant new.
        name, specialisation = watched = self._key(fn, key)
        with self._lock:
            seconds = now - self._started.pop(watched, now)
            self.compiles += 1
            if self.serving:
                self.compiles_while_serving += 1
                self.seconds_while_serving += seconds
        if self.serving:
            self.log.warning("Triton compiled %s while serving (%.2f s; a step waited for it); arguments %s",
                             name, seconds, specialisation[:2000])
        else:
            self.log.debug("Triton compiled %s in %.2f s; arguments %s", name, seconds, specialisation[:2000])
        return False
