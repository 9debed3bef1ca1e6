"""The draft as a real gRPC process: round trips, streaming, error mapping, health, release, stop."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from gateway.clients import DraftClient
from tandem.errors import InvalidArgument, Unavailable
from tandem.tensors import tensor_from_proto, tensor_to_proto
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.services import Service
from tests.tiny_draft import make_tiny_eagle3

BUDGET = draft_pb2.DraftBudget(steps=4, topk=3, num_draft_tokens=10)


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    target = tiny_llama("gqa")
    return target, make_tiny_eagle3(tmp_path_factory.mktemp("d") / "d", target, seed=31, aux_layer_ids=[0, 1, 2])


@pytest.fixture(scope="module")
def draft(pair, tmp_path_factory):
    target, draft_dir = pair
    svc = Service(["draft", "--model", str(draft_dir), "--target-model", str(target), "--num-blocks", "32",
                   "--block-size", "4"], tmp_path_factory.mktemp("svc"), "draft")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0, svc.log_path.read_text()


@pytest.fixture()
def stub(draft):
    return draft_pb2_grpc.DraftServiceStub(draft.channel)


def history(n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (n + 1,), generator=gen).tolist(), torch.randn(n, 192, generator=gen)


def ingest_msg(rid: str, start: int, tokens: list[int], feats: torch.Tensor | None = None) -> draft_pb2.IngestItem:
    m = draft_pb2.IngestItem(request_id=rid, start_position=start, tokens=tokens)
    if feats is not None:
        m.features.CopyFrom(tensor_to_proto(feats))
    return m


def test_info_health_and_reflection(draft, stub):
    assert draft.health() == health_pb2.HealthCheckResponse.SERVING
    info = stub.GetInfo(draft_pb2.DraftInfoRequest())
    assert list(info.feature_layers) == [1, 2, 3]  # eagle_aux_hidden_state_layer_ids [0, 1, 2] + 1
    assert (info.feature_width, info.draft_vocab_size, info.target_vocab_size) == (192, 24, 101)
    assert info.max_topk == 24 and info.load.total_blocks == 32 and info.target_model_name == "model"
    refl = reflection_pb2_grpc.ServerReflectionStub(draft.channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"tandem.v1.DraftService", "grpc.health.v1.Health"} <= names


def test_trees_over_grpc_equal_the_in_process_engine(pair, stub):
    target, draft_dir = pair
    local = DraftEngine(Eagle3Draft(draft_dir, target), num_blocks=32, block_size=4)
    tokens, feats = history(14, seed=1)
    # Prefill features travel as bfloat16 here: the service accepts any float dtype.
    resp = stub.Ingest(draft_pb2.IngestRequest(items=[ingest_msg("a", 0, tokens[:9], feats[:8].bfloat16())],
                                               catch_up=True))
    status = resp.requests[0]
    assert (status.num_tokens, status.num_computed, status.ready) == (9, 8, True)
    local.ingest([IngestItem("a", 0, tuple(tokens[:9]), feats[:8].bfloat16())])
    req = draft_pb2.DraftRequest(ingest=[ingest_msg("a", 8, tokens[8:], feats[8:13])],
                                 items=[draft_pb2.DraftItem(request_id="a", budget=BUDGET, num_tokens=15)],
                                 return_ancestor_mask=True)
    tree = stub.Draft(req).trees[0]
    want = local.draft([DraftItem("a", DraftBudget(4, 3, 10), 15)],
                       [IngestItem("a", 8, tuple(tokens[8:]), feats[8:13])])[0]
    assert list(tree.tokens) == want.tokens and list(tree.parents) == want.parents
    assert list(tree.depths) == want.depths and (tree.root_token, tree.root_position) == (tokens[-1], 14)
    assert list(tree.scores) == pytest.approx(want.scores, abs=1e-5)
    assert torch.equal(tensor_from_proto(tree.ancestor_mask), want.ancestor_mask())
    assert stub.Release(draft_pb2.DraftReleaseRequest(request_ids=["a"])).released == 1


def test_stream_answers_each_message_and_maps_errors(stub):
    tokens, feats = history(10, seed=2)

    def requests():
        yield draft_pb2.DraftRequest(ingest=[ingest_msg("s", 0, tokens[:6], feats[:5])],
                                     items=[draft_pb2.DraftItem(request_id="s", budget=BUDGET)])
        yield draft_pb2.DraftRequest(ingest=[ingest_msg("s", 5, tokens[5:], feats[5:10])],
                                     items=[draft_pb2.DraftItem(request_id="s", budget=BUDGET, num_tokens=11)])
        yield draft_pb2.DraftRequest(items=[draft_pb2.DraftItem(request_id="ghost", budget=BUDGET)])
        yield draft_pb2.DraftRequest(items=[draft_pb2.DraftItem(request_id="s", budget=BUDGET)])

    replies = stub.DraftStream(requests())
    first, second = next(replies), next(replies)
    assert first.trees[0].root_position == 5 and second.trees[0].root_position == 10
    assert len(second.trees[0].tokens) == 9
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown request 'ghost'" in err.value.details()
    stub.Release(draft_pb2.DraftReleaseRequest(request_ids=["s"]))


@pytest.mark.parametrize("request_, message", [
    (draft_pb2.DraftRequest(items=[draft_pb2.DraftItem(request_id="ghost", budget=BUDGET)]),
     "unknown request 'ghost'"),
    (draft_pb2.DraftRequest(ingest=[draft_pb2.IngestItem(request_id="b", tokens=[1, 2],
                                                         features=common_pb2.Tensor(dtype="float32", shape=[1, 192],
                                                                                   data=b"\0" * 12))]),
     "needs 768 bytes, got 12"),
    (draft_pb2.DraftRequest(ingest=[ingest_msg("b", 0, [1, 2], torch.zeros(1, 64))]),
     r"request 'b': features must be a float tensor \[rows, 192\]"),
    (draft_pb2.DraftRequest(ingest=[ingest_msg("b", 0, [1, 2])],
                            items=[draft_pb2.DraftItem(request_id="b", budget=draft_pb2.DraftBudget(
                                steps=3, topk=40, num_draft_tokens=8))]),
     "request 'b': topk must be <= 24"),
])
def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(stub, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, err.value.details()), err.value.details()
    assert stub.GetLoad(draft_pb2.DraftLoadRequest()).num_sequences == 0  # nothing was applied


def test_release_reports_zero_load(stub):
    for i in range(3):
        tokens, feats = history(9 + i, seed=10 + i)
        stub.Draft(draft_pb2.DraftRequest(ingest=[ingest_msg(f"r{i}", 0, tokens, feats)],
                                          items=[draft_pb2.DraftItem(request_id=f"r{i}", budget=BUDGET)]))
    load = stub.GetLoad(draft_pb2.DraftLoadRequest())
    assert load.num_sequences == 3 and load.free_blocks < load.total_blocks
    resp = stub.Release(draft_pb2.DraftReleaseRequest(request_ids=["r0", "r1", "r2", "unknown"]))
    assert resp.released == 3
    assert (resp.load.num_sequences, resp.load.free_blocks) == (0, resp.load.total_blocks)
    assert resp.load.free_token_slots == 32 * 4


def test_bad_checkpoint_stops_the_process_with_the_tensor_name(pair, tmp_path):
    target, _ = pair
    bad = make_tiny_eagle3(tmp_path / "bad", target, tensors={"midlayer.self_attn.k_proj.weight": torch.zeros(32, 64)})
    svc = Service(["draft", "--model", str(bad), "--target-model", str(target)], tmp_path, "bad")
    assert svc.proc.wait(60) != 0
    assert "tensor 'midlayer.self_attn.k_proj.weight' has shape [32, 64], expected [32, 128]" in \
        svc.log_path.read_text()
    svc.stop()


def test_the_gateways_client_drafts_over_the_stream_with_packed_trees_as_unary_calls_do(draft, stub):
    """DraftClient.draft sends one DraftStream message and reads packed columns: the same trees as
    unary calls with one DraftTree message per tree, and errors mapped as before."""

    tokens, feats = history(12, seed=5)
    budget = DraftBudget(4, 3, 10)
    client = DraftClient(draft.address)
    try:
        items = [IngestItem("p", 0, tuple(tokens[:8]), feats[:7]), IngestItem("q", 0, tuple(tokens[2:9]), feats[2:8]),
                 IngestItem("r", 0, tuple(tokens[:3]))]
        reply = client.draft(items, [("p", budget, 8), ("q", budget, 7), ("r", DraftBudget(0, 0, 0), 3)])
        packed = reply.trees
        assert reply.graphs_captured == 0  # on the CPU the draft grows trees eagerly
        for rid, first, n in (("p", 0, 8), ("q", 2, 7)):
            stub.Release(draft_pb2.DraftReleaseRequest(request_ids=[rid]))
            stub.Ingest(draft_pb2.IngestRequest(items=[ingest_msg(rid, 0, tokens[first:first + n],
                                                                  feats[first:first + n - 1])]))
        unary = stub.Draft(draft_pb2.DraftRequest(items=[
            draft_pb2.DraftItem(request_id=rid, budget=draft_pb2.DraftBudget(steps=4, topk=3, num_draft_tokens=10))
            for rid in ("p", "q")])).trees
        for got, want in zip(packed[:2], unary, strict=True):
            assert (got.request_id, got.root_token, got.root_position) == (want.request_id, want.root_token,
                                                                           want.root_position)
            assert got.tokens == list(want.tokens) and got.parents == list(want.parents)
            assert got.depths == list(want.depths)
            assert got.scores == pytest.approx(list(want.scores), abs=1e-6)
            assert got.logprobs == pytest.approx(list(want.logprobs), abs=1e-6)
        assert packed[2].request_id == "r" and packed[2].tokens == []  # an empty budget: an empty tree
        # An error ends the stream with the unary call's status; the next call opens a new one.
        with pytest.raises(InvalidArgument, match="unknown request 'ghost'"):
            client.draft([], [("ghost", budget, 3)])
        again = client.draft([], [("p", budget, 8)]).trees
        assert again[0].tokens
    finally:
        stub.Release(draft_pb2.DraftReleaseRequest(request_ids=["p", "q", "r"]))
        client.close()


def test_a_draft_stream_that_does_not_answer_is_a_lost_replica_after_the_timeout():
    class Silent(draft_pb2_grpc.DraftServiceServicer):
        def DraftStream(self, request_iterator, context):
            ended = threading.Event()
            context.add_callback(ended.set)  # the client's cancel ends the wait
            next(request_iterator)
            ended.wait(30)
            return iter(())

    server = grpc.server(ThreadPoolExecutor(2))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = DraftClient(f"127.0.0.1:{port}", timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="no answer in 0.5 s"):
            client.draft([], [("a", DraftBudget(2, 2, 4), 2)])
        assert time.monotonic() - t0 < 5
    finally:
        client.close()
        server.stop(0)


def test_the_gateways_start_up_warm_up_runs_against_a_real_draft_and_leaves_it_as_it_was(draft, stub):
    """gateway.profiling.warm_draft on a draft that says it runs on CUDA (a CPU one here, so nothing is captured):
    the real service takes its calls, and its requests are all released after."""
    import dataclasses
    from types import SimpleNamespace

    from gateway.policy import PolicyConfig
    from gateway.profiling import warm_draft

    client = DraftClient(draft.address)

    class SaysCuda:  # the client, but its info says cuda
        def __getattr__(self, name):
            return getattr(client, name)

        def info(self):
            return dataclasses.replace(client.info(), device="cuda")

    try:
        before = stub.GetLoad(draft_pb2.DraftLoadRequest())
        # 32 blocks of 4 tokens, 14 a request (32 tokens of prompt, 5 of catch-ups, 16 of the widest tree): the
        # 2-request bucket, a call per option and one that catches up a verify's tokens with features; and each
        # option's depth cuts at one and two requests.
        options = PolicyConfig().auto_options()
        calls = len(options) + 1 + 2 * sum(o.steps - 1 for o in options)
        assert warm_draft(SimpleNamespace(client=SaysCuda()), PolicyConfig(), max_batch=256) == calls
        after = stub.GetLoad(draft_pb2.DraftLoadRequest())
        assert (after.num_sequences, after.free_blocks) == (before.num_sequences, before.free_blocks)
    finally:
        client.close()
