"""The OpenAI/vLLM surface around generation: continuous usage, echo, vLLM's speculative
statistics, rejected requests in the log; and the output-text controls of a request
(include_stop_str_in_output, skip_special_tokens, min_tokens against stop strings)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from gateway.openai_api import create_app
from gateway.request import Request
from gateway.types import FinishReason, GenerationParams, SpecStats
from tests.fake_engine import FakeEngine, expected_text, make_char_tokenizer
from tests.test_openai_api import ServerThread


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_char_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = FakeEngine(tokenizer)
    srv = ServerThread(create_app(engine))
    yield srv
    srv.stop()
    engine.close()


def stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/{path}", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "hello"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk(server, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    chunks = stream(server.url, path, {**body, "max_tokens": 9, "speculation": "never", "stream_options": options})
    *content, final = chunks
    usages = [c["usage"] for c in content]
    assert all(u is not None for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 9
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert final["choices"] == [] and final["usage"] == usages[-1]
    # Without include_usage, continuous_usage_stats adds nothing (vLLM's rule).
    plain = stream(server.url, path, {**body, "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)


def test_speculative_statistics_in_vllms_shape_beside_spec_stats(server):
    full = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8, "speculation": "always"},
                      timeout=30).json()
    spec = full["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] == full["spec_stats"]["verify_steps"] == 4
    assert spec["num_draft_tokens"] == full["spec_stats"]["draft_tokens"]
    assert spec["num_accepted_draft_tokens"] == full["spec_stats"]["accepted_tokens"] == 4
    assert spec["acceptance_histogram"] == [0, 4]  # every step accepted exactly one drafted token
    assert spec["mean_acceptance_length"] == 2.0 and spec["draft_acceptance_rate"] == pytest.approx(1 / 3)
    final = stream(server.url, "completions", {"prompt": "hi", "max_tokens": 8, "speculation": "always",
                                               "stream_options": {"include_usage": True}})[-1]
    assert final["metrics"]["speculative_decoding"] == spec
    two = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2}, timeout=30)
    assert two.json()["metrics"] is None  # per request, as vLLM: not for several choices


def test_echo_puts_the_prompt_before_the_output(server, tokenizer):
    out = expected_text(6)
    full = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 6, "echo": True},
                      timeout=30).json()
    assert sorted(c["text"] for c in full["choices"]) == ["ab" + out, "cd" + out]
    ids = tokenizer.encode("xyz", add_special_tokens=False)
    full = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 6, "echo": True},
                      timeout=30).json()
    assert full["choices"][0]["text"] == "xyz" + out
    chunks = stream(server.url, "completions", {"prompt": "ab", "max_tokens": 6, "echo": True})
    assert chunks[0]["choices"][0]["text"] == "ab"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab" + out


def test_a_rejected_request_is_logged_once_with_status_param_and_request_id(server, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.gateway.api")
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "min_p": 3}, timeout=30,
                   headers={"X-Request-Id": "trace-me-42"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-me-42"
    r2 = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "bogus": 1}, timeout=30)
    lines = [rec for rec in caplog.records if rec.levelno == logging.WARNING and "rejected" in rec.getMessage()]
    assert len(lines) == 2
    first, second = (rec.getMessage() for rec in lines)
    assert "trace-me-42" in first and "400" in first and "param=min_p" in first
    assert r2.headers["x-request-id"] in second and "param=bogus" in second


# ---------------------------------------------------------------------------- a request's output text

def new_request(tokenizer, **params) -> Request:
    return Request(request_id="r", prompt=tokenizer.encode("go", add_special_tokens=False),
                   params=GenerationParams(max_tokens=20, temperature=0, **params), sink=lambda d: None,
                   eos_ids=frozenset({tokenizer.eos_token_id}), tokenizer=tokenizer, max_model_len=128)


def feed(req: Request, tokenizer, text: str, extra: list[int] = ()) -> tuple[str, FinishReason | None]:
    ids = tokenizer.encode(text, add_special_tokens=False) + list(extra)
    out = ""
    for i, tok in enumerate(ids):
        delta = req.commit([tok], [0.0], [], 2 + i, SpecStats())
        out += delta.text
        if delta.finish_reason:
            return out, delta.finish_reason
    return out, None


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text(tokenizer):
    assert feed(new_request(tokenizer, stop=("END",)), tokenizer, "abcENDxyz") == ("abc", FinishReason.STOP)
    kept = new_request(tokenizer, stop=("END",), include_stop_str_in_output=True)
    assert feed(kept, tokenizer, "abcENDxyz") == ("abcEND", FinishReason.STOP)
    semicolon = tokenizer.convert_tokens_to_ids(";")
    cut = new_request(tokenizer, stop_token_ids=(semicolon,))
    assert feed(cut, tokenizer, "ab;cd") == ("ab", FinishReason.STOP)
    kept = new_request(tokenizer, stop_token_ids=(semicolon,), include_stop_str_in_output=True)
    assert feed(kept, tokenizer, "ab;cd") == ("ab;", FinishReason.STOP)


def test_skip_special_tokens_false_shows_special_tokens_in_the_text(tokenizer):
    bos = tokenizer.bos_token_id
    assert feed(new_request(tokenizer), tokenizer, "ab", [bos])[0] == "ab"
    assert feed(new_request(tokenizer, skip_special_tokens=False), tokenizer, "ab", [bos])[0] == "ab<s>"
    shown = new_request(tokenizer, skip_special_tokens=False, include_stop_str_in_output=True)
    assert feed(shown, tokenizer, "ab", [tokenizer.eos_token_id]) == ("ab</s>", FinishReason.STOP)


def test_no_stop_string_ends_the_output_before_min_tokens(tokenizer):
    early = new_request(tokenizer, stop=("b",), min_tokens=4)
    assert feed(early, tokenizer, "abcabc") == ("abca", FinishReason.STOP)  # the second "b" (5th token) ends it
    assert feed(new_request(tokenizer, stop=("b",)), tokenizer, "abcabc") == ("a", FinishReason.STOP)
