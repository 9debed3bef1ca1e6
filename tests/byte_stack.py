"""One real stack for the bad-input, fuzzing and UTF-8 tests: a tiny random target with a byte-level
vocabulary (its outputs split and break multi-byte characters), a tiny draft, and a gateway with small
bounds so that going past them is cheap. Started once per test session (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.stack import Stack
from tests.tiny_draft import make_tiny_eagle3
from tests.tiny_models import BYTE_VOCAB as VOCAB
from tests.tiny_models import make_tiny_llama

__all__ = ["MAX_MODEL_LEN", "MAX_QUEUE", "MAX_REQUEST_BYTES", "VOCAB", "start_byte_stack"]

MAX_MODEL_LEN = 48
MAX_QUEUE = 32
MAX_REQUEST_BYTES = 64 * 1024


def start_byte_stack(tmp: Path) -> Stack:
    target = make_tiny_llama(tmp / "target", "bytes", max_position_embeddings=128)
    draft = make_tiny_eagle3(tmp / "draft", target)
    return Stack(tmp, target, [draft], "--no-profile", "--max-model-len", str(MAX_MODEL_LEN),
                 "--max-queue", str(MAX_QUEUE), "--max-request-bytes", str(MAX_REQUEST_BYTES))
