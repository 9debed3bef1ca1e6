"""Emulated call cost: hold a service call for at least a device-like time (tests and demos).

On a GPU at load every drafted token costs real time, in the target's verify
step and in the draft's own call, so plain decoding wins; with the small demo
models on a CPU the per-sequence costs of a step (Python, gRPC, streaming)
dominate instead, and a 3-token chain still paid at 48 streams (1.15x, see
tests/test_gateway_auto_phases.py). `--emulate-step-cost BASE_MS,PER_TOKEN_MS`
on `tandem target` (tokens in the step) and on `tandem draft` (tree nodes
expanded in the call: steps x topk per request) pads each call's wall time to at least BASE_MS + PER_TOKEN_MS x
tokens, so the `auto` policy meets the GPU regime on a CPU, with real processes
and real models. It never shortens a call and never changes an output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepPacing:
    base_ms: float
    per_token_ms: float

    def __post_init__(self) -> None:
        if self.base_ms < 0 or self.per_token_ms < 0:
            raise ValueError("--emulate-step-cost: both figures must be >= 0")

    @classmethod
    def parse(cls, text: str) -> StepPacing:
        """'BASE_MS,PER_TOKEN_MS', e.g. '20,2'."""
        try:
            base, per_token = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"--emulate-step-cost takes BASE_MS,PER_TOKEN_MS (e.g. 20,2), got {text!r}") from None
        return cls(base, per_token)

    def seconds(self, tokens: int) -> float:
        return (self.base_ms + self.per_token_ms * tokens) / 1000.0

    def hold(self, started: float, tokens: int) -> None:
        """Sleep until the call begun at `started` (time.perf_counter) has lasted its emulated time."""
        left = started + self.seconds(tokens) - time.perf_counter()
        if left > 0:
            time.sleep(left)


def add_pacing_argument(parser, call: str, tokens: str) -> None:
    parser.add_argument("--emulate-step-cost", default=None, metavar="BASE_MS,PER_TOKEN_MS",
                        help=f"tests and demos only: hold every {call} for at least BASE_MS + PER_TOKEN_MS x "
                        f"{tokens}, a GPU-like cost curve on a CPU, where drafted tokens are otherwise nearly "
                        "free at any load (outputs are unchanged; see tandem/pacing.py)")


def pacing_from_args(text: str | None) -> StepPacing | None:
    """The parsed flag, or SystemExit with the reason."""
    if not text:
        return None
    try:
        return StepPacing.parse(text)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
