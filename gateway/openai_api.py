"""The OpenAI-compatible REST API: HTTP <-> GenerationEngine requests, nothing else.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics. Responses follow OpenAI's shapes; tandem adds the
request field `speculation` (auto|always|never) and the response object
`spec_stats` next to `usage` (summed over the choices, and in the final usage
chunk of a stream).

Choices we made where OpenAI leaves room:
- Unknown request fields are rejected (400), as OpenAI does, and so are known
  fields with values we cannot honour (presence_penalty != 0, echo, tools...):
  a client must not get output that silently ignores what it asked for.
- n > 1 and list prompts run as independent engine requests; with a seed,
  choice i of a prompt uses seed + i so the choices differ but stay repeatable.
- A request the engine ends with finish_reason "abort" (e.g. the gateway is
  draining) is a 503; in a stream that has started, an error event instead.
- A client that disconnects has its requests aborted in the engine at once.
- --api-key guards /v1/*; /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.chat import chat_prompt_ids
from gateway.prompts import check_token_ids, fit_max_tokens, text_prompt_ids
from gateway.streams import AsyncDeltaStream, SubRequest
from gateway.types import MAX_LOGPROBS, Delta, GenerationEngine, GenerationParams, SpecStats, TokenLogprob
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable

log = logging.getLogger("tandem.gateway.api")

# How often a request waiting for output checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
MAX_N = 64
MAX_SEED = 2**63 - MAX_N
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


# ---------------------------------------------------------------------------- errors

class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error_for(exc: BaseException) -> APIError:
    """The one mapping from service errors to HTTP (the gRPC edge uses grpc_host.status_for)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidArgument):
        return APIError(400, str(exc), "invalid_request_error", code="invalid_argument")
    if isinstance(exc, ResourceExhausted):
        return APIError(429, str(exc) or "the server is at capacity, retry later", "rate_limit_error",
                        code="queue_full")
    if isinstance(exc, Unavailable):
        return APIError(503, str(exc) or "the server is not ready", "server_error",
                        code="service_unavailable")
    return APIError(500, "internal server error", "server_error", code="internal_error")


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                    code="invalid_value")


# ---------------------------------------------------------------------------- request bodies

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonFields(_Strict):
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
    # Accepted so that ordinary clients work; only their neutral values are honoured.
    user: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = 0
    min_p: float | None = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_CommonFields):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_CommonFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None


def _reject_unsupported(req: _CommonFields) -> None:
    """Fields we accept only at values that mean "off": anything else would be silently ignored."""
    neutral: list[tuple[str, bool]] = [
        ("frequency_penalty", req.frequency_penalty in (None, 0)),
        ("presence_penalty", req.presence_penalty in (None, 0)),
        ("repetition_penalty", req.repetition_penalty in (None, 1)),
        ("logit_bias", not req.logit_bias),
        ("min_tokens", req.min_tokens in (None, 0)),
        ("min_p", req.min_p in (None, 0)),
        ("skip_special_tokens", req.skip_special_tokens),
        ("include_stop_str_in_output", not req.include_stop_str_in_output),
    ]
    if isinstance(req, CompletionRequest):
        neutral += [("echo", not req.echo), ("suffix", req.suffix is None),
                    ("best_of", req.best_of is None or req.best_of == req.n)]
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


def _sampling(req: _CommonFields, logprobs: int | None) -> dict[str, Any]:
    """GenerationParams keyword arguments common to every choice (max_tokens and seed come later)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    top_k = req.top_k or 0
    if top_k == -1:
        top_k = 0
    return dict(temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                logprobs=logprobs, speculation=req.speculation)


def _completion_prompts(tokenizer: Any, prompt: Any) -> list[list[int]]:
    """OpenAI's four prompt forms: str, [str], [int], [[int]]."""
    if isinstance(prompt, str):
        return [text_prompt_ids(tokenizer, prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [text_prompt_ids(tokenizer, p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [check_token_ids(prompt)]
        if all(isinstance(p, list) and p for p in prompt):
            return [check_token_ids(p) for p in prompt]
    raise APIError(400, "prompt must be a non-empty string, list of strings, list of token ids or "
                        "list of token id lists", param="prompt")


# ---------------------------------------------------------------------------- output shaping

def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@dataclass
class _Choice:
    """What one choice has produced so far."""

    index: int
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


def _completion_logprobs(items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in items], "token_logprobs": [lp.logprob for lp in items],
            # OpenAI: the k most likely, plus the sampled token, which may make k + 1.
            "top_logprobs": [{**{t: v for _, t, v in lp.top}, lp.token: lp.logprob} for lp in items],
            "text_offset": offsets}


def _chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": _bytes(lp.token),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)}
                                          for _, t, v in lp.top]} for lp in items],
            "refusal": None}


