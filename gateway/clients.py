"""gRPC clients of the target and draft services: plain dataclasses in and out."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.types import DraftBudget, DraftTree, IngestItem
from tandem.channels import open_channel
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from tandem.tensors import tensor_from_proto, tensor_to_proto
from tandem.tls import ClientTLS
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.types import KvLoad, SequenceResult, SequenceStep


def _load(m: common_pb2.KvLoad) -> KvLoad:
    return KvLoad(m.num_sequences, m.block_size, m.total_blocks, m.free_blocks)


def _raise_mapped(err: grpc.RpcError, who: str):
    code = err.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidArgument(f"{who}: {err.details()}") from err
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise ResourceExhausted(f"{who}: {err.details()}") from err
    raise Unavailable(f"{who} failed: {code.name}: {err.details()}") from err


def wait_healthy(channel: grpc.Channel, timeout: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
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


class TargetClient:
    def __init__(self, address: str, tls: ClientTLS | None = None):
        self.address = address
        self.channel = open_channel(address, tls)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    def info(self) -> TargetInfo:
        try:
            m = self.stub.GetInfo(target_pb2.GetInfoRequest(), timeout=30)
        except grpc.RpcError as e:
            _raise_mapped(e, "target")
        return TargetInfo(m.model_name, m.vocab_size, m.hidden_size, m.max_model_len,
                          tuple(m.eos_token_ids), tuple(m.default_feature_layers), _load(m.load))

    def step(self, items: list[SequenceStep], feature_layers: tuple[int, ...]
             ) -> tuple[list[SequenceResult], KvLoad, float]:
        req = target_pb2.StepRequest(feature_layers=list(feature_layers))
        for it in items:
            sp = it.sampling
            m = req.items.add(request_id=it.request_id, create=it.create, tokens=it.tokens,
                              parents=it.parents, num_fixed=it.num_fixed, top_logprobs=it.top_logprobs,
                              return_features=it.return_features)
            m.sampling.temperature = sp.temperature
            m.sampling.top_k = sp.top_k
            m.sampling.top_p = sp.top_p
            if sp.seed is not None:
                m.sampling.seed = sp.seed
        try:
            resp = self.stub.Step(req)
        except grpc.RpcError as e:
            _raise_mapped(e, "target")
        results = [SequenceResult(
            r.request_id, list(r.accepted_nodes), list(r.tokens), list(r.logprobs),
            [(list(t.token_ids), list(t.logprobs)) for t in r.top_logprobs],
            tensor_from_proto(r.features) if r.HasField("features") else None, r.num_committed)
            for r in resp.results]
        return results, _load(resp.load), resp.step_seconds

    def release(self, request_ids: list[str]) -> KvLoad:
        try:
            return _load(self.stub.Release(target_pb2.ReleaseRequest(request_ids=request_ids), timeout=30).load)
        except grpc.RpcError as e:
            _raise_mapped(e, "target")

    def close(self) -> None:
        self.channel.close()


@dataclass(frozen=True)
class DraftInfo:
    feature_layers: tuple[int, ...]
    max_tokens: int
    max_steps: int
    max_topk: int
    max_draft_tokens: int
    load: KvLoad


class DraftClient:
    """One draft replica. Every failure surfaces as Unavailable (or InvalidArgument):
    the gateway then stops speculating for the replica's requests."""

    def __init__(self, address: str, timeout: float = 30.0, tls: ClientTLS | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, tls)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)

    def healthy(self) -> bool:
        try:
            status = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2).status
            return status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def info(self) -> DraftInfo:
        try:
            m = self.stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")
        return DraftInfo(tuple(m.feature_layers), m.max_tokens, m.max_steps, m.max_topk,
                         m.max_draft_tokens, _load(m.load))

    @staticmethod
    def _ingest_proto(it: IngestItem) -> draft_pb2.IngestItem:
        m = draft_pb2.IngestItem(request_id=it.request_id, start_position=it.start_position, tokens=it.tokens)
        if it.features is not None and it.features.shape[0]:
            m.features.CopyFrom(tensor_to_proto(it.features))
        return m

    def ingest(self, items: list[IngestItem], catch_up: bool = False) -> KvLoad:
        req = draft_pb2.IngestRequest(items=[self._ingest_proto(it) for it in items], catch_up=catch_up)
        try:
            return _load(self.stub.Ingest(req, timeout=self.timeout).load)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")

    def draft(self, ingest: list[IngestItem], items: list[tuple[str, DraftBudget, int]]
              ) -> tuple[list[DraftTree], KvLoad]:
        """items: (request_id, budget, known tokens). Ingest is applied first, in the same call."""
        req = draft_pb2.DraftRequest(ingest=[self._ingest_proto(it) for it in ingest])
        for rid, b, n in items:
            req.items.add(request_id=rid, num_tokens=n).budget.CopyFrom(
                draft_pb2.DraftBudget(steps=b.steps, topk=b.topk, num_draft_tokens=b.num_draft_tokens))
        try:
            resp = self.stub.Draft(req, timeout=self.timeout)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")
        trees = [DraftTree(t.request_id, t.root_token, t.root_position, list(t.tokens), list(t.parents),
                           list(t.depths), list(t.logprobs), list(t.scores)) for t in resp.trees]
        return trees, _load(resp.load)

    def release(self, request_ids: list[str]) -> None:
        try:
            self.stub.Release(draft_pb2.DraftReleaseRequest(request_ids=request_ids), timeout=self.timeout)
        except grpc.RpcError as e:
            _raise_mapped(e, f"draft {self.address}")

    def close(self) -> None:
        self.channel.close()
