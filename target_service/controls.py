"""Logits controls: what, besides temperature/top-k/top-p, changes a sequence's distribution.

The OpenAI/vLLM sampling controls, per sequence, as plain data (the torch side is
target_service.processors). They follow vLLM's definitions:

- logit_bias: added to the logits of the named token ids;
- min_tokens: while fewer than min_tokens output tokens precede the one being
  chosen, the stop ids (end-of-sequence and stop token ids) get -inf;
- repetition_penalty r: a token seen anywhere in the context (prompt and output)
  has its logit divided by r when positive, multiplied by r otherwise;
- frequency_penalty f, presence_penalty p: a token seen c times in the *output*
  loses f * c + p * (c > 0);
- min_p: after temperature, tokens whose probability is below min_p times the
  most likely token's are dropped (before top-k/top-p).

Order: bias, min_tokens, repetition, frequency and presence, then temperature,
min_p, top-k, top-p, as vLLM applies them. Every control applies at each tree node
from the tokens on that node's own path, so a verified tree decides exactly as
plain decoding would. prompt_len says where the output begins: tokens at
positions >= prompt_len are output (a sequence re-prefilled after preemption is
one chain, but its output still counts as output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's bound on frequency and presence penalties


@dataclass(frozen=True)
class LogitsControls:
    """One sequence's controls; the defaults change nothing."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_len: int = 0  # tokens before the output: positions >= prompt_len are output
    stop_ids: tuple[int, ...] = ()  # suppressed while the output is shorter than min_tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    @property
    def neutral(self) -> bool:
        return (self.repetition_penalty == 1 and self.frequency_penalty == 0 and self.presence_penalty == 0
                and self.min_p == 0 and self.min_tokens == 0 and not self.logit_bias)

    @property
    def needs_history(self) -> bool:
        """Penalties depend on every token of the sequence so far: the target keeps their counts."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def problem(self, vocab: int | None = None) -> str | None:
        """Why these controls cannot be applied, or None."""
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            return f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                return f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}"
        if not 0 <= self.min_p <= 1:
            return f"min_p must be between 0 and 1, got {self.min_p}"
        if self.min_tokens < 0 or self.prompt_len < 0:
            return "min_tokens and prompt_len must be >= 0"
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                return f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias}"
            if vocab is not None and not 0 <= token < vocab:
                return f"logit_bias token id {token} out of range [0, {vocab})"
        if vocab is not None:
            bad = [t for t in self.stop_ids if not 0 <= t < vocab]
            if bad:
                return f"stop id {bad[0]} out of range [0, {vocab})"
        return None


def _ragged(lists: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    counts = np.array([len(x) for x in lists], dtype=np.int32)
    values = np.concatenate(lists).astype(dtype) if lists and counts.sum() else np.zeros(0, dtype)
    return counts, values


@dataclass(frozen=True, kw_only=True, eq=False)
class ControlColumns:
    """LogitsControls of a step's sequences as columns (one entry per sequence; the ragged
    lists as counts [B] then values, sequence after sequence)."""

    repetition_penalty: np.ndarray  # float32 [B]
    frequency_penalty: np.ndarray  # float32 [B]
    presence_penalty: np.ndarray  # float32 [B]
    min_p: np.ndarray  # float32 [B]
    min_tokens: np.ndarray  # int32 [B]
    prompt_len: np.ndarray  # int32 [B]
    stop_counts: np.ndarray  # int32 [B]
    stop_ids: np.ndarray  # int32 [sum(stop_counts)]
    bias_counts: np.ndarray  # int32 [B]
    bias_ids: np.ndarray  # int32 [sum(bias_counts)]
    bias_values: np.ndarray  # float32 [sum(bias_counts)]

    PER_SEQUENCE = ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "min_tokens",
                    "prompt_len", "stop_counts", "bias_counts")

    def __post_init__(self) -> None:
        B = len(self.repetition_penalty)
        for name in self.PER_SEQUENCE:
            if len(getattr(self, name)) != B:
                raise ValueError(f"ControlColumns.{name} has {len(getattr(self, name))} entries for {B} sequences")
        if int(self.stop_counts.sum()) != len(self.stop_ids) or (self.stop_counts < 0).any():
            raise ValueError("stop_counts do not match stop_ids")
        if int(self.bias_counts.sum()) != len(self.bias_ids) or len(self.bias_ids) != len(self.bias_values) \
                or (self.bias_counts < 0).any():
            raise ValueError("bias_counts do not match bias_ids / bias_values")

    @property
    def size(self) -> int:
        return len(self.repetition_penalty)

    @property
    def needs_history(self) -> np.ndarray:
        """bool [B]: sequences whose penalties need their token counts."""
        return ((self.repetition_penalty != 1) | (self.frequency_penalty != 0)
                | (self.presence_penalty != 0))

    @classmethod
    def from_items(cls, controls: list[LogitsControls]) -> ControlColumns | None:
        """The columns, or None when every sequence's controls are neutral (the fast path)."""
        if all(c.neutral for c in controls):
            return None
        stop_counts, stop_ids = _ragged([np.array(c.stop_ids, dtype=np.int64) for c in controls], np.int32)
        bias_counts, bias_ids = _ragged([np.array([t for t, _ in c.logit_bias], dtype=np.int64)
                                         for c in controls], np.int32)
        _, bias_values = _ragged([np.array([v for _, v in c.logit_bias], dtype=np.float64) for c in controls],
                                 np.float32)
        return cls(
            repetition_penalty=np.array([c.repetition_penalty for c in controls], dtype=np.float32),
            frequency_penalty=np.array([c.frequency_penalty for c in controls], dtype=np.float32),
            presence_penalty=np.array([c.presence_penalty for c in controls], dtype=np.float32),
            min_p=np.array([c.min_p for c in controls], dtype=np.float32),
            min_tokens=np.array([c.min_tokens for c in controls], dtype=np.int32),
            prompt_len=np.array([c.prompt_len for c in controls], dtype=np.int32),
            stop_counts=stop_counts, stop_ids=stop_ids, bias_counts=bias_counts, bias_ids=bias_ids,
            bias_values=bias_values)

    def _starts(self, counts: np.ndarray) -> np.ndarray:
        out = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=out[1:])
        return out

    def item(self, b: int) -> LogitsControls:
        s, k = self._starts(self.stop_counts), self._starts(self.bias_counts)
        return LogitsControls(
            repetition_penalty=float(self.repetition_penalty[b]), frequency_penalty=float(self.frequency_penalty[b]),
            presence_penalty=float(self.presence_penalty[b]), min_p=float(self.min_p[b]),
            min_tokens=int(self.min_tokens[b]), prompt_len=int(self.prompt_len[b]),
            stop_ids=tuple(int(t) for t in self.stop_ids[s[b]: s[b + 1]]),
            logit_bias=tuple((int(t), float(v)) for t, v in zip(self.bias_ids[k[b]: k[b + 1]],
                                                                 self.bias_values[k[b]: k[b + 1]])))

    def take(self, rows: np.ndarray) -> ControlColumns:
        """The columns of sequences `rows`, in that order."""
        s, k = self._starts(self.stop_counts), self._starts(self.bias_counts)
        stop = [self.stop_ids[s[r]: s[r + 1]] for r in rows.tolist()]
        bias = [np.arange(k[r], k[r + 1]) for r in rows.tolist()]
        bias_at = np.concatenate(bias) if bias else np.zeros(0, np.int64)
        return ControlColumns(
            **{name: getattr(self, name)[rows] for name in self.PER_SEQUENCE},
            stop_ids=np.concatenate(stop).astype(np.int32) if stop else np.zeros(0, np.int32),
            bias_ids=self.bias_ids[bias_at], bias_values=self.bias_values[bias_at])

    def problem(self, vocab: int) -> tuple[int, str] | None:
        """The first sequence whose controls cannot be applied, and why (checked as columns: the
        step's host work stays a few array operations; LogitsControls.problem words the reason)."""
        with np.errstate(invalid="ignore"):
            bad = ~((self.repetition_penalty > 0) & np.isfinite(self.repetition_penalty))
            for column in (self.frequency_penalty, self.presence_penalty):
                bad |= ~(np.abs(column) <= MAX_PENALTY)
            bad |= ~((self.min_p >= 0) & (self.min_p <= 1)) | (self.min_tokens < 0) | (self.prompt_len < 0)
            seq_of_stop = np.repeat(np.arange(self.size), self.stop_counts)
            bad[seq_of_stop[(self.stop_ids < 0) | (self.stop_ids >= vocab)]] = True
            seq_of_bias = np.repeat(np.arange(self.size), self.bias_counts)
            wrong = (self.bias_ids < 0) | (self.bias_ids >= vocab) | ~(np.abs(self.bias_values) <= MAX_LOGIT_BIAS)
            bad[seq_of_bias[wrong]] = True
        if not bad.any():
            return None
        b = int(np.flatnonzero(bad)[0])
        return b, self.item(b).problem(vocab) or "logits controls out of range"
