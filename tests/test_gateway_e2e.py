"""The gateway against real target and draft processes, over HTTP and gRPC (tiny random pair)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import openai
import pytest

from tests.faults import draft_load, target_load
from tests.stack import Stack
from tests.tiny_draft import make_tiny_eagle3
from tests.tiny_models import make_tiny_llama

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os\nprint(", "for i in range(10):",
           "x = [1, 2, 3]\ny =", "if __name__ == '__main__':", "# compute the mean\n", "while True:\n    try:"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    target = make_tiny_llama(tmp / "target", "gqa", max_position_embeddings=512)
    return target, make_tiny_eagle3(tmp / "draft", target)


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    """Plain-decode grants of 8 steps (the default)."""
    st = Stack(tmp_path_factory.mktemp("stack"), *pair[:1], [pair[1]], "--no-profile", "--max-model-len", "256",
               "--grant-steps", "8")
    yield st
    st.stop()


@pytest.fixture(scope="module")
def stack_k1(pair, tmp_path_factory):
    """One target call per step, as before grants; its step streams on gRPC (the other stack's on lanes)."""
    st = Stack(tmp_path_factory.mktemp("stack_k1"), *pair[:1], [pair[1]], "--no-profile", "--max-model-len", "256",
               "--grant-steps", "1", step_lanes=False)
    yield st
    st.stop()


BOTH_GRANTS = pytest.mark.parametrize("which", ["stack", "stack_k1"], ids=["grant8", "grant1"])


def wait_idle(st: Stack, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if target_load(st.target).num_sequences == 0 and all(draft_load(d).num_sequences == 0 for d in st.drafts):
            return
        time.sleep(0.1)
    raise AssertionError(f"KV still held: target {target_load(st.target)}, draft {draft_load(st.drafts[0])}")


def greedy(st: Stack, prompt: str, mode: str, n: int = 24) -> tuple[str, dict]:
    r = st.complete(prompt, max_tokens=n, temperature=0, speculation=mode)
    return r["choices"][0]["text"], r["spec_stats"]


@BOTH_GRANTS
def test_greedy_output_is_the_same_with_and_without_speculation(which, request):
    stack = request.getfixturevalue(which)
    for prompt in PROMPTS:
        plain, stats = greedy(stack, prompt, "never")
        assert stats["verify_steps"] == 0
        spec, stats = greedy(stack, prompt, "always")
        assert stats["verify_steps"] > 0 and stats["draft_tokens"] > 0
        assert spec == plain
        assert greedy(stack, prompt, "auto")[0] == plain
    wait_idle(stack)
    granted = stack.metrics().get("tandem_granted_steps_total", 0)
    assert granted > 0 if which == "stack" else granted == 0


def test_step_streams_on_lanes_give_the_greedy_output_of_streams_on_grpc(stack, stack_k1):
    """`stack`'s services offer same-host lanes and its gateway takes them; `stack_k1`'s stay on gRPC."""
    for prompt in PROMPTS[:2]:
        for mode in ("never", "always"):
            assert greedy(stack, prompt, mode)[0] == greedy(stack_k1, prompt, mode)[0]
    lane_log, grpc_log = stack.log_path.read_text(), stack_k1.log_path.read_text()
    assert "StepStream on its step lane" in lane_log and "DraftStream on its step lane" in lane_log
    assert "step lane" not in grpc_log
    wait_idle(stack)


def test_openai_client_against_the_real_stack(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    c = client.completions.create(model="target", prompt="def f(x):", max_tokens=12, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 12
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert "spec_stats" in chunks[-1].model_extra
    two = client.completions.create(model="target", prompt="x = ", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(ch.index for ch in two.choices) == [0, 1]
    full = greedy(stack, "def g(y):", "never", 30)[0]
    stop = full[5:8]
    cut = client.completions.create(model="target", prompt="def g(y):", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="target", prompt="x" * 400, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    wait_idle(stack)


def stream_text(url: str, prompt: str, max_tokens: int, out: dict, key: str, speculation: str | None = None) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if speculation:
        body["speculation"] = speculation
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
    out[key] = "".join(text)


def concurrent_streams(url: str, prompts: list[str], max_tokens: int, speculation: str | None = None
                       ) -> dict[str, str]:
    """Stream every prompt at once (greedy); texts keyed p0, p1, ..."""
    got: dict[str, str] = {}
    threads = [threading.Thread(target=stream_text, args=(url, p, max_tokens, got, f"p{i}", speculation))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return got


@BOTH_GRANTS
def test_32_concurrent_streams_equal_their_solo_runs(which, request):
    stack = request.getfixturevalue(which)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    solo = {f"p{i}": greedy(stack, p, "auto", 20)[0] for i, p in enumerate(prompts)}
    assert concurrent_streams(stack.url, prompts, 20) == solo
    assert concurrent_streams(stack.url, prompts, 20, speculation="never") == solo
    wait_idle(stack)


def test_a_stop_string_inside_a_grant_gives_the_text_and_usage_of_single_steps(stack, stack_k1):
    full = greedy(stack_k1, "def g(y):", "never", 40)[0]
    stop = full[17:19]
    granted_before = stack.metrics().get("tandem_granted_steps_total", 0)
    cut = {name: st.complete("def g(y):", max_tokens=40, temperature=0, stop=[stop], speculation="never")
           for name, st in (("k8", stack), ("k1", stack_k1))}
    assert stack.metrics()["tandem_granted_steps_total"] > granted_before
    for reply in cut.values():
        assert reply["choices"][0]["text"] == full[:full.index(stop)]
        assert reply["choices"][0]["finish_reason"] == "stop"
    assert cut["k8"]["usage"] == cut["k1"]["usage"]
    wait_idle(stack)


def test_a_client_that_disconnects_during_a_grant_frees_its_kv(stack):
    body = {"prompt": "def long(x):", "max_tokens": 200, "temperature": 0, "stream": True, "speculation": "never",
            "ignore_eos": True}
    granted_before = stack.metrics().get("tandem_granted_steps_total", 0)
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 20:
                assert target_load(stack.target).num_sequences == 1
                break  # leaving the block closes the connection mid-grant
    assert stack.metrics()["tandem_granted_steps_total"] > granted_before
    wait_idle(stack)


def test_client_disconnect_frees_kv_on_target_and_draft(stack):
    # ignore_eos: greedy text for this prompt ends after 9 tokens, which a fast stack can finish (and free)
    # before the client has read its sixth line.
    body = {"prompt": "def long(x):", "max_tokens": 200, "temperature": 0, "stream": True,
            "speculation": "always", "ignore_eos": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                assert target_load(stack.target).num_sequences == 1
                break  # leaving the block closes the connection mid-stream
    wait_idle(stack)


def test_killing_the_draft_mid_stream_falls_back_to_plain_decode(pair, tmp_path):
    st = Stack(tmp_path, pair[0], [pair[1]], "--no-profile", "--speculation", "always")
    try:
        expected = greedy(st, "def h(z):", "never", 120)[0]
        got: dict[str, str] = {}
        body = {"prompt": "def h(z):", "max_tokens": 120, "temperature": 0, "stream": True}
        text = []
        killed = False
        with httpx.stream("POST", f"{st.url}/v1/completions", json=body, timeout=120) as r:
            for i, line in enumerate(r.iter_lines()):
                # The draft computes the prompt's KV while the target decodes plainly, so the
                # first rounds come a few tokens in: kill it once it has drafted (on a busy CI
                # machine five lines were not always enough).
                if not killed and i >= 5 and st.metrics().get("tandem_spec_decode_num_drafts_total", 0) > 0:
                    st.drafts[0].proc.kill()
                    killed = True
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk
                    text += [c["text"] for c in chunk["choices"]]
        got["t"] = "".join(text)
        assert killed, "the draft never drafted before the stream ended"
        assert got["t"] == expected
        m = st.metrics()
        assert m["tandem_spec_decode_num_drafts_total"] > 0 and m["tandem_plain_decode_steps_total"] > 0
        assert 'tandem_kv_cache_usage_ratio{service="draft"}' in m
        assert 'tandem_kv_cache_usage_ratio{service="target"}' in m
    finally:
        st.stop()


def test_grpc_generate_matches_rest(stack):
    from tandem.v1 import generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}"))
    req = generation_pb2.GenerateRequest(prompt="def add(a, b):", max_tokens=16, temperature=0)
    replies = list(stub.Generate(req, timeout=60))
    assert "".join(m.text for m in replies) == greedy(stack, "def add(a, b):", "auto", 16)[0]
    assert replies[-1].finish_reason and replies[-1].usage.completion_tokens > 0


def test_preemption_by_recompute_leaves_output_unchanged(pair, tmp_path):
    # 20 blocks of 8 tokens: four requests of ~110 tokens cannot all hold their KV at once.
    st = Stack(tmp_path, pair[0], [pair[1]], "--no-profile", "--max-model-len", "160",
               target_args=("--num-blocks", "20", "--block-size", "8"))
    try:
        prompts = [p + " " * 20 for p in PROMPTS[:4]]
        solo = {f"p{i}": greedy(st, p, "always", 48)[0] for i, p in enumerate(prompts)}
        assert concurrent_streams(st.url, prompts, 48) == solo
        assert "preempting" in st.gateway_log.read_text()
        wait_idle(st)
    finally:
        st.stop()


def test_a_gateway_whose_port_another_server_answers_on_takes_new_ports_not_that_servers_word(stack, tmp_path,
                                                                                               monkeypatch):
    """A port drawn free can be taken before the gateway binds it; the server that took it (another test's
    gateway) answers /health. The harness waits for its own process to listen, and draws new ports once the
    gateway reports the port taken, so no test talks to a stranger."""
    import http.server

    import tests.stack as stack_module

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args):
            pass

    stranger = http.server.HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    taken = stranger.server_address[1]
    real, draws = stack_module.free_ports, []

    def free_ports(n):
        ports = real(n)
        if not draws:  # the first draw: the port the stranger holds
            ports[0] = taken
        draws.append(ports[0])
        return ports

    monkeypatch.setattr(stack_module, "free_ports", free_ports)
    gw = stack_module.Gateway(tmp_path, stack.target.address, [d.address for d in stack.drafts], "--no-profile",
                              "--max-model-len", "256", name="gateway-second-draw")
    try:
        assert len(draws) == 2 and gw.port == draws[1] != taken
        assert gw.complete(PROMPTS[0], max_tokens=4, temperature=0)["choices"][0]["text"] == \
            stack.complete(PROMPTS[0], max_tokens=4, temperature=0)["choices"][0]["text"]
    finally:
        gw.stop()
        stranger.shutdown()
