"""gRPC edge of the gateway (tandem.v1.Generation): protobuf <-> engine requests, nothing else.

Same semantics as the REST API (gateway/openai_api.py): the same length rule
and defaults, and a request the engine ends with "abort" (e.g. draining, or a
target that stayed unreachable past --target-wait) is UNAVAILABLE, with the
engine's reason as the message when it gives one. A call the client cancels, or whose deadline passes, is aborted in
the engine at once.

Requests arrive as bytes and are parsed here, so that one grpc would fail to
parse (a string field that is not UTF-8) is INVALID_ARGUMENT, not grpc's
INTERNAL. A full queue is RESOURCE_EXHAUSTED with a retry delay, as REST's
429 has Retry-After: google.rpc.RetryInfo in the status details
(`grpc-status-details-bin`) and plain `retry-after` (seconds) trailing metadata.
"""

from __future__ import annotations

import logging
import uuid

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from gateway.prompts import check_token_ids, fit_max_tokens, text_prompt_ids
from gateway.streams import NOT_READY_MESSAGE, RETRY_AFTER_S, aborted_error, iter_deltas
from gateway.types import Delta, GenerationEngine, GenerationParams, TokenLogprob
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from tandem.grpc_host import ServiceHost, status_for
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("tandem.gateway.grpc")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_MAX_TOKENS = 16  # as REST /v1/completions


def retry_trailers(code: grpc.StatusCode, message: str, seconds: int) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata telling a client when to retry: RetryInfo in the rich status, and plainly."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds)))
    status = status_pb2.Status(code=code.value[0], message=message, details=[info])
    return (("grpc-status-details-bin", status.SerializeToString()), ("retry-after", str(seconds)))


def abort_with(context: grpc.ServicerContext, exc: BaseException, request_id: str | None = None) -> None:
    """End the call with the status `exc` maps to (the one mapping, grpc_host.status_for); a
    refused request is logged once, at warning level, with its code, param and request id."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("Generate failed", exc_info=exc)
    else:
        log.warning("rejected Generate (request %s): %s, param=%s: %s", request_id or "unparsed", code.name,
                    getattr(exc, "param", None), message)
    if isinstance(exc, ResourceExhausted):
        context.set_trailing_metadata(retry_trailers(code, message, RETRY_AFTER_S))
    context.abort(code, message)


def _float(value: float) -> float:
    # proto floats are float32: 0.7 arrives as 0.699999988; give the engine the number the client wrote.
    return float(f"{value:.7g}")


def parse_request(raw: bytes) -> generation_pb2.GenerateRequest:
    try:
        return generation_pb2.GenerateRequest.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgument(f"the request is not a valid tandem.v1.GenerateRequest: {exc}") from None


def request_from_proto(m: generation_pb2.GenerateRequest, tokenizer, max_model_len: int
                       ) -> tuple[list[int], GenerationParams]:
    if m.prompt and m.prompt_token_ids:
        raise InvalidArgument("set either prompt or prompt_token_ids, not both")
    if m.prompt_token_ids:
        prompt = check_token_ids(m.prompt_token_ids)
    elif m.prompt:
        prompt = text_prompt_ids(tokenizer, m.prompt)
    else:
        raise InvalidArgument("the prompt is empty: set prompt or prompt_token_ids")
    max_tokens = fit_max_tokens(len(prompt), m.max_tokens or None, max_model_len, DEFAULT_MAX_TOKENS)
    params = GenerationParams(
        max_tokens=max_tokens,
        temperature=_float(m.temperature) if m.HasField("temperature") else 1.0,
        top_p=_float(m.top_p) if m.HasField("top_p") else 1.0,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        speculation=m.speculation or None,
        repetition_penalty=_float(m.repetition_penalty) if m.HasField("repetition_penalty") else 1.0,
        frequency_penalty=_float(m.frequency_penalty), presence_penalty=_float(m.presence_penalty),
        min_p=_float(m.min_p), min_tokens=m.min_tokens,
        logit_bias=tuple((int(t), _float(b)) for t, b in sorted(m.logit_bias.items())),
        include_stop_str_in_output=m.include_stop_str_in_output,
        skip_special_tokens=m.skip_special_tokens if m.HasField("skip_special_tokens") else True)
    return prompt, params


def _logprob_to_proto(lp: TokenLogprob) -> generation_pb2.GeneratedTokenLogprob:
    return generation_pb2.GeneratedTokenLogprob(
        token=generation_pb2.TokenLogprob(token_id=lp.token_id, token=lp.token, logprob=lp.logprob),
        top=[generation_pb2.TokenLogprob(token_id=i, token=t, logprob=v) for i, t, v in lp.top])


def delta_to_proto(request_id: str, delta: Delta) -> generation_pb2.GenerateResponse:
    out = generation_pb2.GenerateResponse(
        request_id=request_id, token_ids=delta.token_ids, text=delta.text,
        logprobs=[_logprob_to_proto(lp) for lp in delta.logprobs or ()])
    if delta.finish_reason is not None:
        out.finish_reason = delta.finish_reason
        out.usage.CopyFrom(generation_pb2.Usage(
            prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
            total_tokens=delta.prompt_tokens + delta.completion_tokens))
        out.spec_stats.CopyFrom(generation_pb2.SpecStats(**delta.spec.as_dict()))
    return out


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: GenerationEngine):
        self.engine = engine

    def Generate(self, raw: bytes, context):
        request_id = None
        try:
            request = parse_request(raw)  # _add_to_server registers no deserializer: see the module doc
            request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
            yield from self._generate(request_id, request, context)
        except Exception as exc:  # the one place service errors reach the wire
            abort_with(context, exc, request_id)

    def _generate(self, request_id: str, request: generation_pb2.GenerateRequest, context):
        prompt, params = request_from_proto(request, self.engine.tokenizer, self.engine.max_model_len)
        if not self.engine.ready():
            raise Unavailable(NOT_READY_MESSAGE)
        stream = iter_deltas(self.engine, request_id, prompt, params)
        # Runs when the call ends for any reason; only a call ending early (cancelled,
        # deadline, connection lost) still has a request to abort.
        if not context.add_callback(stream.cancel):
            stream.cancel()
        for delta in stream:
            if (aborted := aborted_error(delta)) is not None:
                raise aborted
            if delta.token_ids or delta.text or delta.finish_reason is not None:
                yield delta_to_proto(request_id, delta)


def _add_to_server(servicer: GenerationServicer, server: grpc.Server) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server, but the request reaches Generate unparsed."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=None,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Generate": handler}),))


def add_generation_service(host: ServiceHost, engine: GenerationEngine) -> GenerationServicer:
    """Serve tandem.v1.Generation over `engine` on `host` (whose health the caller manages)."""
    servicer = GenerationServicer(engine)
    host.add(_add_to_server, servicer)
    return servicer
