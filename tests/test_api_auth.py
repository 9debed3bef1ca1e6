"""The API key on REST (middleware) and on gRPC Generate (interceptor), and retry hints on overload,
against the fake engine: a wrong or missing key is 401 / UNAUTHENTICATED, probes stay open."""

from __future__ import annotations

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import tandem.api_key
from gateway.grpc_api import SERVICE_NAME, add_generation_service
from gateway.openai_api import ApiSettings, create_app
from tandem.grpc_auth import ApiKeyInterceptor
from tandem.grpc_host import ServiceHost
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.fake_engine import FakeEngine, expected_text, make_char_tokenizer
from tests.test_openai_api import ServerThread

KEY = "sk-the-right-key"
OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}


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
def rest(engine):
    s = ServerThread(create_app(engine, KEY))
    yield s.url
    s.stop()


@pytest.fixture(scope="module")
def rest_protected_metrics(engine):
    s = ServerThread(create_app(engine, KEY, protect_metrics=True))
    yield s.url
    s.stop()


@pytest.fixture(scope="module")
def channel(engine):
    host = ServiceHost("127.0.0.1", 0, [SERVICE_NAME], interceptors=[ApiKeyInterceptor(KEY, [SERVICE_NAME])])
    add_generation_service(host, engine)
    host.start()
    host.set_serving(True)
    ch = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    yield ch
    ch.close()
    host.stop(0)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert set(r.json()["error"]) == OPENAI_ERROR_FIELDS and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), bearer(KEY[:-1]), bearer(KEY + "x"),
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY},
                                     {"Authorization": "Bearer"}, {"Authorization": "Bearer ключ".encode()}],
                         ids=["none", "wrong", "a prefix", "longer", "basic", "no scheme", "empty", "non-ascii"])
def test_rest_refuses_a_missing_or_wrong_key_on_every_v1_route(rest, headers):
    assert_401(httpx.get(f"{rest}/v1/models", headers=headers))
    assert_401(httpx.post(f"{rest}/v1/completions", json={"prompt": "a"}, headers=headers))
    assert_401(httpx.post(f"{rest}/v1/chat/completions", json={"messages": []}, headers=headers))
    assert_401(httpx.post(f"{rest}/v1/completions", content=b"{broken", headers=headers))  # before parsing


def test_rest_serves_the_right_key_and_leaves_probes_open(rest):
    r = httpx.post(f"{rest}/v1/completions", json={"prompt": "a", "max_tokens": 3}, headers=bearer(KEY))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text(3)
    assert httpx.get(f"{rest}/health").status_code == 200
    assert httpx.get(f"{rest}/metrics").status_code == 200


def test_protect_metrics_puts_metrics_behind_the_key_but_not_health(rest_protected_metrics):
    url = rest_protected_metrics
    assert_401(httpx.get(f"{url}/metrics"))
    assert_401(httpx.get(f"{url}/metrics", headers=bearer("sk-wrong")))
    r = httpx.get(f"{url}/metrics", headers=bearer(KEY))
    assert r.status_code == 200 and "tandem_requests_running" in r.text
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_key_is_compared_in_constant_time(rest, monkeypatch):
    calls = []
    real = tandem.api_key.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tandem.api_key.hmac, "compare_digest", spy)
    assert_401(httpx.get(f"{rest}/v1/models", headers=bearer("sk-guess")))
    assert calls == [(b"sk-guess", KEY.encode())]


def test_settings_refuse_what_cannot_work(engine):
    with pytest.raises(ValueError, match="protect_metrics"):
        ApiSettings(model_names=("m",), protect_metrics=True)
    with pytest.raises(ValueError, match="api_key"):
        ApiSettings(model_names=("m",), api_key="")
    with pytest.raises(ValueError):
        ApiSettings(model_names=("m",), max_body_bytes=0)
    with pytest.raises(ValueError):
        ApiKeyInterceptor("", [SERVICE_NAME])


def test_rest_queue_full_is_429_with_retry_after(rest, engine):
    engine.max_queue = 0
    r = httpx.post(f"{rest}/v1/completions", json={"prompt": "a"}, headers=bearer(KEY))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"


# ---------------------------------------------------------------------------- gRPC

def generate(channel: grpc.Channel, metadata=None, **fields) -> list[pb.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(channel)
    return list(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=20))


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer sk-wrong")],
                                      [("authorization", KEY)], [("x-api-key", KEY)]],
                         ids=["none", "wrong", "no scheme", "other header"])
def test_grpc_generate_refuses_a_missing_or_wrong_key(channel, engine, metadata):
    before = dict(engine.submitted)
    with pytest.raises(grpc.RpcError) as e:
        generate(channel, metadata, prompt="a", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    assert engine.submitted == before  # refused before the servicer ran


def test_grpc_generate_serves_the_right_key_and_leaves_health_and_reflection_open(channel):
    out = generate(channel, [("authorization", f"Bearer {KEY}")], prompt="a", max_tokens=4)
    assert "".join(m.text for m in out) == expected_text(4)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    assert SERVICE_NAME in [s.name for s in reply.list_services_response.service]


def test_grpc_queue_full_is_resource_exhausted_with_retry_info(channel, engine):
    engine.max_queue = 0
    with pytest.raises(grpc.RpcError) as e:
        generate(channel, [("authorization", f"Bearer {KEY}")], prompt="a")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(e.value.trailing_metadata())
    assert trailers["retry-after"] == "1"
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and status.message == e.value.details()
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.retry_delay.seconds == 1
