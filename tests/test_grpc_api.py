"""tandem.v1.Generation/Generate on a real gRPC server over the fake engine."""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from gateway.grpc_api import SERVICE_NAME, add_generation_service
from tandem.grpc_host import ServiceHost
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.fake_engine import OTHER_LOGPROB, TOKEN_LOGPROB, FakeEngine, expected_text, make_char_tokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = FakeEngine(make_char_tokenizer(tmp_path_factory.mktemp("tok")))
    yield e
    e.close()


@pytest.fixture(autouse=True)
def reset_engine(engine):
    yield
    engine.is_ready, engine.max_queue, engine.token_delay = True, 64, 0.0


@pytest.fixture(scope="module")
def stub(engine):
    host = ServiceHost("127.0.0.1", 0, [SERVICE_NAME])
    add_generation_service(host, engine)
    host.start()
    host.set_serving(True)
    channel = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    yield generation_pb2_grpc.GenerationStub(channel)
    channel.close()
    host.stop(0)


def generate(stub, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=20))


def test_text_prompt_streams_tokens_then_usage(stub, engine):
    out = generate(stub, prompt="Hello", max_tokens=10, request_id="r-text")
    assert all(m.request_id == "r-text" for m in out)
    assert "".join(m.text for m in out) == expected_text(10)
    assert [t for m in out for t in m.token_ids] == engine.tokenizer.encode(expected_text(10))
    *body, last = out
    assert all(m.finish_reason == "" and not m.HasField("usage") and not m.HasField("spec_stats")
               for m in body)
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (5, 10, 15)
    assert (last.spec_stats.draft_tokens, last.spec_stats.accepted_tokens, last.spec_stats.verify_steps,
            last.spec_stats.plain_steps) == (15, 5, 5, 0)
    prompt, params = engine.submitted["r-text"]
    assert prompt == engine.tokenizer.encode("Hello")
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.logprobs,
            params.speculation) == (1.0, 1.0, 0, None, None, None)


def test_token_prompt_with_sampling_stop_and_speculation(stub, engine):
    out = generate(stub, prompt_token_ids=[5, 6, 7], max_tokens=30, temperature=0.7, top_p=0.9, top_k=5,
                   seed=3, stop=["fox"], stop_token_ids=[99], ignore_eos=True, speculation="never")
    rid = out[0].request_id
    assert rid.startswith("gen-")
    assert "".join(m.text for m in out) == expected_text(30, 3, ("fox",))
    last = out[-1]
    assert last.finish_reason == "stop"
    assert last.spec_stats.plain_steps == last.usage.completion_tokens == len(out)
    prompt, params = engine.submitted[rid]
    assert prompt == [5, 6, 7]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 5, 3)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.speculation) == (
        ("fox",), (99,), True, "never")


def test_default_max_tokens_and_logprobs(stub, engine):
    out = generate(stub, prompt="a", logprobs=1, speculation="never")
    assert out[-1].usage.completion_tokens == 16
    lps = [lp for m in out for lp in m.logprobs]
    assert [lp.token.token for lp in lps] == list(expected_text(16))
    assert all(abs(lp.token.logprob - TOKEN_LOGPROB) < 1e-6 for lp in lps)
    assert [(t.token, round(t.logprob, 4)) for t in lps[0].top] == [("T", TOKEN_LOGPROB)]
    assert OTHER_LOGPROB not in [t.logprob for lp in lps for t in lp.top]  # only the 1 asked for


@pytest.mark.parametrize("fields", [
    dict(prompt="a", prompt_token_ids=[1]),
    dict(),
    dict(prompt="a", temperature=-1.0),
    dict(prompt="a", speculation="sometimes"),
    dict(prompt="a", logprobs=21),
    dict(prompt="x" * 200),
    dict(prompt="a", max_tokens=1000),
])
def test_bad_requests_are_invalid_argument(stub, fields):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()


def test_queue_full_and_not_ready(stub, engine):
    engine.max_queue = 0
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt="a")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    engine.max_queue, engine.is_ready = 64, False
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt="a")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_cancel_aborts(stub, engine):
    engine.token_delay = 0.05
    call = stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=100, request_id="r-cancel"), timeout=20)
    first = next(call)
    assert first.text and first.finish_reason == ""
    call.cancel()
    deadline = time.time() + 5
    while "r-cancel" not in engine.aborted:
        assert time.time() < deadline, "cancelling the call did not abort the request"
        time.sleep(0.02)
    assert engine.running == 0


def test_deadline_aborts(stub, engine):
    engine.token_delay = 0.05
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=100, request_id="r-deadline"),
                           timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.time() + 5
    while "r-deadline" not in engine.aborted:
        assert time.time() < deadline, "a passed deadline did not abort the request"
        time.sleep(0.02)


def test_a_refused_generate_is_logged_once_with_code_param_and_request_id(stub, engine, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.gateway.grpc")
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt="a", presence_penalty=2.5, request_id="grpc-refused-7")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1
    assert "grpc-refused-7" in lines[0] and "INVALID_ARGUMENT" in lines[0] and "param=presence_penalty" in lines[0]


def test_logits_controls_reach_the_engine(stub, engine):
    generate(stub, prompt="a", max_tokens=4, request_id="r-controls", repetition_penalty=1.5, frequency_penalty=0.5,
             presence_penalty=-0.25, min_p=0.125, min_tokens=2, logit_bias={7: -100.0, 3: 2.5},
             include_stop_str_in_output=True, skip_special_tokens=False)
    p = engine.submitted["r-controls"][1]
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p, p.min_tokens) == \
        (1.5, 0.5, -0.25, 0.125, 2)
    assert p.logit_bias == ((3, 2.5), (7, -100.0))
    assert p.include_stop_str_in_output and not p.skip_special_tokens
