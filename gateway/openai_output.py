"""Response shapes of the REST API: full responses and server-sent-event chunks, as OpenAI writes them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.streams import SubRequest
from gateway.types import Delta, SpecStats, TokenLogprob


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    echo: str = ""  # the prompt's text, before the output (completions' echo)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    text_offset: int = 0  # characters of token text so far (completions logprobs' text_offset)

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        # The engine's counts and stats in a delta are the request's totals so far.
        self.completion_tokens = delta.completion_tokens
        self.spec = delta.spec
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def completion_logprobs(items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in items], "token_logprobs": [lp.logprob for lp in items],
            # OpenAI: the k most likely, plus the sampled token, which may make k + 1.
            "top_logprobs": [{**{t: v for _, t, v in lp.top}, lp.token: lp.logprob} for lp in items],
            "text_offset": offsets}


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": _bytes(lp.token),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)}
                                          for _, t, v in lp.top]} for lp in items],
            "refusal": None}


def usage(prompt_lens: Sequence[int], choices: Sequence[Choice]) -> dict[str, Any]:
    # A prompt is counted once however many choices it has, as OpenAI does.
    prompt_tokens = sum(prompt_lens)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_stats(choices: Sequence[Choice]) -> dict[str, int]:
    total = {"draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0, "plain_steps": 0}
    for c in choices:
        for k, v in c.spec.as_dict().items():
            total[k] += v
    return total


def sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class Job:
    """One API request after validation: its engine sub-requests and how to shape output."""

    chat: bool
    response_id: str
    model: str
    created: int
    prompt_lens: list[int]
    subrequests: list[SubRequest]
    choices: list[Choice]
    logprobs: bool
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage so far on every chunk

    def chunk(self, choice_objs: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.response_id,
                               "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choice_objs}
        if self.chat:
            out["system_fingerprint"] = None
        if usage is None and self.continuous_usage:
            usage = self.usage()
        if with_usage_field or usage is not None:
            out["usage"] = usage
        return out

    def usage(self) -> dict[str, Any]:
        """Usage so far (the final count once every choice has finished)."""
        return usage(self.prompt_lens, self.choices)

    def opening_chunks(self) -> list[dict[str, Any]]:
        """OpenAI opens each chat choice with the role; completions open only to echo the prompt."""
        if not self.chat:
            return [self.chunk([{"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}],
                               with_usage_field=self.include_usage) for c in self.choices if c.echo]
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}], with_usage_field=self.include_usage)
                for c in self.choices]

    def vllm_metrics(self) -> dict[str, Any] | None:
        """vLLM's per-request `metrics` object (speculative decoding statistics), for a single
        choice as vLLM sends it; None for several."""
        if len(self.choices) != 1:
            return None
        return {"speculative_decoding": self.choices[0].spec.vllm_dict()}

    def delta_choices(self, choice: Choice, delta: Delta) -> list[dict[str, Any]]:
        """Stream choice objects for one delta: new text (if any), then the finish (if final),
        each for a chunk of its own."""
        out = []
        items = delta.logprobs or ()
        if delta.text or items:
            if self.chat:
                lp = chat_logprobs(items) if self.logprobs else None
                out.append({"index": choice.index, "delta": {"content": delta.text}, "logprobs": lp,
                            "finish_reason": None})
            else:
                lp = completion_logprobs(items, choice.text_offset) if self.logprobs else None
                out.append({"index": choice.index, "text": delta.text, "logprobs": lp,
                            "finish_reason": None})
        choice.text_offset += sum(len(x.token) for x in items)
        if delta.finish_reason is not None:
            if self.chat:
                out.append({"index": choice.index, "delta": {}, "logprobs": None,
                            "finish_reason": delta.finish_reason})
            else:
                out.append({"index": choice.index, "text": "", "logprobs": None,
                            "finish_reason": delta.finish_reason})
        return out

    def usage_chunk(self) -> dict[str, Any]:
        final = self.chunk([], usage=self.usage())
        final["spec_stats"] = spec_stats(self.choices)
        final["metrics"] = self.vllm_metrics()
        return final

    def full_response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            if self.chat:
                choices.append({"index": c.index,
                                "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": chat_logprobs(c.logprobs) if self.logprobs else None,
                                "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.echo + text,
                                "logprobs": completion_logprobs(c.logprobs, 0) if self.logprobs else None,
                                "finish_reason": c.finish_reason})
        out = {"id": self.response_id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices,
               "usage": self.usage(), "spec_stats": spec_stats(self.choices), "metrics": self.vllm_metrics()}
        out["system_fingerprint"] = None
        return out
