"""A corpus of malformed requests against a real stack: each is a 4xx in OpenAI's shape (REST) or
INVALID_ARGUMENT with a message (gRPC), and the stack keeps serving after every one of them.

The stack (tests/byte_stack.py) allows MAX_MODEL_LEN tokens per sequence and
MAX_REQUEST_BYTES per body or message; its byte-level tokenizer has one token
per byte, so a prompt's length in tokens is its length in UTF-8 bytes.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.byte_stack import MAX_MODEL_LEN, MAX_QUEUE, MAX_REQUEST_BYTES, VOCAB

L = MAX_MODEL_LEN
OK_IDS = [10] * (L - 1)  # one short of the model's length: room for exactly one token


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status != 429 else "rate_limit_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_alive(stack) -> None:
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# (name, path, body as bytes or JSON, status, param, code)
CORPUS: list[tuple[str, str, bytes | dict, int, str | None, str | None]] = [
    ("broken JSON", "completions", b'{"prompt": "a", ', 400, None, "invalid_json"),
    ("not an object", "completions", b"[1, 2, 3]", 400, None, "invalid_json"),
    ("not JSON at all", "chat/completions", b"\x00\x01binary", 400, None, "invalid_json"),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe\xfd"}', 400, None, "invalid_json"),
    ("a lone surrogate", "completions", b'{"prompt": "\\ud800"}', 400, None, "invalid_json"),
    ("a lone surrogate in chat", "chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, None, "invalid_json"),
    ("nested too deeply", "completions", b"[" * 20_000 + b"]" * 20_000, 400, None, "invalid_json"),
    ("NaN temperature", "completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature", None),
    ("prompt of the wrong type", "completions", {"prompt": 123}, 400, "prompt", None),
    ("prompt of mixed types", "completions", {"prompt": ["a", 1]}, 400, "prompt", None),
    ("max_tokens a string", "completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens", None),
    ("temperature a string", "completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature", None),
    ("stream a list", "completions", {"prompt": "a", "stream": [1]}, 400, "stream", None),
    ("messages a string", "chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("message content a number", "chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, None, None),
    ("an unknown role", "chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
    ("no messages", "chat/completions", {"messages": []}, 400, None, None),
    ("an unknown field", "completions", {"prompt": "a", "bogus": 1}, 400, "bogus", "unrecognized_argument"),
    ("negative temperature", "completions", {"prompt": "a", "temperature": -1}, 400, None, None),
    ("temperature past float32", "completions", {"prompt": "a", "temperature": 1e300}, 400, None, None),
    ("top_p zero", "completions", {"prompt": "a", "top_p": 0}, 400, None, None),
    ("top_p above one", "completions", {"prompt": "a", "top_p": 1.5}, 400, None, None),
    ("top_k below -1", "completions", {"prompt": "a", "top_k": -5}, 400, "top_k", None),
    ("top_k past uint32", "completions", {"prompt": "a", "top_k": 2**40}, 400, None, None),
    ("max_tokens zero", "completions", {"prompt": "a", "max_tokens": 0}, 400, None, None),
    ("max_tokens huge", "completions", {"prompt": "a", "max_tokens": 10**30}, 400, None, None),
    ("logprobs too many", "completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs", None),
    ("top_logprobs without logprobs", "chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ("negative seed", "completions", {"prompt": "a", "seed": -1}, 400, "seed", None),
    ("seed past uint64", "completions", {"prompt": "a", "seed": 2**64}, 400, "seed", None),
    ("n zero", "completions", {"prompt": "a", "n": 0}, 400, "n", None),
    ("n too large", "completions", {"prompt": "a", "n": 65}, 400, "n", None),
    ("an empty stop string", "completions", {"prompt": "a", "stop": [""]}, 400, None, None),
    ("stop a number", "completions", {"prompt": "a", "stop": 5}, 400, None, None),
    ("an unknown speculation mode", "completions", {"prompt": "a", "speculation": "sometimes"},
     400, "speculation", None),
    ("stream_options without stream", "completions", {"prompt": "a", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("an empty prompt", "completions", {"prompt": ""}, 400, None, None),
    ("an empty prompt list", "completions", {"prompt": []}, 400, "prompt", None),
    ("an empty token list", "completions", {"prompt": [[]]}, 400, "prompt", None),
    ("a negative token id", "completions", {"prompt": [5, -1]}, 400, None, None),
    ("a token id past the vocabulary", "completions", {"prompt": [5, VOCAB]}, 400, None, None),
    ("a prompt exactly the model's length", "completions", {"prompt": [10] * L}, 400, None, None),
    ("a prompt one token past the model's length", "completions", {"prompt": [10] * (L + 1)}, 400, None, None),
    ("a text prompt past the model's length", "completions", {"prompt": "x" * (L + 1)}, 400, None, None),
    ("a chat past the model's length", "chat/completions",
     {"messages": [{"role": "user", "content": "x" * L}]}, 400, None, None),
    ("room for one token, two asked", "completions", {"prompt": OK_IDS, "max_tokens": 2}, 400, None, None),
    # Out-of-range values of every logits control (vLLM's and OpenAI's bounds).
    ("repetition_penalty zero", "completions", {"prompt": "a", "repetition_penalty": 0}, 400,
     "repetition_penalty", None),
    ("repetition_penalty negative", "completions", {"prompt": "a", "repetition_penalty": -1.5}, 400,
     "repetition_penalty", None),
    ("repetition_penalty past float32", "completions", {"prompt": "a", "repetition_penalty": 1e300}, 400,
     "repetition_penalty", None),
    ("repetition_penalty NaN", "completions", b'{"prompt": "a", "repetition_penalty": NaN}', 400,
     "repetition_penalty", None),
    ("frequency_penalty above 2", "completions", {"prompt": "a", "frequency_penalty": 2.5}, 400,
     "frequency_penalty", None),
    ("frequency_penalty below -2", "completions", {"prompt": "a", "frequency_penalty": -3}, 400,
     "frequency_penalty", None),
    ("presence_penalty above 2", "chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "presence_penalty": 2.01}, 400, "presence_penalty", None),
    ("presence_penalty infinite", "completions", b'{"prompt": "a", "presence_penalty": Infinity}', 400,
     "presence_penalty", None),
    ("min_p above 1", "completions", {"prompt": "a", "min_p": 1.5}, 400, "min_p", None),
    ("min_p negative", "completions", {"prompt": "a", "min_p": -0.1}, 400, "min_p", None),
    ("min_tokens negative", "completions", {"prompt": "a", "min_tokens": -1}, 400, "min_tokens", None),
    ("min_tokens above max_tokens", "completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400,
     "min_tokens", None),
    ("min_tokens a string", "completions", {"prompt": "a", "min_tokens": "few"}, 400, "min_tokens", None),
    ("logit_bias past 100", "completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("logit_bias below -100", "chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"5": -1000}}, 400, "logit_bias", None),
    ("logit_bias key not a token id", "completions", {"prompt": "a", "logit_bias": {"abc": 1}}, 400,
     "logit_bias", None),
    ("logit_bias negative token id", "completions", {"prompt": "a", "logit_bias": {"-5": 1}}, 400,
     "logit_bias", None),
    ("logit_bias token id past the vocabulary", "completions", {"prompt": "a", "logit_bias": {str(VOCAB): 1}},
     400, "logit_bias", None),
    ("logit_bias not an object", "completions", {"prompt": "a", "logit_bias": [1, 2]}, 400, "logit_bias", None),
    ("logit_bias value not a number", "completions", {"prompt": "a", "logit_bias": {"5": "up"}}, 400, None, None),
    ("echo with logprobs", "completions", {"prompt": "a", "echo": True, "logprobs": 1}, 400, "echo",
     "unsupported_value"),
    ("skip_special_tokens a list", "completions", {"prompt": "a", "skip_special_tokens": [0]}, 400,
     "skip_special_tokens", None),
    ("continuous usage a list", "completions",
     {"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": [1]}},
     400, "stream_options.continuous_usage_stats", None),
    ("an unknown stream option", "completions",
     {"prompt": "a", "stream": True, "stream_options": {"bogus": True}}, 400, "stream_options.bogus",
     "unrecognized_argument"),
    ("spaces between special tokens off", "completions", {"prompt": "a", "spaces_between_special_tokens": False},
     400, "spaces_between_special_tokens", "unsupported_value"),
    ("unsupported tools", "chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400, "tools", None),
    ("an unknown model", "completions", {"prompt": "a", "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("an oversized body", "completions", {"prompt": "x" * (MAX_REQUEST_BYTES + 1)}, 413, None, "request_too_large"),
    ("more choices than the queue holds", "completions",
     {"prompt": ["a", "b", "c"], "n": MAX_QUEUE // 2 + 1, "max_tokens": 1}, 429, None, "queue_full"),
]


@pytest.mark.parametrize("name, path, body, status, param, code", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_rest_request_is_a_4xx_in_openai_shape(byte_stack, name, path, body, status, param, code):
    url = f"{byte_stack.url}/v1/{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert_openai_error(r, status, param, code)
    if status == 429:
        assert r.headers["retry-after"] == "1"


def test_a_chunked_body_past_the_limit_is_413(byte_stack):
    def chunks():  # no Content-Length: the gateway counts as the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{byte_stack.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, code="request_too_large")


def test_wrong_method_and_unknown_route_are_openai_shaped(byte_stack):
    r = httpx.get(f"{byte_stack.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{byte_stack.url}/v2/anything", json={}, timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_one_short_of_the_model_length_gets_its_one_token(byte_stack):
    r = httpx.post(f"{byte_stack.url}/v1/completions", json={"prompt": OK_IDS, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": L - 1, "completion_tokens": 1, "total_tokens": L}


# ---------------------------------------------------------------------------- gRPC

GRPC_CORPUS: list[tuple[str, dict]] = [
    ("no prompt", {}),
    ("an empty text prompt", {"prompt": ""}),
    ("both prompt forms", {"prompt": "a", "prompt_token_ids": [5]}),
    ("a negative token id", {"prompt_token_ids": [5, -1]}),
    ("a token id past the vocabulary", {"prompt_token_ids": [5, VOCAB]}),
    ("a prompt exactly the model's length", {"prompt_token_ids": [10] * L}),
    ("a prompt one token past the model's length", {"prompt_token_ids": [10] * (L + 1)}),
    ("room for one token, two asked", {"prompt_token_ids": OK_IDS, "max_tokens": 2}),
    ("max_tokens past the room", {"prompt": "a", "max_tokens": 2**32 - 1}),
    ("negative temperature", {"prompt": "a", "temperature": -1.0}),
    ("NaN temperature", {"prompt": "a", "temperature": float("nan")}),
    ("infinite temperature", {"prompt": "a", "temperature": float("inf")}),
    ("top_p above one", {"prompt": "a", "top_p": 2.0}),
    ("top_k past int32", {"prompt": "a", "top_k": 2**32 - 1}),
    ("logprobs too many", {"prompt": "a", "logprobs": 50}),
    ("an unknown speculation mode", {"prompt": "a", "speculation": "sometimes"}),
    ("an empty stop string", {"prompt": "a", "stop": [""]}),
    ("repetition_penalty zero", {"prompt": "a", "repetition_penalty": 0.0}),
    ("repetition_penalty NaN", {"prompt": "a", "repetition_penalty": float("nan")}),
    ("frequency_penalty above 2", {"prompt": "a", "frequency_penalty": 2.5}),
    ("presence_penalty below -2", {"prompt": "a", "presence_penalty": -2.5}),
    ("presence_penalty infinite", {"prompt": "a", "presence_penalty": float("inf")}),
    ("min_p above 1", {"prompt": "a", "min_p": 1.5}),
    ("min_tokens above max_tokens", {"prompt": "a", "max_tokens": 3, "min_tokens": 4}),
    ("logit_bias past 100", {"prompt": "a", "logit_bias": {5: 101.0}}),
    ("logit_bias negative token id", {"prompt": "a", "logit_bias": {-5: 1.0}}),
    ("logit_bias token id past the vocabulary", {"prompt": "a", "logit_bias": {VOCAB: 1.0}}),
]


@pytest.fixture(scope="module")
def channel(byte_stack):
    ch = grpc.insecure_channel(f"127.0.0.1:{byte_stack.grpc_port}",
                               options=[("grpc.max_send_message_length", 4 * MAX_REQUEST_BYTES)])
    yield ch
    ch.close()


def call_raw(channel: grpc.Channel, payload: bytes) -> list[bytes]:
    generate = channel.unary_stream("/tandem.v1.Generation/Generate")  # bytes in, bytes out
    return list(generate(payload, timeout=60))


@pytest.mark.parametrize("name, fields", GRPC_CORPUS, ids=[c[0] for c in GRPC_CORPUS])
def test_malformed_generate_request_is_invalid_argument(byte_stack, channel, name, fields):
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(**fields), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert e.value.details()


@pytest.mark.parametrize("name, payload", [
    ("a string field that is not UTF-8", pb.GenerateRequest(prompt="ab").SerializeToString().replace(
        b"ab", b"\xff\xfe")),
    ("bytes that are no message", b"\xff" * 16),
])
def test_an_unparsable_generate_request_is_invalid_argument(byte_stack, channel, name, payload):
    with pytest.raises(grpc.RpcError) as e:
        call_raw(channel, payload)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "GenerateRequest" in e.value.details()


def test_an_oversized_generate_message_is_refused(byte_stack, channel):
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="x" * (MAX_REQUEST_BYTES + 1)), timeout=60))
    # grpc itself refuses a message over the server's bound, with this code, before any servicer runs.
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value


def test_the_stack_still_serves_after_the_corpus(byte_stack, channel):
    assert_alive(byte_stack)
    stub = generation_pb2_grpc.GenerationStub(channel)
    out = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=OK_IDS, temperature=0.0), timeout=60))
    assert out[-1].finish_reason == "length" and out[-1].usage.completion_tokens == 1
