"""The target as a real gRPC process: TP over gloo, errors, health, release, graceful stop."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.tensors import tensor_from_proto
from tandem.v1 import target_pb2, target_pb2_grpc
from tests.services import Service

PROMPT = [5, 17, 3, 9, 33, 2, 40, 11]


def chain(rid, tokens, create=False, **kw):
    return target_pb2.SequenceStep(request_id=rid, tokens=tokens, parents=list(range(-1, len(tokens) - 1)),
                                   num_fixed=len(tokens), create=create, **kw)


def run_steps(stub, rid: str, n: int) -> tuple[list[int], list[list[float]]]:
    """Greedy-decode n tokens; return tokens and the top-5 log-probs of each."""
    r = stub.Step(target_pb2.StepRequest(items=[chain(rid, PROMPT, True, top_logprobs=5)])).results[0]
    tokens, tops = list(r.tokens), [list(r.top_logprobs[0].logprobs)]
    while len(tokens) < n:
        r = stub.Step(target_pb2.StepRequest(items=[chain(rid, [tokens[-1]], top_logprobs=5)])).results[0]
        tokens += r.tokens
        tops.append(list(r.top_logprobs[0].logprobs))
    return tokens, tops


@pytest.fixture(scope="module")
def target(tiny_llama, tmp_path_factory):
    svc = Service(["target", "--model", str(tiny_llama("gqa")), "--num-blocks", "64", "--block-size", "4",
                   "--max-model-len", "64"], tmp_path_factory.mktemp("t1"), "target")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


def test_tp2_over_gloo_matches_tp1(tiny_llama, tmp_path, target):
    stub1 = target_pb2_grpc.TargetServiceStub(target.channel)
    tokens1, tops1 = run_steps(stub1, "tp-cmp", 12)
    tp2 = Service(["target", "--model", str(tiny_llama("gqa")), "--tp", "2", "--num-blocks", "64",
                   "--block-size", "4"], tmp_path, "tp2")
    try:
        tp2.wait_serving()
        stub2 = target_pb2_grpc.TargetServiceStub(tp2.channel)
        assert stub2.GetInfo(target_pb2.GetInfoRequest()).tp_size == 2
        tokens2, tops2 = run_steps(stub2, "tp-cmp", 12)
        assert tokens2 == tokens1
        for a, b in zip(tops1, tops2, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        # A tree verify step and a release go through every rank too.
        step = target_pb2.SequenceStep(request_id="tp-cmp", tokens=[tokens2[-1], 1, 2], parents=[-1, 0, 0],
                                       num_fixed=1)
        stub2.Step(target_pb2.StepRequest(items=[step]))
        assert stub2.Release(target_pb2.ReleaseRequest(request_ids=["tp-cmp"])).load.free_blocks == 64
    finally:
        assert tp2.stop() == 0
    stub1.Release(target_pb2.ReleaseRequest(request_ids=["tp-cmp"]))


def assert_tp2_matches_tp1(model_args: list[str], tmp_path: Path, name: str, steps: int) -> None:
    """The same greedy steps on a target at TP=1 and at TP=2: the same tokens, top log-probs
    within 1e-5."""
    runs = []
    for tp in ("1", "2"):
        svc = Service(["target", *model_args, "--tp", tp, "--num-blocks", "64", "--block-size", "4"], tmp_path,
                      f"{name}-tp{tp}")
        try:
            svc.wait_serving()
            runs.append(run_steps(target_pb2_grpc.TargetServiceStub(svc.channel), name, steps))
        finally:
            assert svc.stop() == 0
    (tokens1, tops1), (tokens2, tops2) = runs
    assert tokens2 == tokens1
    for a, b in zip(tops1, tops2, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_tp2_of_a_tied_model_with_one_kv_head_matches_tp1(tiny_llama, tmp_path):
    """The lm_head split by vocabulary when it is the embedding (tied), 97 rows over 2 ranks
    (one padded row), and the one KV head kept by both ranks."""
    assert_tp2_matches_tp1(["--model", str(tiny_llama("llama3_tied"))], tmp_path, "tied", 8)


def test_tp_that_does_not_divide_heads_is_refused(tiny_llama, tmp_path):
    svc = Service(["target", "--model", str(tiny_llama("gqa")), "--tp", "3"], tmp_path, "tp3")
    assert svc.proc.wait(60) != 0
    assert "--tp 3 does not divide num_attention_heads (4)" in svc.log_path.read_text()
    svc.stop()


BAD_ITEMS = {
    "unknown request 'ghost'": chain("ghost", [1]),
    "token id 500 out of range [0, 101)": chain("bad-tok", [1, 500], create=True),
    "node 2 has parent 3, which does not come before it": target_pb2.SequenceStep(
        request_id="bad-tree", tokens=[1, 2, 3, 4], parents=[-1, 0, 3, 1], num_fixed=1, create=True),
    "over the model's maximum length 64": chain("too-long", list(range(70)), create=True),
    "2 tokens but 1 parents": target_pb2.SequenceStep(request_id="x", tokens=[1, 2], parents=[-1],
                                                      num_fixed=1, create=True),
}


@pytest.mark.parametrize("message", list(BAD_ITEMS))
def test_bad_input_is_invalid_argument_and_service_keeps_serving(target, message):
    stub = target_pb2_grpc.TargetServiceStub(target.channel)
    good = chain("good", PROMPT, create=True)
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(target_pb2.StepRequest(items=[good, BAD_ITEMS[message]]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # Nothing of the failed call was applied: the good item can still be created.
    r = stub.Step(target_pb2.StepRequest(items=[good])).results[0]
    assert r.num_committed == len(PROMPT)
    assert stub.Release(target_pb2.ReleaseRequest(request_ids=["good"])).released == 1


def test_features_travel_as_packed_float32(target):
    stub = target_pb2_grpc.TargetServiceStub(target.channel)
    info = stub.GetInfo(target_pb2.GetInfoRequest())
    assert list(info.default_feature_layers) == [2, 2, 1]
    item = chain("feat", PROMPT, True, return_features=True)
    r = stub.Step(target_pb2.StepRequest(items=[item])).results[0]
    feats = tensor_from_proto(r.features)
    assert feats.shape == (len(PROMPT), 3 * info.hidden_size)
    stub.Release(target_pb2.ReleaseRequest(request_ids=["feat"]))


def test_out_of_kv_is_resource_exhausted(target):
    stub = target_pb2_grpc.TargetServiceStub(target.channel)
    items = [chain(f"fill{i}", list(range(1, 40)), create=True) for i in range(7)]  # 7 * 10 blocks > 64
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(target_pb2.StepRequest(items=items))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetLoad(target_pb2.GetLoadRequest()).free_blocks == 64


def test_release_after_many_requests_frees_every_block(target):
    stub = target_pb2_grpc.TargetServiceStub(target.channel)
    ids = [f"many{i}" for i in range(6)]
    stub.Step(target_pb2.StepRequest(items=[chain(i, PROMPT, True) for i in ids]))
    assert stub.GetLoad(target_pb2.GetLoadRequest()).num_sequences == 6
    resp = stub.Release(target_pb2.ReleaseRequest(request_ids=ids))
    assert resp.released == 6 and resp.load.free_blocks == resp.load.total_blocks == 64


def test_a_steps_release_ids_are_released_before_it_runs_even_when_the_step_is_refused(target):
    """The gateway sends finished requests' release with its next step (PackedStep.release_request_ids):
    the step's reply already counts their blocks free, and a refused step still releases them."""
    from gateway.clients import TargetClient
    from tandem.errors import InvalidArgument
    from target_service.types import SequenceStep

    stub = target_pb2_grpc.TargetServiceStub(target.channel)
    client = TargetClient(target.address)
    try:
        client.step([SequenceStep.chain(rid, PROMPT, create=True) for rid in ("done1", "done2", "live")], ())
        results, load, _ = client.step([SequenceStep.chain("live", [7])], (), release=["done1", "done2", "unknown"])
        assert load.num_sequences == 1 and results[0].num_committed == len(PROMPT) + 1
        client.step([SequenceStep.chain("done3", PROMPT, create=True)], ())
        with pytest.raises(InvalidArgument):
            client.step([SequenceStep.chain("live", [10 ** 6])], (), release=["done3"])
        assert stub.GetLoad(target_pb2.GetLoadRequest()).num_sequences == 1
    finally:
        stub.Release(target_pb2.ReleaseRequest(request_ids=["live"]))
        client.close()