def _usage(prompt_lens: Sequence[int], choices: Sequence[_Choice]) -> dict[str, Any]:
    # A prompt is counted once however many choices it has, as OpenAI does.
    prompt_tokens = sum(prompt_lens)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _spec_stats(choices: Sequence[_Choice]) -> dict[str, int]:
    total = {"draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0, "plain_steps": 0}
    for c in choices:
        for k, v in c.spec.as_dict().items():
            total[k] += v
    return total


def _sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


ABORTED_MESSAGE = "the server ended the request before it finished (it may be shutting down); retry"


@dataclass
class _Job:
    """One API request after validation: its engine sub-requests and how to shape output."""

    chat: bool
    response_id: str
    model: str
    created: int
    prompt_lens: list[int]
    subrequests: list[SubRequest]
    choices: list[_Choice]
    logprobs: bool
    include_usage: bool

    def chunk(self, choice_objs: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.response_id,
                               "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choice_objs}
        if self.chat:
            out["system_fingerprint"] = None
        if with_usage_field or usage is not None:
            out["usage"] = usage
        return out

    def delta_choices(self, choice: _Choice, delta: Delta) -> list[dict[str, Any]]:
        """Stream choice objects for one delta: new text (if any), then the finish (if final),
        each for a chunk of its own."""
        out = []
        items = delta.logprobs or ()
        if delta.text or items:
            if self.chat:
                lp = _chat_logprobs(items) if self.logprobs else None
                out.append({"index": choice.index, "delta": {"content": delta.text}, "logprobs": lp,
                            "finish_reason": None})
            else:
                lp = _completion_logprobs(items, choice.text_offset) if self.logprobs else None
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

    def full_response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            if self.chat:
                choices.append({"index": c.index,
                                "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": _chat_logprobs(c.logprobs) if self.logprobs else None,
                                "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": text,
                                "logprobs": _completion_logprobs(c.logprobs, 0) if self.logprobs else None,
                                "finish_reason": c.finish_reason})
        out = {"id": self.response_id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices,
               "usage": _usage(self.prompt_lens, self.choices), "spec_stats": _spec_stats(self.choices)}
        out["system_fingerprint"] = None
        return out


# ---------------------------------------------------------------------------- the app

def create_app(engine: GenerationEngine, api_key: str | None = None,
               served_model_names: Sequence[str] | None = None) -> FastAPI:
    """The REST app over `engine`. `served_model_names`: the names clients may ask for in
    `model` (default: engine.model_name); responses name the model as requested, else the first."""
    names = list(served_model_names or [engine.model_name])
    started = int(time.time())
    # FastAPI's own spans (newer releases make them once a tracer provider exists) are off:
    # gateway.tracing's middleware makes the /v1/ server spans, alike on every FastAPI release.
    app = FastAPI(title="tandem", description="OpenAI-compatible API of the tandem gateway",
                  version="0.1.0", telemetry={"tracing": False})

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()  # OpenAI says 400 where FastAPI says 422

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return api_error_for(exc).response()  # never a stack trace to the client

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           "invalid_request_error", code="invalid_api_key")

    async def parse(request: Request, model_type: type[_CommonFields]) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = model_type.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if req.model is not None and req.model not in names:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                           code="model_not_found")
        _reject_unsupported(req)
        return req

    def build_job(req: _CommonFields, chat: bool, prompts: list[list[int]], logprobs: int | None,
                  max_tokens: int | None) -> _Job:
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        base = _sampling(req, logprobs)
        total = len(prompts) * req.n
        subrequests, choices = [], []
        for p, ids in enumerate(prompts):
            fitted = fit_max_tokens(len(ids), max_tokens, engine.max_model_len,
                                    None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
            for i in range(req.n):
                index = p * req.n + i
                seed = None if req.seed is None else req.seed + i
                params = GenerationParams(max_tokens=fitted, seed=seed, **base)
                rid = response_id if total == 1 else f"{response_id}-{index}"
                subrequests.append(SubRequest(rid, ids, params))
                choices.append(_Choice(index=index))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Job(chat=chat, response_id=response_id, model=req.model or names[0],
                    created=int(time.time()), prompt_lens=[len(ids) for ids in prompts],
                    subrequests=subrequests, choices=choices, logprobs=logprobs is not None,
                    include_usage=include_usage)

    def open_stream(job: _Job) -> AsyncDeltaStream:
        if not engine.ready():
            raise Unavailable("the engine is not ready (loading or draining)")
        return AsyncDeltaStream(engine, job.subrequests)

    async def run(request: Request, job: _Job, streaming: bool) -> Response:
        try:
            stream = open_stream(job)
        except (InvalidArgument, ResourceExhausted, Unavailable) as exc:
            raise api_error_for(exc) from exc
        if streaming:
            return _SSEResponse(_events(request, job, stream), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _full_response(request, job, stream)

    async def _full_response(request: Request, job: _Job, stream: AsyncDeltaStream) -> Response:
        watch = _DisconnectWatch(request)
        async with stream:
            while not stream.done:
                item = await stream.get(DISCONNECT_POLL_S)
                if await watch.gone():
                    log.info("%s: client disconnected, aborting", job.response_id)
                    return Response(status_code=499)  # nobody reads it; leaving the block aborts
                if item is None:
                    continue
                index, delta = item
                if delta.finish_reason == "abort":
                    raise api_error_for(Unavailable(ABORTED_MESSAGE))
                job.choices[index].add(delta)
        return JSONResponse(job.full_response())

    async def _events(request: Request, job: _Job, stream: AsyncDeltaStream) -> AsyncIterator[str]:
        watch = _DisconnectWatch(request)
        try:
            async with stream:
                if job.chat:  # OpenAI opens each choice with the role
                    for c in job.choices:
                        yield _sse(job.chunk([{"index": c.index,
                                               "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}],
                                             with_usage_field=job.include_usage))
                while not stream.done:
                    item = await stream.get(DISCONNECT_POLL_S)
                    if await watch.gone():
                        log.info("%s: client disconnected, aborting", job.response_id)
                        return
                    if item is None:
                        continue
                    index, delta = item
                    if delta.finish_reason == "abort":
                        yield _sse(api_error_for(Unavailable(ABORTED_MESSAGE)).body())
                        break
                    choice = job.choices[index]
                    choice.add(delta)
                    # One choice object per chunk: OpenAI never repeats an index within a chunk.
                    for obj in job.delta_choices(choice, delta):
                        yield _sse(job.chunk([obj], with_usage_field=job.include_usage))
                else:
                    if job.include_usage:
                        final = job.chunk([], usage=_usage(job.prompt_lens, job.choices))
                        final["spec_stats"] = _spec_stats(job.choices)
                        yield _sse(final)
        except asyncio.CancelledError:
            log.info("%s: stream cancelled (client gone), aborting", job.response_id)
            raise
        except Exception as exc:  # headers are out: report in-band, never a stack trace
            log.error("%s: stream failed", job.response_id, exc_info=exc)
            yield _sse(api_error_for(exc).body())
        yield _sse("[DONE]")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req: CompletionRequest = await parse(request, CompletionRequest)
        try:
            if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
            prompts = _completion_prompts(engine.tokenizer, req.prompt)
            job = build_job(req, False, prompts, req.logprobs, req.max_tokens)
        except InvalidArgument as exc:
            raise api_error_for(exc) from exc
        return await run(request, job, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        try:
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
                               param="top_logprobs")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            prompt = chat_prompt_ids(engine.tokenizer, req.messages)
            job = build_job(req, True, [prompt], logprobs, max_tokens)
        except InvalidArgument as exc:
            raise api_error_for(exc) from exc
        return await run(request, job, req.stream)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": started, "owned_by": "tandem",
             "root": engine.model_name, "max_model_len": engine.max_model_len} for n in names]})

    @app.get("/health")
    async def health() -> Response:
        if engine.ready():
            return JSONResponse({"status": "ok"})
        return APIError(503, "the engine is not ready (loading or draining)", "server_error",
                        code="service_unavailable").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        metrics_obj = getattr(engine, "metrics", None)
        registry = metrics_obj.registry if metrics_obj is not None else CollectorRegistry()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _DisconnectWatch:
    """Asks the server whether the client is gone, at most every DISCONNECT_POLL_S seconds,
    whether or not output is flowing (a busy stream must notice too)."""

    def __init__(self, request: Request):
        self.request = request
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def gone(self) -> bool:
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + DISCONNECT_POLL_S
        return await self.request.is_disconnected()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator, so the generator's
    cleanup (aborting unfinished engine requests) runs even when sending fails because
    the client went away, instead of whenever the garbage collector gets to it."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
