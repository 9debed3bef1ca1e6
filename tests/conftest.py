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

from tests.tiny_models import make_tiny_llama  # noqa: E402

# One intra-op thread, here and in the services tests start (they inherit the
# environment): test processes and services share two cores, and OpenMP threads
# spinning against each other make tiny ops a thousand times slower.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


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
