"""Shared fixtures: tiny random checkpoints and running services."""

from __future__ import annotations

import os

import torch

import tandem  # noqa: F401 (turns gRPC's fork support off before any test loads grpc)

# Triton kernels run on the CPU through the interpreter when no GPU is present.
# It must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gateway.serve import CHILD_PORTS_ENV, CHILD_PORTS_LOW  # noqa: E402
from tests.tiny_models import make_tiny_llama  # noqa: E402

# One intra-op thread, here and in the services tests start (they inherit the
# environment): test processes and services share two cores, and OpenMP threads
# spinning against each other make tiny ops a thousand times slower.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# Each xdist worker (gw0, gw1, ...) hands out the services' ports from a share of its own, which the
# services and `tandem serve` processes it starts inherit: two workers never pick the same free port.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_PORTS_A_WORKER = 1500
_first_port = CHILD_PORTS_LOW + _PORTS_A_WORKER * (_WORKER % 8)
os.environ.setdefault(CHILD_PORTS_ENV, f"{_first_port}-{_first_port + _PORTS_A_WORKER - 1}")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> callable:
    """tiny_llama(variant) -> path of a cached random checkpoint of that variant."""
    cache: dict[str, object] = {}

    def get(variant: str = "gqa"):
        if variant not in cache:
            cache[variant] = make_tiny_llama(tmp_path_factory.mktemp(variant) / "model", variant)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def byte_stack(tmp_path_factory):
    """tests/byte_stack.py's stack, shared by every module that asks for it (one start)."""
    from tests.byte_stack import start_byte_stack

    stack = start_byte_stack(tmp_path_factory.mktemp("byte-stack"))
    yield stack
    stack.stop()


# --- what the processes behind a failed test said ---------------------------------------------------------
LOG_TAIL_LINES = 60


def _processes_of(value: object) -> list[tuple[str, object, object]]:
    """(name, Popen, log path) of each process a fixture value runs: a Stack's target, drafts and gateway,
    a lone Gateway or Service."""
    from tests.services import Service
    from tests.stack import Gateway, Stack

    if isinstance(value, Stack):
        services = [value.target, *value.drafts]
        return [(s.name, s.proc, s.log_path) for s in services] + [("gateway", value.proc, value.log_path)]
    if isinstance(value, Gateway):
        return [("gateway", value.proc, value.log_path)]
    if isinstance(value, Service):
        return [(value.name, value.proc, value.log_path)]
    return []


def _tail(path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})\n"


def _fixture_values(item) -> dict[str, object]:
    """The test's fixture values: its arguments, and those it asked for with request.getfixturevalue (which pytest
    keeps only in the request's own records; read defensively, they are not public)."""
    values = dict(getattr(item, "funcargs", {}))
    for name, fixturedef in getattr(getattr(item, "_request", None), "_fixture_defs", {}).items():
        cached = getattr(fixturedef, "cached_result", None)
        if name not in values and cached and cached[0] is not None:
            values[name] = cached[0]
    return values


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test against running services that fails shows whether each is still alive and its log's tail: an
    end-to-end failure on a CI machine is otherwise a bare 503 or a refused connection (stop 53)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for fixture, value in _fixture_values(item).items():
        for name, proc, log_path in _processes_of(value):
            code = proc.poll()
            state = "running" if code is None else f"exited with code {code}"
            report.sections.append((f"{fixture}: {name} ({state}), last {LOG_TAIL_LINES} lines of {log_path}",
                                    _tail(log_path)))
