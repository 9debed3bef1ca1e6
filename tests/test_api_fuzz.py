"""Property-based fuzzing of the gateway's REST and gRPC APIs against a real stack (bounded).

Bodies are drawn near the valid ones (every known field, with values valid,
out of range or of the wrong type) and far from them (any JSON, any bytes).
Whatever arrives: a 2xx with a well-formed body or stream, or a 4xx in
OpenAI's shape; never a 5xx. gRPC: OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED;
never INTERNAL, UNKNOWN or UNAVAILABLE. The stack serves normally afterwards.

Examples are derandomized (the same every CI run) and few; set
TANDEM_FUZZ_EXAMPLES to draw more, e.g. 2000 for a long local run.
"""

from __future__ import annotations

import json
import os
import re

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.chat import ROLES
from tandem.v1 import generation_pb2 as pb
from tests.byte_stack import MAX_MODEL_LEN, VOCAB
from tests.test_bad_input_corpus import assert_alive

SCALE = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "0"))


def fuzz_settings(examples: int):
    return settings(max_examples=SCALE or examples, deadline=None, derandomize=not SCALE, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
SMALL_TOKENS = st.integers(1, 4)  # what a valid request asks for: the fuzz stays fast

# field: (valid values, wrong values: out of range or of another type)
COMMON = {
    "model": (st.sampled_from([None, "target"]), st.text(max_size=8)),
    "max_tokens": (SMALL_TOKENS, st.integers(-3, MAX_MODEL_LEN + 2) | st.integers() | JSON),
    "temperature": (st.sampled_from([0, 0.7, 1.0]), st.floats() | JSON),
    "top_p": (st.floats(0.05, 1.0), st.floats() | JSON),
    "top_k": (st.integers(-1, 50), st.integers() | JSON),
    "stop": (st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=3),
             st.lists(st.text(max_size=2), max_size=3) | JSON),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(st.integers(), max_size=3) | JSON),
    "seed": (st.integers(0, 2**32), st.integers() | JSON),
    "n": (st.integers(1, 2), st.integers(-2, 70) | st.integers() | JSON),
    "stream": (st.booleans(), JSON),
    "speculation": (st.sampled_from(["auto", "always", "never"]), st.text(max_size=8) | JSON),
    "ignore_eos": (st.booleans(), JSON),
    "presence_penalty": (st.floats(-2, 2), st.floats() | JSON),
    "frequency_penalty": (st.floats(-2, 2), st.floats() | JSON),
    "repetition_penalty": (st.floats(0.5, 2), st.floats() | JSON),
    "min_p": (st.floats(0, 1), st.floats() | JSON),
    "min_tokens": (st.integers(0, 1), st.integers() | JSON),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.floats() | JSON, min_size=1, max_size=2) | JSON),
    "include_stop_str_in_output": (st.booleans(), JSON),
    "skip_special_tokens": (st.booleans(), JSON),
    "unknown field": (st.nothing(), st.dictionaries(st.text(max_size=6), JSON, min_size=1, max_size=1)),
}
COMPLETION_FIELDS = {
    **COMMON,
    "prompt": (st.text(min_size=1, max_size=MAX_MODEL_LEN // 2)
               | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
               | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=2),
               st.lists(st.integers(-3, VOCAB + 3), max_size=MAX_MODEL_LEN + 3) | st.text(max_size=MAX_MODEL_LEN * 2)
               | JSON),
    "logprobs": (st.integers(0, 3), st.integers() | JSON),
    "echo": (st.booleans(), JSON),
}
CONTENT = st.text(max_size=8) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=4)}),
                                         max_size=2)
CHAT_FIELDS = {
    **COMMON,
    "messages": (st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": CONTENT}),
                          min_size=1, max_size=3),
                 st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), JSON), max_size=3) | JSON),
    "max_completion_tokens": (SMALL_TOKENS, st.integers() | JSON),
    "logprobs": (st.booleans(), JSON),
    "top_logprobs": (st.integers(0, 3), st.integers() | JSON),
}


@st.composite
def near_valid(draw, fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]], required: str) -> dict:
    """A valid body (some optional fields set), then, half the time, one field made wrong."""
    optional = {name: valid for name, (valid, _) in fields.items() if name != required}
    body = draw(st.fixed_dictionaries({required: fields[required][0]}, optional=optional))
    body.pop("unknown field", None)
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(fields)))
        wrong = draw(fields[name][1])
        if name == "unknown field":
            body.update(wrong)
        else:
            body[name] = wrong
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


def assert_well_formed(r: httpx.Response, streamed: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    if not streamed:
        body = r.json()
        assert body["choices"] and "usage" in body and "spec_stats" in body, body
        return
    # Server-sent events end lines with \r\n, \n or \r only: str.splitlines() would also cut a chunk at a
    # U+0085 or U+2028 the generated text holds (valid, unescaped, inside a JSON string).
    lines = re.split(r"\r\n|\r|\n", r.text)
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", r.text
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks), r.text  # an in-band error is a failure mid-stream


