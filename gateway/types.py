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
MAX_PENALTY = 2.0  # frequency and presence penalties: OpenAI's range
MAX_REPETITION_PENALTY = 1.0e6  # travels as float32; far past any useful value
MAX_LOGIT_BIAS = 100.0  # OpenAI's range
MAX_LOGIT_BIAS_ENTRIES = 1024  # vLLM's default bound on logit_bias keys


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
    # Logits controls (vLLM's meanings; target_service/controls.py applies them on every decode path).
    repetition_penalty: float = 1.0  # > 0; 1 = off
    frequency_penalty: float = 0.0  # [-2, 2]
    presence_penalty: float = 0.0  # [-2, 2]
    min_p: float = 0.0  # [0, 1]
    min_tokens: int = 0  # no end-of-sequence, stop token or stop string before this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    # Output text.
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True

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
        self._check_controls()

    def _check_controls(self) -> None:
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                                  f"{self.repetition_penalty!r}", param="repetition_penalty")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidArgument(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value!r}",
                                      param=name)
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidArgument(f"min_p must be between 0 and 1, got {self.min_p!r}", param="min_p")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}",
                                  param="min_tokens")
        if self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                                  param="min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidArgument(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidArgument(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidArgument(f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and "
                                      f"{MAX_LOGIT_BIAS:g}, got {bias!r}", param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SpecStats:
    draft_tokens: int = 0  # drafted nodes sent to the target for verification
    accepted_tokens: int = 0  # drafted nodes the target accepted
    verify_steps: int = 0  # steps that verified a tree
    plain_steps: int = 0  # steps that decoded one token without a tree
    # Verify steps by drafted tokens accepted: histogram[j] steps accepted exactly j (vLLM's shape).
    histogram: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, int]:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_steps": self.verify_steps, "plain_steps": self.plain_steps}

    def after_verify(self, drafted: int, accepted: int) -> SpecStats:
        hist = list(self.histogram) + [0] * max(0, accepted + 1 - len(self.histogram))
        hist[accepted] += 1
        return SpecStats(self.draft_tokens + drafted, self.accepted_tokens + accepted, self.verify_steps + 1,
                         self.plain_steps, tuple(hist))

    def after_plain(self) -> SpecStats:
        return SpecStats(self.draft_tokens, self.accepted_tokens, self.verify_steps, self.plain_steps + 1,
                         self.histogram)

    def vllm_dict(self) -> dict[str, object]:
        """The per-request statistics in vLLM's `metrics.speculative_decoding` shape (what aiperf
        and other vLLM-aware tools read). Trees vary in size, so there is no fixed
        num_spec_tokens; the histogram is as long as the deepest acceptance seen, plus one."""
        steps, accepted = self.verify_steps, self.accepted_tokens
        return {"num_drafts": steps, "num_draft_tokens": self.draft_tokens,
                "num_accepted_draft_tokens": accepted, "num_spec_steps": steps,
                "acceptance_histogram": list(self.histogram) or [0],
                "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
                "draft_acceptance_rate": accepted / self.draft_tokens if self.draft_tokens else 0.0}


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
    # Why an aborted request ended, for its client (e.g. the target stayed unreachable);
    # None: the API layer's generic message.
    error: str | None = None


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
