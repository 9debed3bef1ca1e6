"""gRPC clients of the target and draft services: plain dataclasses in and out."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.tree_wire import trees_from_proto
from draft_service.types import DraftBudget, DraftTree, IngestItem
from tandem import timeline
from tandem.channels import open_channel
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from tandem.grpc_tracing import instrument_channel
from tandem.lane import LaneRefused, LaneStream
from tandem.telemetry import stream_call_span
from tandem.tensors import list_to_proto, tensor_to_proto
from tandem.tls import ClientTLS
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.types import KvLoad, SequenceResult, SequenceStep
from target_service.wire import GrantStops, items_to_proto, results_from_proto

log = logging.getLogger(__name__)


def _load(m: common_pb2.KvLoad) -> KvLoad:
    return KvLoad(num_sequences=m.num_sequences, block_size=m.block_size, total_blocks=m.total_blocks,
                  free_blocks=m.free_blocks)


class TargetUnavailable(Unavailable):
    """The target could not be reached (a call or the step stream failed in transport, or the
    stream ended): it may have died or be restarting. The gateway then waits for it to return
    and re-prefills its requests. An error the target itself reports is not this."""


def _raise_mapped(err: grpc.RpcError, who: str, unavailable: type[Unavailable] = Unavailable):
    code = err.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidArgument(f"{who}: {err.details()}") from err
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise ResourceExhausted(f"{who}: {err.details()}") from err
    raise unavailable(f"{who} failed: {code.name}: {err.details()}") from err


def _check_health(channel: grpc.Channel, timeout: float) -> int:
    """The service's gRPC health status; grpc.RpcError when it does not answer."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                     timeout=timeout).status


def _health_status(channel: grpc.Channel, timeout: float) -> int | None:
    """The service's gRPC health status, or None when it does not answer."""
    try:
        return _check_health(channel, timeout)
    except grpc.RpcError:
        return None


