"""The OpenAI-compatible REST API: HTTP <-> GenerationEngine requests, nothing else.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics. Responses follow OpenAI's shapes; tandem adds the
request field `speculation` (auto|always|never) and the response object
`spec_stats` next to `usage` (summed over the choices, and in the final usage
chunk of a stream).

The app is module-level handlers over `app.state.engine` and
`app.state.settings` (ApiSettings), two middlewares (gateway/http_guards.py:
the API key, the body-size bound) and one error mapping
(gateway/openai_errors.py). Request bodies are parsed and checked in
gateway/openai_schema.py, responses shaped in gateway/openai_output.py.

Choices we made where OpenAI leaves room:
- A request the engine ends with finish_reason "abort" (e.g. the gateway is
  draining, or the target stayed unreachable past --target-wait) is a 503; in a
  stream that has started, an error event instead (then `data: [DONE]`). The
  message is the engine's reason when it gives one.
- A client that disconnects has its requests aborted in the engine at once.
- --api-key guards /v1/*; /health stays open for probes, and /metrics for
  scrapers unless `protect_metrics` is set.
- A body over `max_body_bytes` is a 413 (code "request_too_large").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.chat import chat_prompt_ids
from gateway.http_guards import DEFAULT_MAX_BODY_BYTES, ApiKeyMiddleware, BodyLimitMiddleware
from gateway.openai_errors import APIError, api_error_for, install_error_handlers
from gateway.openai_output import Choice, Job, sse
from gateway.openai_schema import (
    ChatCompletionRequest,
    CommonFields,
    CompletionRequest,
    check_logprobs,
    completion_prompts,
    parse_body,
    prompt_texts,
    sampling_kwargs,
)
from gateway.prompts import fit_max_tokens
from gateway.streams import NOT_READY_MESSAGE, AsyncDeltaStream, SubRequest, aborted_error
from gateway.types import GenerationEngine, GenerationParams
from tandem.errors import Unavailable

log = logging.getLogger("tandem.gateway.api")

# How often a request waiting for output checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


@dataclass(frozen=True, kw_only=True)
class ApiSettings:
    """What the REST app serves besides the engine. `model_names`: the names clients may ask
    for in `model`; responses name the model as requested, else the first."""

    model_names: tuple[str, ...]
    api_key: str | None = None
    protect_metrics: bool = False  # /metrics needs the key too
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.model_names or not all(self.model_names):
            raise ValueError(f"model_names must be non-empty names, got {self.model_names!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None (no key) or a non-empty string")
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protect_metrics needs an api_key")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    def protected(self, path: str) -> bool:
        """Whether `path` needs the API key (when there is one)."""
        return path == "/v1" or path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")


def create_app(engine: GenerationEngine, api_key: str | None = None,
               served_model_names: Sequence[str] | None = None, *, protect_metrics: bool = False,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The REST app over `engine`."""
    settings = ApiSettings(model_names=tuple(served_model_names or [engine.model_name]), api_key=api_key,
                           protect_metrics=protect_metrics, max_body_bytes=max_body_bytes)
    # FastAPI's own spans (newer releases make them once a tracer provider exists) are off:
    # gateway.tracing's middleware makes the /v1/ server spans, alike on every FastAPI release.
    app = FastAPI(title="tandem", description="OpenAI-compatible API of the tandem gateway", version="0.1.0",
                  telemetry={"tracing": False})
    app.state.engine, app.state.settings = engine, settings
    install_error_handlers(app)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    # The last added runs first: the key is checked before any of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, protected=settings.protected)
    return app


def _engine(request: Request) -> GenerationEngine:
    return request.app.state.engine


def _settings(request: Request) -> ApiSettings:
    return request.app.state.settings


# ---------------------------------------------------------------------------- routes

async def completions(request: Request) -> Response:
    engine, settings = _engine(request), _settings(request)
    req: CompletionRequest = await parse_body(request, CompletionRequest, settings.model_names)
    logprobs = check_logprobs(req)
    prompts = completion_prompts(engine.tokenizer, req.prompt, req.add_special_tokens is not False)
    echo = prompt_texts(engine.tokenizer, req.prompt, prompts) if req.echo else None
    job = _build_job(engine, settings, req, False, prompts, logprobs, req.max_tokens, echo)
    return await _run(request, engine, job, req.stream)


