"""What the gateway's API layers (REST, gRPC) and its core exchange. Plain data only."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.errors import InvalidArgument


class SpecMode(enum.StrEnum):
    """How much a request speculates (compares equal to its string, as the API spells it)."""

    NEVER = "never"
    ALWAYS = "always"
    AUTO = "auto"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # the client went away, or the gateway could not go on


SPEC_MODES = tuple(m.value for m in SpecMode)
MAX_LOGPROBS = 20
# Sampling settings travel to the target as float32 / uint32: larger values would become
# inf or fail to encode inside the step loop, taking the whole batch down with them.
MAX_TEMPERATURE = 3.0e38
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k most likely
    speculation: SpecMode | None = None  # None: the gateway's default mode (a string is converted)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidArgument(f"top_k must be between 0 and {MAX_TOP_K}, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.speculation is not None:
            if self.speculation not in SPEC_MODES:
                raise InvalidArgument(f"speculation must be one of {', '.join(SPEC_MODES)}, "
                                      f"got {self.speculation!r}")
            object.__setattr__(self, "speculation", SpecMode(self.speculation))
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SpecStats:
    draft_tokens: int = 0  # drafted nodes sent to the target for verification
    accepted_tokens: int = 0  # drafted nodes the target accepted
    verify_steps: int = 0  # steps that verified a tree
    plain_steps: int = 0  # steps that decoded one token without a tree

    def as_dict(self) -> dict[str, int]:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_steps": self.verify_steps, "plain_steps": self.plain_steps}


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's own text
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """One step's output for one request. The last delta has finish_reason set."""

    token_ids: tuple[int, ...]
    text: str  # new text; text that might start a stop string is held back until resolved
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None  # None while running
    prompt_tokens: int
    completion_tokens: int
    spec: SpecStats = field(default_factory=SpecStats)


DeltaSink = Callable[[Delta], None]


class GenerationEngine(Protocol):
    """The core the API layers drive. submit/abort are thread-safe and never block on a step."""

    model_name: str
    max_model_len: int
    tokenizer: object  # a transformers tokenizer

    def ready(self) -> bool: ...

    def submit(self, request_id: str, prompt_token_ids: list[int], params: GenerationParams,
               sink: DeltaSink) -> None:
        """Queue a request. `sink` is called from the engine's thread with each Delta.
        Raises InvalidArgument (e.g. prompt too long), ResourceExhausted (queue full),
        Unavailable (not ready or draining)."""

    def abort(self, request_id: str) -> None:
        """Stop a request (client went away) and free its KV everywhere; idempotent."""
