"""The REST API under a real uvicorn server, driven by the official openai client."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from gateway.chat import chat_prompt_ids, render_plain
from gateway.openai_api import create_app
from tests.fake_engine import OTHER_LOGPROB, TOKEN_LOGPROB, FakeEngine, expected_text, make_char_tokenizer

API_KEY = "sk-test-key"


class ServerThread:
    """uvicorn on a free port in a background thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_char_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def engine(tokenizer):
    e = FakeEngine(tokenizer)
    yield e
    e.close()


@pytest.fixture(autouse=True)
def reset_engine(engine):
    engine.is_ready, engine.max_queue, engine.token_delay = True, 64, 0.0
    yield
    engine.is_ready, engine.max_queue, engine.token_delay = True, 64, 0.0


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(create_app(engine, None, ["tiny-fake", "alias"]))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_server(engine):
    s = ServerThread(create_app(engine, API_KEY))
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def test_completion_text_usage_and_spec_stats(client, engine):
    r = client.completions.create(model="tiny-fake", prompt="Hello", max_tokens=10, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny-fake"
    assert [c.index for c in r.choices] == [0]
    assert r.choices[0].text == expected_text(10) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 10, 15)
    # Default speculation: the fake verifies two tokens per step.
    assert r.model_extra["spec_stats"] == {"draft_tokens": 15, "accepted_tokens": 5, "verify_steps": 5,
                                           "plain_steps": 0}
    prompt, params = engine.submitted[r.id]
    assert prompt == engine.tokenizer.encode("Hello")
    assert params.max_tokens == 10 and params.temperature == 0 and params.speculation is None


def test_completion_defaults_and_speculation_extension(client, engine):
    r = client.completions.create(model="alias", prompt=[5, 6, 7], extra_body={"speculation": "never",
                                                                                "top_k": 3})
    assert r.model == "alias"
    params = engine.submitted[r.id][1]
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_k == 3
    assert params.speculation == "never"
    assert r.model_extra["spec_stats"] == {"draft_tokens": 0, "accepted_tokens": 0, "verify_steps": 0,
                                           "plain_steps": 16}


def test_model_may_be_omitted(server, engine):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-fake" and r.json()["choices"][0]["text"] == expected_text(3)


def test_chat_uses_plain_template_without_chat_template(client, engine, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="tiny-fake", messages=messages, max_completion_tokens=7)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == expected_text(7)
    assert r.choices[0].finish_reason == "length"
    prompt, params = engine.submitted[r.id]
    assert prompt == tokenizer.encode("system: Be brief.\nuser: Hi\nassistant:")
    assert params.max_tokens == 7
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 7


def test_chat_without_max_tokens_gets_the_room_left(client, engine):
    r = client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"speculation": "always"})
    prompt, params = engine.submitted[r.id]
    assert params.max_tokens == engine.max_model_len - len(prompt)
    assert r.usage.completion_tokens == params.max_tokens


def test_chat_template_is_used_when_the_tokenizer_has_one(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    try:
        assert chat_prompt_ids(tokenizer, messages) == tokenizer.encode("<user>Hi!<assistant>")
    finally:
        tokenizer.chat_template = None
    assert chat_prompt_ids(tokenizer, messages) == tokenizer.encode(render_plain(
        [{"role": "user", "content": "Hi!"}]))


def test_stop_strings(client, engine):
    r = client.completions.create(model="tiny-fake", prompt="a", max_tokens=30, stop="fox")
    assert r.choices[0].text == "The quick brown " and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len("The quick brown fox")
    assert engine.submitted[r.id][1].stop == ("fox",)
    r = client.completions.create(model="tiny-fake", prompt="a", max_tokens=30, stop=["zzz", "brown"])
    assert r.choices[0].text == "The quick " and engine.submitted[r.id][1].stop == ("zzz", "brown")


def test_n_choices_use_consecutive_seeds_and_sum_usage(client, engine):
    r = client.completions.create(model="tiny-fake", prompt="ab", max_tokens=6, n=2, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [expected_text(6, 5), expected_text(6, 6)]
    assert [engine.submitted[f"{r.id}-{i}"][1].seed for i in range(2)] == [5, 6]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 12)
    assert r.model_extra["spec_stats"]["verify_steps"] == 6


def test_list_prompts_give_one_choice_each(client, engine):
    r = client.completions.create(model="tiny-fake", prompt=[[10, 11, 12], [13, 14]], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [engine.submitted[f"{r.id}-{i}"][0] for i in range(4)] == [[10, 11, 12]] * 2 + [[13, 14]] * 2
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    r = client.completions.create(model="tiny-fake", prompt=["ab", "cde"], max_tokens=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny-fake", prompt="a", max_tokens=4, logprobs=2,
                                  extra_body={"speculation": "never"})
    lp = r.choices[0].logprobs
    assert lp.tokens == list(expected_text(4)) and lp.token_logprobs == [TOKEN_LOGPROB] * 4
    assert lp.text_offset == [0, 1, 2, 3]
    assert lp.top_logprobs[0] == {"T": TOKEN_LOGPROB, "0": OTHER_LOGPROB}


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "a"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == list(expected_text(3))
    assert content[0].bytes == [ord("T")] and content[0].logprob == TOKEN_LOGPROB
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("T", TOKEN_LOGPROB),
                                                                       ("0", OTHER_LOGPROB)]
    r = client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "a"}],
                                       max_tokens=3)
    assert r.choices[0].logprobs is None


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "a"}],
                                            max_tokens=9, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(9)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].choices[0].delta.content is None
    *body, last = chunks
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage.completion_tokens == 9 and last.usage.prompt_tokens > 0
    assert last.model_extra["spec_stats"] == {"draft_tokens": 15, "accepted_tokens": 4, "verify_steps": 5,
                                              "plain_steps": 0}


