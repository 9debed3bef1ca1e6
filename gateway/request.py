"""A request as the gateway owns it: the source of truth for everything else.

Target KV, draft KV and step plans are all derived from its tokens (`prompt`
then `output`) and the counters here, so a request can be rebuilt anywhere
from this object alone (preemption re-prefills from it; a new draft replica
catches up from it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from draft_service.types import DraftBudget, IngestItem
from gateway.acceptance import LevelRates, MainPath
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.types import Delta, DeltaSink, FinishReason, GenerationParams, SpecStats, TokenLogprob
from target_service.controls import LogitsControls


class Phase(enum.Enum):
    WAITING = "waiting"  # not admitted; holds no KV anywhere
    RUNNING = "running"  # admitted: prefilling or decoding
    FINISHED = "finished"


@dataclass
class AcceptanceStats:
    """Online acceptance per speculation budget: mean drafted tokens accepted per verify step."""

    totals: dict[DraftBudget, list[float]] = field(default_factory=dict)  # budget -> [sum, n]
    # Per level of this request's verified main paths (what prices the depth options for it).
    levels: LevelRates = field(default_factory=lambda: LevelRates(decay=AcceptanceStats.DECAY))
    # The same undecayed, for the book's spread of requests (AcceptanceBook.request_ended): budget -> [trees,
    # sum, sum of squares], and [main paths, paths whose first level was accepted].
    raw: dict[DraftBudget, list[float]] = field(default_factory=dict)
    first_level: list[float] = field(default_factory=lambda: [0.0, 0.0])

    DECAY = 0.8  # per record: exponential decay keeps the estimate tracking the text the request is producing now

    def record(self, budget: DraftBudget, accepted: int) -> None:
        s = self.totals.setdefault(budget, [0.0, 0.0])
        s[0] = self.DECAY * s[0] + accepted
        s[1] = self.DECAY * s[1] + 1.0
        raw = self.raw.setdefault(budget, [0.0, 0.0, 0.0])
        raw[0] += 1.0
        raw[1] += accepted
        raw[2] += accepted * accepted

    def record_path(self, path: MainPath) -> None:
        """A verified tree's main path: its levels, and its first level for the spread."""
        self.levels.record(path)
        if path.depth >= 1:
            self.first_level[0] += 1.0
            self.first_level[1] += path.accepted >= 1

    def age(self, refreshed: Iterable[DraftBudget]) -> None:
        """A tree was verified that measured only the budgets in `refreshed`: every other budget's figure ages
        as a record would age it, so that its weight against the book's counts this request's trees since it
        was measured, not its own records. Why: `auto` drafts the option whose figure is highest, so an
        option whose last few trees happened to accept little is not drafted, and its figure, never
        refreshed, stayed low for the rest of the request. On the H100 scale track (0.6, where each tree's
        acceptance is drawn afresh: a request's past says nothing of its next tree) the configured tree's
        prediction read 0.82-0.94 of what `always` committed a step at 1-8 requests (2026-12-06), and a
        simulation of the book and these figures with that draw put it at 1.14 accepted a tree against the
        draw's 1.38; aged so, at 1.31."""
        kept = set(refreshed)
        for budget, s in self.totals.items():
            if budget not in kept:
                s[0] *= self.DECAY
                s[1] *= self.DECAY

    def fade(self, factor: float) -> None:
        """Forget a little: a request that stopped speculating on a bad start is not stuck
        with it; as its history fades the global estimate takes over and it tries again."""
        for s in self.totals.values():
            s[0] *= factor
            s[1] *= factor
        self.levels.fade(factor)

    def mean(self, budget: DraftBudget) -> tuple[float, float] | None:
        s = self.totals.get(budget)
        return None if not s or s[1] == 0 else (s[0] / s[1], s[1])


