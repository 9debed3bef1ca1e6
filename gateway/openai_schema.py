"""Request bodies of the REST API: parsing, validation and what they ask the engine for.

Choices we made where OpenAI leaves room:
- Unknown request fields are rejected (400), as OpenAI does, and so are known
  fields with values we cannot honour (suffix, tools, echo with logprobs...):
  a client must not get output that silently ignores what it asked for.
- Every sampling control vLLM's OpenAI server takes and that means something
  here is honoured with vLLM's meaning: frequency/presence/repetition
  penalties, logit_bias, min_tokens, min_p (applied by the target on every
  decode path), echo, include_stop_str_in_output, skip_special_tokens,
  add_special_tokens, stream_options.continuous_usage_stats;
  stream_options.include_obfuscation is accepted and has no effect, as its
  padding protects nothing on this server.
- n > 1 and list prompts run as independent engine requests; with a seed,
  choice i of a prompt uses seed + i so the choices differ but stay repeatable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.openai_errors import APIError, validation_error
from gateway.prompts import check_token_ids, text_prompt_ids
from gateway.types import MAX_LOGPROBS

MAX_N = 64
MAX_SEED = 2**63 - MAX_N


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: cumulative usage on every chunk (with include_usage)
    include_obfuscation: bool | None = None  # OpenAI: accepted, no effect here


class CommonFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off (vLLM's convention)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: Literal["auto", "always", "never"] | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int | None = 0
    min_p: float | None = 0.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's default; only it is honoured
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None  # None: completions add them (BOS), chat does not (the template does)
    # Accepted so that ordinary clients work; they change nothing here.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(CommonFields):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(CommonFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None


def reject_unsupported(req: CommonFields) -> None:
    """Fields we accept only at values that mean "off": anything else would be silently ignored."""
    neutral: list[tuple[str, bool]] = [("spaces_between_special_tokens", req.spaces_between_special_tokens)]
    if isinstance(req, CompletionRequest):
        neutral += [("suffix", req.suffix is None), ("best_of", req.best_of is None or req.best_of == req.n)]
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported: it needs the prompt's log-probs, which "
                                "this server does not compute", param="echo", code="unsupported_value")
    if isinstance(req, ChatCompletionRequest):
        neutral += [("tools", not req.tools),
                    ("tool_choice", req.tool_choice in (None, "none", "auto")),
                    ("response_format", req.response_format in (None, {"type": "text"})),
                    ("modalities", req.modalities in (None, ["text"]))]
    for name, ok in neutral:
        if not ok:
            raise APIError(400, f"{name}={getattr(req, name)!r} is not supported by this server",
                           param=name, code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if req.seed is not None and not 0 <= req.seed < MAX_SEED:
        # Seeds travel as uint64 to the target; choice i uses seed + i.
        raise APIError(400, f"seed must be between 0 and {MAX_SEED - 1}, got {req.seed}", param="seed")
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):  # JSON has no NaN, but Python's parser reads it
            raise APIError(400, f"{name} must be a finite number, got {value!r}", param=name)
    if req.top_k is not None and req.top_k < -1:
        raise APIError(400, f"top_k must be -1, 0 (off) or positive, got {req.top_k}", param="top_k")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise APIError(400, f"{name} must be a finite number, got {value!r}", param=name)
    logit_bias(req)


def logit_bias(req: CommonFields) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs; keys must spell token ids (OpenAI's form)."""
    pairs = []
    for key, value in (req.logit_bias or {}).items():
        if not key.strip().isdigit() or len(key) > 12:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if not math.isfinite(value):
            raise APIError(400, f"logit_bias values must be finite numbers, got {value!r}", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def check_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The number of top log-probs each token reports, or None for none."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def sampling_kwargs(req: CommonFields, logprobs: int | None) -> dict[str, Any]:
    """GenerationParams keyword arguments common to every choice (max_tokens and seed come later)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    top_k = req.top_k or 0
    if top_k == -1:
        top_k = 0
    return dict(temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                logprobs=logprobs, speculation=req.speculation,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
                min_p=req.min_p or 0.0, min_tokens=req.min_tokens or 0, logit_bias=logit_bias(req),
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens)


def prompt_texts(tokenizer: Any, prompt: Any, ids: list[list[int]]) -> list[str]:
    """Each prompt as text (what echo repeats): as written, or decoded from its token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [tokenizer.decode(p) for p in ids]


def completion_prompts(tokenizer: Any, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
    """OpenAI's four prompt forms: str, [str], [int], [[int]]."""
    if isinstance(prompt, str):
        return [text_prompt_ids(tokenizer, prompt, add_special_tokens)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [text_prompt_ids(tokenizer, p, add_special_tokens) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [check_token_ids(prompt)]
        if all(isinstance(p, list) and p for p in prompt):
            return [check_token_ids(p) for p in prompt]
    raise APIError(400, "prompt must be a non-empty string, list of strings, list of token ids or "
                        "list of token id lists", param="prompt")


def _check_encodable(body: dict[str, Any]) -> None:
    """JSON's \\u escapes can spell a lone surrogate, which is no character: a tokenizer cannot
    take it and an error message echoing it cannot be encoded. Refuse it here, as a 400."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"the request body is not valid Unicode: {exc.reason} in a string",
                       code="invalid_json") from None


async def parse_body(request: Request, model_type: type[CommonFields], model_names: Sequence[str]) -> Any:
    """The request body as `model_type`: a 400 for anything that is not one, a 404 for an unknown model."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    _check_encodable(body)
    try:
        req = model_type.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.model is not None and req.model not in model_names:
        raise APIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
    reject_unsupported(req)
    return req