def test_health_and_reflection(target):
    assert target.health() == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(target.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"tandem.v1.TargetService", "grpc.health.v1.Health"} <= names


def test_sigterm_stops_gracefully(tiny_llama, tmp_path):
    svc = Service(["target", "--model", str(tiny_llama("gqa")), "--num-blocks", "8"], tmp_path, "term")
    svc.wait_serving()
    assert svc.stop() == 0
    assert "stopped" in svc.log_path.read_text()


def test_the_random_weights_model_is_the_same_at_tp2_and_tp1(tiny_llama, tmp_path):
    """--random-weights draws each tensor whole from (seed, name) and slices it, so TP=2 serves
    the TP=1 model (before, each rank drew its shard from one shared stream: another model)."""
    import json
    import shutil

    model = tmp_path / "random"
    model.mkdir()
    config = json.loads((tiny_llama("gqa") / "config.json").read_text())
    config["tandem_random_init"] = {"seed": 3}
    (model / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_llama("gqa") / name).exists():
            shutil.copy(tiny_llama("gqa") / name, model / name)
    assert_tp2_matches_tp1(["--model", str(model), "--random-weights"], tmp_path, "random", 12)


def test_tp2_serves_the_step_stream_and_grants_with_packed_broadcasts(tiny_llama, tmp_path, target):
    """The gateway's path at TP=2: steps over the stream reach the other rank as packed columns,
    a grant goes to it as one command and runs on both ranks, and the tokens equal TP=1's."""
    import numpy as np

    from gateway.clients import TargetClient
    from target_service.types import SequenceStep
    from target_service.wire import GrantStops

    want, _ = run_steps(target_pb2_grpc.TargetServiceStub(target.channel), "tp-stream", 10)
    target_pb2_grpc.TargetServiceStub(target.channel).Release(target_pb2.ReleaseRequest(request_ids=["tp-stream"]))
    tp2 = Service(["target", "--model", str(tiny_llama("gqa")), "--tp", "2", "--num-blocks", "64",
                   "--block-size", "4"], tmp_path, "tp2-stream")
    try:
        tp2.wait_serving()
        client = TargetClient(tp2.address)
        first, _, _ = client.step([SequenceStep.chain("tp-stream", PROMPT, create=True)], ())
        got = list(first[0].tokens)
        stops = GrantStops(max_new_tokens=np.array([9], dtype=np.int32), stop_token_ids=(frozenset(),))
        for results, _, _ in client.grant([SequenceStep.chain("tp-stream", [got[-1]])], (), 8, stops):
            got += results[0].tokens
        assert got[:9] == want[:9]
        client.release(["tp-stream"])
        client.close()
    finally:
        assert tp2.stop() == 0