def test_completion_stream_with_stop_and_n(client):
    stream = client.completions.create(model="tiny-fake", prompt="a", max_tokens=30, stop=["fox"], n=2,
                                       seed=0, stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
        usage = c.usage or usage
    assert texts == {0: "The quick brown ", 1: expected_text(30, 1, ("fox",))}
    assert finish == {0: "stop", 1: "stop"}
    assert usage.completion_tokens == len("The quick brown fox") + len("he quick brown fox")


def test_stream_wire_format(server):
    body = {"model": "tiny-fake", "prompt": "a", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "".join(p["choices"][0]["text"] for p in payloads) == expected_text(3)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)  # only with stream_options.include_usage



def test_deltas_that_arrive_together_still_stream_as_one_event_each(server, engine):
    """The server writes the deltas already waiting in one go (engine faster than the stream):
    every delta is still an event of its own, with one choice, in order, nothing merged or lost."""
    body = {"model": "tiny-fake", "prompt": "a", "max_tokens": 40, "n": 2, "seed": 0, "stream": True,
            "speculation": "never"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(len(p["choices"]) == 1 for p in payloads)
    for index in (0, 1):
        mine = [p["choices"][0] for p in payloads if p["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == expected_text(40, seed=index)
        assert len(mine) == 41 and mine[-1]["finish_reason"] == "length"  # a token a delta, then the finish


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), None),
    (dict(max_tokens=500), None),
    (dict(extra_body={"presence_penalty": 2.5}), "presence_penalty"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(extra_body={"speculation": "sometimes"}), "speculation"),
    (dict(extra_body={"echo": True, "logprobs": 1}), "echo"),
    (dict(max_tokens="many"), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=-1), "seed"),
    (dict(n=0), "n"),
])
def test_bad_arguments_are_400(client, kwargs, param):
    kwargs = {"model": "tiny-fake", "prompt": "a", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kwargs)
    err = _error(e.value)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_prompt_longer_than_the_model_is_400(client, engine):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-fake", prompt="x" * (engine.max_model_len + 1))
    assert "maximum context length" in _error(e.value)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-fake",
                                       messages=[{"role": "user", "content": "x" * engine.max_model_len}])


def test_malformed_bodies_are_400_not_422(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny-fake"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "wizard",
                                                                           "content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "a"}])
    assert _error(e.value)["code"] == "model_not_found"


def test_queue_full_is_429_and_partial_submissions_are_aborted(client, engine):
    engine.max_queue = 0
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny-fake", prompt="a")
    assert _error(e.value)["code"] == "queue_full"
    engine.max_queue = 1  # the second of two choices does not fit: the first must not linger
    engine.token_delay = 0.05
    before = set(engine.aborted)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny-fake", prompt="a", n=2, max_tokens=50)
    new = set(engine.aborted) - before
    assert len(new) == 1 and new.pop().endswith("-0") and engine.running == 0


def test_not_ready_is_503(client, server, engine):
    engine.is_ready = False
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny-fake", prompt="a")
    assert e.value.status_code == 503 and _error(e.value)["code"] == "service_unavailable"
    assert httpx.get(server.url + "/health").status_code == 503
    engine.is_ready = True
    assert httpx.get(server.url + "/health").status_code == 200


def test_unexpected_errors_are_500_without_details(client, engine, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(engine, "submit", boom)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny-fake", prompt="a")
    err = _error(e.value)
    assert e.value.status_code == 500 and "secret" not in e.value.response.text
    assert err["type"] == "server_error"


def test_api_key(keyed_server):
    base = keyed_server.url + "/v1"
    bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert _error(e.value)["code"] == "invalid_api_key"
    r = httpx.post(base + "/completions", json={"prompt": "a"})
    assert r.status_code == 401
    good = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0)
    assert good.completions.create(model="tiny-fake", prompt="a", max_tokens=2).choices[0].text == "Th"
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes need no key


def test_models_metrics_and_unknown_routes(client, server):
    assert [m.id for m in client.models.list()] == ["tiny-fake", "alias"]
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "tandem_requests_running" in metrics.text
    assert "tandem_time_to_first_token_seconds_bucket" in metrics.text
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def _wait_aborted(engine, request_id: str, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while request_id not in engine.aborted:
        assert time.time() < deadline, f"{request_id} was not aborted; aborted: {engine.aborted}"
        time.sleep(0.02)


def test_client_disconnect_mid_stream_aborts(client, engine):
    engine.token_delay = 0.05
    stream = client.chat.completions.create(model="tiny-fake", messages=[{"role": "user", "content": "a"}],
                                            max_tokens=100, stream=True)
    it = iter(stream)
    first, second = next(it), next(it)
    assert first.choices[0].delta.role == "assistant" and second.choices[0].delta.content
    stream.close()
    _wait_aborted(engine, first.id)
    assert engine.running == 0


def test_client_disconnect_while_waiting_aborts(server, engine):
    engine.token_delay = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100}, timeout=0.3)
    request_id = list(engine.submitted)[-1]
    _wait_aborted(engine, request_id)
    assert engine.running == 0
