"""Plain-data inputs and outputs of the target's step (protobuf stays at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.errors import InvalidArgument, ResourceExhausted
from target_service.controls import LogitsControls


class InvalidStep(InvalidArgument):
    """A step item that cannot be run; maps to INVALID_ARGUMENT."""


class OutOfCapacity(ResourceExhausted):
    """The step does not fit in the KV cache; maps to RESOURCE_EXHAUSTED."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # <= 0 or >= 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def problem(self) -> str | None:
        if not self.temperature >= 0 or self.temperature != self.temperature:
            return f"temperature must be >= 0, got {self.temperature}"
        if self.top_k < 0:
            return f"top_k must be >= 0, got {self.top_k}"
        if self.top_p != self.top_p:
            return "top_p must be a number"
        return None


@dataclass(frozen=True)
class SequenceStep:
    request_id: str
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    num_fixed: int
    create: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    top_logprobs: int = 0
    return_features: bool = False
    controls: LogitsControls = field(default_factory=LogitsControls)  # penalties, bias, min_tokens, min_p
    # The token sampled after the last committed node is the sequence's next token (the chain reaches the
    # last token the caller knows), not a prompt chunk's throwaway sample: feature rows pushed to a
    # subscriber then carry it, so that it can compute those positions at once (FeatureRows.next_tokens).
    sample_is_output: bool = False

    @classmethod
    def chain(cls, request_id: str, tokens: list[int] | tuple[int, ...], **kw) -> SequenceStep:
        """A prompt chunk or a plain-decode step: every node fixed."""
        n = len(tokens)
        return cls(request_id, tuple(tokens), tuple(range(-1, n - 1)), n, **kw)


@dataclass
class SequenceResult:
    request_id: str
    accepted_nodes: list[int]
    tokens: list[int]  # accepted drafted tokens, then the bonus token
    logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]]
    features: torch.Tensor | None  # [committed this step, layers * hidden], the model's dtype
    num_committed: int


@dataclass(frozen=True)
class KvLoad:
    num_sequences: int
    block_size: int
    total_blocks: int
    free_blocks: int

    @property
    def free_token_slots(self) -> int:
        return self.free_blocks * self.block_size