@dataclass(eq=False)
class DraftLink:
    """A request's state on its draft replica, as the gateway knows it. Owned by the
    step loop's thread; replica workers report back through the core's queue."""

    replica: int  # index into the draft pool
    sent: int = 0  # tokens the replica has been sent (committed + pending)
    caught_up: bool = False  # the replica has applied an ingest since the last gap in what it was sent
    # An ingest of this request has gone to the replica (not merely queued in the gateway). Until then
    # the request may draft although not caught up: its draft call goes out right behind the queued
    # ingest of its prompt, and the replica applies them in that order (GatewayCore._draft_ready).
    flushed: bool = False
    pending: IngestItem | None = None  # new tokens/features held for the next draft call
    # The replica may hold state for the request (it was sent tokens, or features were pushed to it):
    # only then does the request's end need a Release call there.
    known: bool = False


@dataclass(eq=False, kw_only=True)
class Request:
    """Compares by identity: requests live in lists that the loop removes them from."""

    request_id: str
    prompt: list[int]
    params: GenerationParams
    sink: DeltaSink
    eos_ids: frozenset[int]
    tokenizer: object
    max_model_len: int
    arrival: float = field(default_factory=time.monotonic)

    phase: Phase = Phase.WAITING
    output: list[int] = field(default_factory=list)  # emitted tokens; the last is pending on the target
    target_len: int = 0  # tokens whose KV the target holds
    target_created: bool = False
    draft: DraftLink | None = None  # None: no replica (speculation off, or none healthy)
    stats: SpecStats = field(default_factory=SpecStats)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: FinishReason | None = None
    stopped_by_string: bool = False  # finished on a stop string (which the target does not know)
    num_preemptions: int = 0
    span: object | None = None  # OpenTelemetry span, ended when the request finishes

    def __post_init__(self) -> None:
        p = self.params
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt[-4:], p.skip_special_tokens)
        self._stops = StopMatcher(p.stop, p.include_stop_str_in_output)
        self.logits_controls = LogitsControls(
            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty, min_p=p.min_p, min_tokens=p.min_tokens,
            prompt_len=len(self.prompt), stop_ids=tuple(sorted(self.target_stop_ids)) if p.min_tokens else (),
            logit_bias=p.logit_bias)

    # --- derived ----------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, stop: int | None = None) -> list[int]:
        """(prompt + output)[start:stop], without building that whole list."""
        n = len(self.prompt)
        stop = self.num_tokens if stop is None else min(stop, self.num_tokens)
        if start >= n:
            return self.output[start - n: stop - n]
        return self.prompt[start: stop] + self.output[: max(0, stop - n)]

    @property
    def unsent(self) -> list[int]:
        """Tokens the target has not written KV for (prefill remainder, or the pending token)."""
        return self.token_slice(self.target_len)

    @property
    def target_stop_ids(self) -> frozenset[int]:
        """Token ids after which the request stops: what a grant's target must know."""
        eos = frozenset() if self.params.ignore_eos else self.eos_ids
        return eos | frozenset(self.params.stop_token_ids)

    # --- the one place results land ---------------------------------------
    def commit(self, new_tokens: list[int], logprobs: list[float],
               top_logprobs: list[tuple[list[int], list[float]]], num_committed: int,
               spec: SpecStats) -> Delta | None:
        """Apply a step's result. `new_tokens` are accepted drafted tokens then the bonus token.

        Tokens past a stop, an end-of-sequence or max_tokens are dropped here, by
        count, and nowhere else; the request then finishes and its KV is released.
        """
        self.target_len = num_committed
        self.stats = spec
        now = time.monotonic()
        if self.first_token_at is None and new_tokens:
            self.first_token_at = now
        kept: list[int] = []
        text = ""
        lps: list[TokenLogprob] = []
        head = self._head_that_continues(new_tokens)
        if head:  # no stop string to find token by token, and none of these ends the output: one decode
            kept.extend(new_tokens[:head])
            self.output.extend(kept)
            if self.params.logprobs is not None:
                lps.extend(self._logprob(tok, logprobs[i], top_logprobs[i] if top_logprobs else None)
                           for i, tok in enumerate(kept))
            text = self._stops.feed(self._detok.push_many(kept))[0]
        for i, tok in enumerate(new_tokens[head:], start=head):
            kept.append(tok)
            self.output.append(tok)
            piece = self._detok.push(tok)
            if self.params.logprobs is not None:
                lps.append(self._logprob(tok, logprobs[i], top_logprobs[i] if top_logprobs else None))
            is_eos = tok in self.eos_ids and not self.params.ignore_eos
            if is_eos or tok in self.params.stop_token_ids:
                if self.params.include_stop_str_in_output:  # as vLLM: the stop token's text too
                    text += self._stops.feed(piece, match=False)[0]
                text += self._final_text()[0]
                self.finish_reason = FinishReason.STOP
                break
            # As vLLM: no stop string ends the output before min_tokens.
            emitted, hit = self._stops.feed(piece, match=len(self.output) >= self.params.min_tokens)
            text += emitted
            if hit:
                self.finish_reason = FinishReason.STOP
                self.stopped_by_string = True
                break
            if len(self.output) >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
                tail, hit = self._final_text()
                text += tail
                self.finish_reason = FinishReason.STOP if hit else FinishReason.LENGTH
                self.stopped_by_string = hit
                break
        self.last_token_at = now
        if self.finish_reason:
            self.phase = Phase.FINISHED
        return Delta(token_ids=tuple(kept), text=text,
                     logprobs=tuple(lps) if self.params.logprobs is not None else None,
                     finish_reason=self.finish_reason, prompt_tokens=len(self.prompt),
                     completion_tokens=len(self.output), spec=self.stats)

    def _head_that_continues(self, new_tokens: list[int]) -> int:
        """How many of a step's first tokens can be committed without looking at their text: none where a
        stop string is set (it is found token by token); else those before any token that ends the output
        (an end-of-sequence or stop token id, max_tokens, the model's length), which goes token by token."""
        if self.params.stop or len(new_tokens) < 2:
            return 0
        ends = self.target_stop_ids
        room = min(self.params.max_tokens - len(self.output), self.max_model_len - self.num_tokens) - 1
        head = min(len(new_tokens), max(room, 0))
        for i, tok in enumerate(new_tokens[:head]):
            if tok in ends:
                return i
        return head

    def _logprob(self, tok: int, lp: float, top: tuple[list[int], list[float]] | None) -> TokenLogprob:
        def text(t: int) -> str:
            return self.tokenizer.decode([t])
        tops = tuple((t, text(t), v) for t, v in zip(*top, strict=True)) if top else ()
        return TokenLogprob(tok, text(tok), lp, tops[: self.params.logprobs])

    def _final_text(self) -> tuple[str, bool]:
        """The text still held back once the output ends: the detokenizer's last piece (an
        incomplete character decodes as U+FFFD), then what the stop matcher held. Returns
        (text, whether that last piece completed a stop string: the text ends before it)."""
        emitted, hit = self._stops.feed(self._detok.flush())
        return (emitted, True) if hit else (emitted + self._stops.flush(), False)

    def finish(self, reason: FinishReason, error: str | None = None) -> Delta:
        """End the request now; `error` tells the client why an aborted request ended."""
        self.finish_reason = reason
        self.phase = Phase.FINISHED
        return Delta(token_ids=(), text=self._final_text()[0] if reason != FinishReason.ABORT else "", logprobs=None,
                     finish_reason=reason, prompt_tokens=len(self.prompt), completion_tokens=len(self.output),
                     spec=self.stats, error=error)

    def reset_for_recompute(self) -> None:
        """Preempted: the target and draft forgot this request; it resumes from its tokens."""
        self.phase = Phase.WAITING
        self.target_len = 0
        self.target_created = False
        self.draft = None
        self.num_preemptions += 1