async def chat_completions(request: Request) -> Response:
    engine, settings = _engine(request), _settings(request)
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, settings.model_names)
    logprobs = check_logprobs(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = chat_prompt_ids(engine.tokenizer, req.messages, req.add_special_tokens)
    job = _build_job(engine, settings, req, True, [prompt], logprobs, max_tokens)
    return await _run(request, engine, job, req.stream)


async def models(request: Request) -> JSONResponse:
    engine, settings = _engine(request), _settings(request)
    return JSONResponse({"object": "list", "data": [
        {"id": n, "object": "model", "created": settings.started, "owned_by": "tandem",
         "root": engine.model_name, "max_model_len": engine.max_model_len} for n in settings.model_names]})


async def health(request: Request) -> Response:
    if _engine(request).ready():
        return JSONResponse({"status": "ok"})
    return APIError(503, NOT_READY_MESSAGE, "server_error",
                    code="service_unavailable").response()


async def metrics(request: Request) -> Response:
    metrics_obj = getattr(_engine(request), "metrics", None)
    registry = metrics_obj.registry if metrics_obj is not None else CollectorRegistry()
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------- running a job

def _build_job(engine: GenerationEngine, settings: ApiSettings, req: CommonFields, chat: bool,
               prompts: list[list[int]], logprobs: int | None, max_tokens: int | None,
               echo: list[str] | None = None) -> Job:
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    base = sampling_kwargs(req, logprobs)
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
            choices.append(Choice(index=index, echo=echo[p] if echo is not None else ""))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # As vLLM: cumulative usage on every chunk only when the final usage chunk is asked for too.
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
    return Job(chat=chat, response_id=response_id, model=req.model or settings.model_names[0],
               created=int(time.time()), prompt_lens=[len(ids) for ids in prompts],
               subrequests=subrequests, choices=choices, logprobs=logprobs is not None,
               include_usage=include_usage, continuous_usage=continuous)


async def _run(request: Request, engine: GenerationEngine, job: Job, streaming: bool) -> Response:
    if not engine.ready():
        raise Unavailable(NOT_READY_MESSAGE)
    # Submits now: refusals are 4xx/503 here. Its poll lets a quiet stream notice a gone client.
    stream = AsyncDeltaStream(engine, job.subrequests, poll_s=DISCONNECT_POLL_S)
    if streaming:
        return _SSEResponse(_events(request, job, stream), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _full_response(request, job, stream)


async def _full_response(request: Request, job: Job, stream: AsyncDeltaStream) -> Response:
    watch = _DisconnectWatch(request)
    async with stream:
        while not stream.done:
            item = await stream.get()
            if await watch.gone():
                log.info("%s: client disconnected, aborting", job.response_id)
                return Response(status_code=499)  # nobody reads it; leaving the block aborts
            if item is None:
                continue
            index, delta = item
            if (aborted := aborted_error(delta)) is not None:
                raise aborted
            job.choices[index].add(delta)
    return JSONResponse(job.full_response())


async def _events(request: Request, job: Job, stream: AsyncDeltaStream) -> AsyncIterator[str]:
    watch = _DisconnectWatch(request)
    try:
        async with stream:
            for chunk in job.opening_chunks():
                yield sse(chunk)
            aborted = None
            while not stream.done and aborted is None:
                item = await stream.get()
                if await watch.gone():
                    log.info("%s: client disconnected, aborting", job.response_id)
                    return
                # The deltas already waiting leave in one write: each write is a trip through the
                # server's send path, which a busy gateway pays per chunk of every stream.
                events = []
                while item is not None:
                    index, delta = item
                    if (aborted := aborted_error(delta)) is not None:
                        events.append(sse(api_error_for(aborted).body()))
                        break
                    choice = job.choices[index]
                    choice.add(delta)
                    # One choice object per chunk: OpenAI never repeats an index within a chunk.
                    events.extend(sse(job.chunk([obj], with_usage_field=job.include_usage))
                                  for obj in job.delta_choices(choice, delta))
                    item = stream.get_ready()
                if events:
                    yield "".join(events)
            if aborted is None and job.include_usage:
                yield sse(job.usage_chunk())
    except asyncio.CancelledError:
        log.info("%s: stream cancelled (client gone), aborting", job.response_id)
        raise
    except Exception as exc:  # headers are out: report in-band, never a stack trace
        log.error("%s: stream failed", job.response_id, exc_info=exc)
        yield sse(api_error_for(exc).body())
    yield sse("[DONE]")


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