def post(stack, path: str, body: dict | bytes) -> None:
    # json.dumps writes NaN and Infinity, as some clients do; httpx's json= would refuse them.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{stack.url}/v1/{path}", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    streamed = isinstance(body, dict) and body.get("stream") is True and r.status_code == 200
    event(f"HTTP {r.status_code}{' (streamed)' if streamed else ''}")  # --hypothesis-show-statistics
    assert_well_formed(r, streamed)


@pytest.fixture(scope="module")
def stack(byte_stack):
    yield byte_stack
    assert_alive(byte_stack)  # after every fuzz test of this module


@fuzz_settings(60)
@given(body=near_valid(COMPLETION_FIELDS, "prompt"))
def test_completions_never_answer_5xx(stack, body):
    post(stack, "completions", body)


@fuzz_settings(40)
@given(body=near_valid(CHAT_FIELDS, "messages"))
def test_chat_completions_never_answer_5xx(stack, body):
    post(stack, "chat/completions", body)


@fuzz_settings(30)
@given(body=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)),
       path=st.sampled_from(["completions", "chat/completions"]))
def test_arbitrary_bodies_never_answer_5xx(stack, body, path):
    post(stack, path, body)


# ---------------------------------------------------------------------------- gRPC

INT32, UINT32, UINT64 = st.integers(-2**31, 2**31 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)


# field: (valid values, wrong values); a protobuf field cannot carry another type, so wrong is out of range.
GENERATE_FIELDS = {
    "request_id": (st.text(max_size=8), st.nothing()),
    "max_tokens": (SMALL_TOKENS, UINT32),
    "temperature": (st.sampled_from([0.0, 0.7, 1.0]), st.floats(width=32)),
    "top_p": (st.floats(0.125, 1.0, width=32), st.floats(width=32)),
    "top_k": (st.integers(0, 50), UINT32),
    "seed": (UINT64, st.nothing()),
    "stop": (st.lists(st.text(min_size=1, max_size=2), max_size=3), st.lists(st.text(max_size=2), max_size=3)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(INT32, max_size=3)),
    "ignore_eos": (st.booleans(), st.nothing()),
    "logprobs": (st.integers(0, 3), UINT32),
    "speculation": (st.sampled_from(["", "auto", "always", "never"]), st.text(max_size=8)),
    "repetition_penalty": (st.floats(0.5, 2, width=32), st.floats(width=32)),
    "frequency_penalty": (st.floats(-2, 2, width=32), st.floats(width=32)),
    "presence_penalty": (st.floats(-2, 2, width=32), st.floats(width=32)),
    "min_p": (st.floats(0, 1, width=32), st.floats(width=32)),
    "min_tokens": (st.integers(0, 1), UINT32),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=3),
                   st.dictionaries(INT32, st.floats(width=32), min_size=1, max_size=2)),
    "prompt": (st.text(min_size=1, max_size=MAX_MODEL_LEN // 2), st.text(max_size=MAX_MODEL_LEN * 2)),
    "prompt_token_ids": (st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
                         st.lists(INT32, max_size=MAX_MODEL_LEN + 3)),
}


@st.composite
def near_valid_generate(draw) -> dict:
    """A valid request (one prompt form, some optional fields), then, half the time, one field made wrong
    (which may add the second prompt form)."""
    optional = {name: valid for name, (valid, _) in GENERATE_FIELDS.items() if not name.startswith("prompt")}
    fields = draw(st.fixed_dictionaries({}, optional=optional))
    form = draw(st.sampled_from(["prompt", "prompt_token_ids"]))
    fields[form] = draw(GENERATE_FIELDS[form][0])
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(n for n, (_, wrong) in GENERATE_FIELDS.items() if not wrong.is_empty)))
        fields[name] = draw(GENERATE_FIELDS[name][1])
    return fields


FINE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def channel(stack):
    ch = grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}")
    yield ch
    ch.close()


def call(channel: grpc.Channel, payload: bytes) -> grpc.StatusCode:
    generate = channel.unary_stream("/tandem.v1.Generation/Generate")  # bytes in, bytes out
    try:
        replies = [pb.GenerateResponse.FromString(m) for m in generate(payload, timeout=60)]
    except grpc.RpcError as e:
        assert e.details(), e
        event(e.code().name)
        return e.code()
    assert replies and replies[-1].finish_reason, replies
    event("OK")
    return grpc.StatusCode.OK


@fuzz_settings(60)
@given(fields=near_valid_generate())
def test_generate_never_fails_inside(channel, fields):
    assert call(channel, pb.GenerateRequest(**fields).SerializeToString()) in FINE


@fuzz_settings(20)
@given(payload=st.binary(max_size=128))
def test_generate_with_arbitrary_bytes_never_fails_inside(channel, payload):
    assert call(channel, payload) in FINE