def wait_healthy(channel: grpc.Channel, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if _health_status(channel, 2) == health_pb2.HealthCheckResponse.SERVING:
            return
        if time.monotonic() > deadline:
            raise Unavailable("service did not become healthy in time")
        time.sleep(0.2)


@dataclass(frozen=True)
class TargetInfo:
    model_name: str
    vocab_size: int
    hidden_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    default_feature_layers: tuple[int, ...]
    load: KvLoad


_END_OF_CALLS = object()
# The name of one call on the step stream, in traces (the gateway's CLIENT span, the target's SERVER span).
STEP_CALL = "tandem.v1.TargetService/StepStream.call"
DRAFT_CALL = "tandem.v1.DraftService/DraftStream.call"


class _CallStream:
    """The gateway's end of a bidirectional stream (TargetService/StepStream,
    DraftService/DraftStream): calls go out in order, replies come back in order.
    Used by one thread only (the step loop; a draft replica's worker)."""

    def __init__(self, open_stream):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._replies = open_stream(iter(self._calls.get, _END_OF_CALLS))

    def send(self, call) -> None:
        self._calls.put(call)

    def reply(self):
        return next(self._replies)

    def cancel(self) -> None:
        """Ends the stream from any thread; a reply() waiting raises CANCELLED."""
        self._replies.cancel()

    def close(self) -> None:
        self._calls.put(_END_OF_CALLS)
        self._replies.cancel()


class _Lane:
    """A service's same-host lane for one stream (StepLane in its GetInfo), while usable."""

    def __init__(self, method: str, reply_type, who: str, enabled: bool):
        self.method, self.reply_type, self.who = method, reply_type, who
        self.enabled = enabled  # off: the gateway's --no-step-lane
        self._where: tuple[str, str] | None = None  # (path, token) from the last GetInfo

    def learn(self, lane: common_pb2.StepLane | None) -> None:
        self._where = (lane.path, lane.token) if self.enabled and lane is not None and lane.path else None

    def open(self) -> LaneStream | None:
        """The stream on the lane, or None (no lane, or it cannot be reached from here: gRPC then, until
        the next GetInfo names one again)."""
        if self._where is None:
            return None
        path, token = self._where
        try:
            stream = LaneStream(path, token, self.method, self.reply_type)
        except LaneRefused as exc:
            log.warning("%s: its step lane is out of reach (%s); the stream goes over gRPC", self.who, exc)
            self._where = None
            return None
        log.info("%s: %s on its step lane %s", self.who, self.method, path)
        return stream


class _Deadline:
    """Cancels a stream whose reply is later than its deadline. One thread per client: a timer
    thread per call would cost a thread start on the hot path. Arming does not wake it (a wake
    per call is a thread switch beside each round's draft call); it looks every CHECK_EVERY
    seconds, so a deadline of T seconds fires within T + CHECK_EVERY."""

    CHECK_EVERY = 0.5

    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._stream: _CallStream | None = None
        self._at: float | None = None
        self._closed = False
        self.fired = False  # the last armed wait was cut short
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    def arm(self, stream: _CallStream, seconds: float) -> None:
        with self._cond:
            self._stream, self._at, self.fired = stream, time.monotonic() + seconds, False

    def disarm(self) -> None:
        with self._cond:
            self._stream, self._at = None, None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                left = None if self._at is None else self._at - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(self.CHECK_EVERY if left is None else min(left, self.CHECK_EVERY))
                    continue
                self._stream.cancel()
                self._stream, self._at, self.fired = None, None, True


_STEP_ERRORS = {"INVALID_ARGUMENT": InvalidArgument, "RESOURCE_EXHAUSTED": ResourceExhausted}


def _step_outcome(reply: target_pb2.StepReply, request_ids: tuple[str, ...]
                  ) -> tuple[list[SequenceResult], KvLoad, float]:
    if reply.WhichOneof("outcome") == "error":
        raise _STEP_ERRORS.get(reply.error.code, Unavailable)(f"target: {reply.error.message}")
    results = results_from_proto(reply.results, request_ids) if reply.HasField("results") else []
    return results, _load(reply.load), reply.step_seconds


class TargetGrant:
    """A grant of plain-decode steps in flight: iterate for each step's (results, load,
    step seconds); interrupt() ends it after the step the target is running."""

    def __init__(self, stream: _CallStream, request_ids: tuple[str, ...], on_broken, span=None):
        self._stream = stream
        self._ids = request_ids
        self._on_broken = on_broken
        self._span = span  # the call's CLIENT span (tracing on), ended with the last reply
        self._done = False
        self._interrupted = False

    def _end(self) -> None:
        self._done = True
        if self._span is not None:
            self._span.end()
            self._span = None

    def __iter__(self):
        while not self._done:
            try:
                reply = self._stream.reply()
                timeline.mark("gw.step.reply")
            except (grpc.RpcError, StopIteration) as e:
                self._end()
                self._on_broken()
                if isinstance(e, grpc.RpcError):
                    _raise_mapped(e, "target", TargetUnavailable)
                raise TargetUnavailable("target: the step stream ended") from None
            if reply.done:
                self._end()
            yield _step_outcome(reply, self._ids)

    def interrupt(self) -> None:
        if not self._done and not self._interrupted:
            self._interrupted = True
            self._stream.send(target_pb2.StepCall(interrupt=target_pb2.Interrupt()))

    def close(self) -> None:
        """Abandon what is left: the stream is dropped (the target ends the grant) and reopened
        by the next call, so no reply of this call can be read as another's."""
        if not self._done:
            self._end()
            self._on_broken()


class TargetClient:
    def __init__(self, address: str, tls: ClientTLS | None = None, use_lane: bool = True):
        self.address = address
        self.channel = open_channel(address, tls)
        self.stub = target_pb2_grpc.TargetServiceStub(instrument_channel(self.channel))  # trace context out
        self._stream: _CallStream | LaneStream | None = None
        self.lane = _Lane("StepStream", target_pb2.StepReply, f"target {address}", use_lane)

    def _open_stream(self) -> _CallStream | LaneStream:
        if self._stream is None:
            self._stream = self.lane.open() or _CallStream(self.stub.StepStream)
        return self._stream

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def reconnect(self) -> None:
        """Forget the step stream: after the target restarted, the old one is broken though
        nothing has failed on it yet; the next call opens a new one."""
        self._drop_stream()

    def _call(self, items: list[SequenceStep], feature_layers: tuple[int, ...], grant_steps: int = 0,
              stops: GrantStops | None = None, hold_features: bool = False,
              feature_sinks: list[str] | None = None, release: Sequence[str] = ()) -> TargetGrant:
        span, traceparent = stream_call_span(STEP_CALL)
        call = target_pb2.PackedStep(items=items_to_proto(items), feature_layers=list(feature_layers),
                                     grant_steps=grant_steps, traceparent=traceparent, hold_features=hold_features,
                                     release_request_ids=release)
        if stops is not None:
            call.stops.CopyFrom(stops.to_proto())
        if hold_features and feature_sinks and any(feature_sinks):
            names = sorted({sink for sink in feature_sinks if sink})
            index = {sink: i for i, sink in enumerate(names)}
            call.feature_sinks.extend(names)
            call.item_feature_sink.CopyFrom(list_to_proto([index.get(sink, -1) for sink in feature_sinks], "int32"))
        stream = self._open_stream()
        timeline.mark("gw.step.send")
        stream.send(target_pb2.StepCall(step=call))
        return TargetGrant(stream, tuple(it.request_id for it in items), self._drop_stream, span)

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether the target answers its health check with SERVING."""
        return self.health(timeout) is True

    def health(self, timeout: float = 2.0) -> bool | None:
        """True: the target serves; False: it refused the check, or answered that it does not serve; None: no
        answer within `timeout` (a host too busy to answer soon, or a hung target)."""
        try:
            status = _check_health(self.channel, timeout)
        except grpc.RpcError as e:
            return None if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
        return status == health_pb2.HealthCheckResponse.SERVING

    def info(self) -> TargetInfo:
        try:
            m = self.stub.GetInfo(target_pb2.GetInfoRequest(), timeout=30)
        except grpc.RpcError as e:
            _raise_mapped(e, "target", TargetUnavailable)
        self.lane.learn(m.step_lane if m.HasField("step_lane") else None)
        return TargetInfo(m.model_name, m.vocab_size, m.hidden_size, m.max_model_len,
                          tuple(m.eos_token_ids), tuple(m.default_feature_layers), _load(m.load))

    def step(self, items: list[SequenceStep], feature_layers: tuple[int, ...], hold_features: bool = False,
             feature_sinks: list[str] | None = None,
             release: Sequence[str] = ()) -> tuple[list[SequenceResult], KvLoad, float]:
        """One step over the stream (packed columns both ways). hold_features: the target keeps
        the features asked for, for the draft replicas to read, instead of returning them;
        feature_sinks (per item, "" for none): or pushes them to that subscriber. release:
        sequences the target releases before the step (finished ones; no Release call of their own)."""
        return next(iter(self._call(items, feature_layers, hold_features=hold_features,
                                    feature_sinks=feature_sinks, release=release)))

    def grant(self, items: list[SequenceStep], feature_layers: tuple[int, ...], steps: int,
              stops: GrantStops, hold_features: bool = False, feature_sinks: list[str] | None = None,
              release: Sequence[str] = ()) -> TargetGrant:
        """Up to `steps` plain-decode steps that the target feeds forward itself; items that ask
        for features get each step's, held or pushed as `step` has them (a fed grant); `release`
        as for step."""
        return self._call(items, feature_layers, steps, stops, hold_features=hold_features,
                          feature_sinks=feature_sinks, release=release)

    def release(self, request_ids: list[str]) -> KvLoad:
        try:
            return _load(self.stub.Release(target_pb2.ReleaseRequest(request_ids=request_ids), timeout=30).load)
        except grpc.RpcError as e:
            _raise_mapped(e, "target", TargetUnavailable)

    def close(self) -> None:
        self._drop_stream()
        self.channel.close()


@dataclass(frozen=True)
class DraftInfo:
    feature_layers: tuple[int, ...]
    max_tokens: int
    max_steps: int
    max_topk: int
    max_draft_tokens: int
    load: KvLoad
    reads_target_features: bool = False  # it reads features the target holds (IngestItem.target_feature_rows)
    feature_sink: str = ""  # the name under which the target pushes it features (PackedStep.feature_sinks)
    device: str = ""  # "cpu" or "cuda" (a CUDA draft captures a graph for each new call shape)
    feature_width: int = 0  # columns of one position's target features


class DraftReply(NamedTuple):
    """What a Draft call brought back."""

    trees: list[DraftTree]
    load: KvLoad
    graphs_captured: int = 0  # graphs the replica captured for shapes new to it: a call slower than its kind


class DraftClient:
    """One draft replica. Every failure surfaces as Unavailable (or InvalidArgument):
    the gateway then stops speculating for the replica's requests."""

    def __init__(self, address: str, timeout: float = 30.0, tls: ClientTLS | None = None, use_lane: bool = True):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, tls)
        self.stub = draft_pb2_grpc.DraftServiceStub(instrument_channel(self.channel))  # trace context out
        # Draft calls go over one DraftStream (a unary call costs about twice a message on an open
        # stream), opened on first use and again after a failure; each call carries its traceparent.
        self._stream: _CallStream | LaneStream | None = None
        self.lane = _Lane("DraftStream", draft_pb2.DraftResponse, f"draft {address}", use_lane)
        self._deadline = _Deadline(f"draft-deadline-{address}")  # a replica that hangs is a lost replica
        # Learnt from info() (the pool's admission check asks it of every replica); until then
        # the gateway sends it features itself.
        self.reads_target_features = False
        self.feature_sink = ""

    def healthy(self) -> bool:
        return _health_status(self.channel, 2) == health_pb2.HealthCheckResponse.SERVING

    def info(self) -> DraftInfo:
        try:
            m = self.stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")
        self.reads_target_features = m.reads_target_features
        self.feature_sink = m.feature_sink
        self.lane.learn(m.step_lane if m.HasField("step_lane") else None)
        return DraftInfo(feature_layers=tuple(m.feature_layers), max_tokens=m.max_tokens, max_steps=m.max_steps,
                         max_topk=m.max_topk, max_draft_tokens=m.max_draft_tokens, load=_load(m.load),
                         reads_target_features=m.reads_target_features, feature_sink=m.feature_sink,
                         device=m.device, feature_width=m.feature_width)

    @staticmethod
    def _ingest_proto(it: IngestItem) -> draft_pb2.IngestItem:
        m = draft_pb2.IngestItem(request_id=it.request_id, start_position=it.start_position, tokens=it.tokens,
                                 target_feature_rows=it.target_feature_rows)
        if it.features is not None and it.features.shape[0]:
            m.features.CopyFrom(tensor_to_proto(it.features))
        return m

    def ingest(self, items: list[IngestItem], catch_up: bool = False) -> KvLoad:
        req = draft_pb2.IngestRequest(items=[self._ingest_proto(it) for it in items], catch_up=catch_up)
        try:
            return _load(self.stub.Ingest(req, timeout=self.timeout).load)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")

    def draft(self, ingest: list[IngestItem], items: list[tuple[str, DraftBudget, int]]) -> DraftReply:
        """items: (request_id, budget, known tokens). Ingest is applied first, in the same call.
        One message on the replica's DraftStream, trees back as packed columns."""
        span, traceparent = stream_call_span(DRAFT_CALL)
        req = draft_pb2.DraftRequest(ingest=[self._ingest_proto(it) for it in ingest], packed_trees=True,
                                     traceparent=traceparent)
        for rid, b, n in items:
            req.items.add(request_id=rid, num_tokens=n).budget.CopyFrom(
                draft_pb2.DraftBudget(steps=b.steps, topk=b.topk, num_draft_tokens=b.num_draft_tokens))
        if self._stream is None:
            self._stream = self.lane.open() or _CallStream(self.stub.DraftStream)
        stream = self._stream
        timeline.mark("gw.draft.send")
        stream.send(req)
        self._deadline.arm(stream, self.timeout)
        try:
            resp = stream.reply()
            timeline.mark("gw.draft.reply")
            self._deadline.disarm()
            trees = trees_from_proto(resp.packed)
        except grpc.RpcError as e:
            self._deadline.disarm()
            self._drop_stream()
            if e.code() == grpc.StatusCode.CANCELLED and self._deadline.fired:
                raise Unavailable(f"draft {self.address}: no answer in {self.timeout:g} s") from None
            _raise_mapped(e, f"draft {self.address}")
        except (StopIteration, ValueError, InvalidArgument) as e:
            self._deadline.disarm()
            self._drop_stream()
            raise Unavailable(f"draft {self.address}: {e or 'the draft stream ended'}") from None
        finally:
            if span is not None:
                span.end()
        return DraftReply(trees, _load(resp.load), resp.graphs_captured)

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def release(self, request_ids: list[str]) -> None:
        try:
            self.stub.Release(draft_pb2.DraftReleaseRequest(request_ids=request_ids), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")

    def close(self) -> None:
        self._drop_stream()
        self._deadline.close()
        self.channel.close()
