"""TLS on the public endpoints and mutual TLS between the gateway and the services.

In-process: a ServiceHost with mutual TLS lets in only callers holding a
certificate from its CA. End to end: `tandem serve` with certificate flags
serves REST and gRPC over TLS, and its target and draft refuse anyone but the
gateway (the holder of a CA-signed client certificate).
"""

from __future__ import annotations

import argparse
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import serve
from tandem.channels import open_channel
from tandem.grpc_host import ServiceHost
from tandem.tls import ClientTLS, ServerTLS, client_tls_from_args, server_tls_from_args
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.certs import CertificateAuthority
from tests.services import REPO
from tests.stack import scrape
from tests.tiny_draft import make_tiny_eagle3
from tests.tiny_models import make_tiny_llama

KEY = "sk-tls-test"


class Certs:
    def __init__(self, root: Path):
        self.ca = CertificateAuthority(root / "ca")
        self.server = self.ca.issue(root / "server", "tandem service")
        self.client = self.ca.issue(root / "client", "tandem gateway")
        self.rogue_ca = CertificateAuthority(root / "rogue-ca", "rogue CA")
        self.rogue = self.rogue_ca.issue(root / "rogue", "intruder")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


def health(address: str, tls: ClientTLS | None) -> int:
    with open_channel(address, tls) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def assert_refused(address: str, tls: ClientTLS | None) -> None:
    with pytest.raises(grpc.RpcError) as e:
        health(address, tls)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call is made


@pytest.fixture(scope="module")
def mtls_host(certs):
    tls = ServerTLS(cert=certs.server.cert, key=certs.server.key, client_ca=certs.ca.pem.cert)
    host = ServiceHost("127.0.0.1", 0, ["tandem.v1.TargetService"], credentials=tls.grpc_credentials())
    host.start()
    host.set_serving(True)
    yield f"127.0.0.1:{host.port}"
    host.stop(0)


def test_a_mutual_tls_service_lets_in_a_client_with_a_certificate_from_its_ca(mtls_host, certs):
    tls = ClientTLS(ca=certs.ca.pem.cert, cert=certs.client.cert, key=certs.client.key)
    assert health(mtls_host, tls) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "a rogue CA's certificate",
                                 "a client that does not trust the server"])
def test_a_mutual_tls_service_refuses_anyone_else(mtls_host, certs, who):
    tls = {"plaintext": None,
           "no client certificate": ClientTLS(ca=certs.ca.pem.cert),
           "a rogue CA's certificate": ClientTLS(ca=certs.ca.pem.cert, cert=certs.rogue.cert, key=certs.rogue.key),
           "a client that does not trust the server": ClientTLS(ca=certs.rogue_ca.pem.cert, cert=certs.client.cert,
                                                                key=certs.client.key)}[who]
    assert_refused(mtls_host, tls)


def test_tls_settings_are_checked_when_made(certs, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        ServerTLS(cert=tmp_path / "missing.pem", key=certs.server.key)
    with pytest.raises(ValueError, match="its key"):
        ClientTLS(ca=certs.ca.pem.cert, cert=certs.client.cert)

    def ns(**kw) -> argparse.Namespace:
        return argparse.Namespace(**{"tls_cert": None, "tls_key": None, "tls_ca": None, "tls_client_cert": None,
                                     "tls_client_key": None, **kw})

    assert server_tls_from_args(ns(), with_client_ca=True) is None
    with pytest.raises(ValueError, match="go together"):
        server_tls_from_args(ns(tls_cert=str(certs.server.cert)), with_client_ca=True)
    with pytest.raises(ValueError, match="requires --tls-cert"):
        server_tls_from_args(ns(tls_ca=str(certs.ca.pem.cert)), with_client_ca=True)
    tls = server_tls_from_args(ns(tls_cert=str(certs.server.cert), tls_key=str(certs.server.key),
                                  tls_ca=str(certs.ca.pem.cert)), with_client_ca=True)
    assert tls is not None and tls.mutual
    assert server_tls_from_args(ns(tls_cert=str(certs.server.cert), tls_key=str(certs.server.key),
                                   tls_ca=str(certs.ca.pem.cert)), with_client_ca=False).mutual is False
    with pytest.raises(ValueError, match="need --tls-ca"):
        client_tls_from_args(ns(tls_client_cert=str(certs.client.cert), tls_client_key=str(certs.client.key)))


def flag_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, (flag, cmd)
    return cmd[cmd.index(flag) + 1]


def test_serve_passes_certificate_flags_to_its_children(certs, tmp_path):
    model = tmp_path / "m"
    args = serve.build_parser().parse_args([
        "--model", str(model), "--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key),
        "--tls-ca", str(certs.ca.pem.cert), "--tls-client-cert", str(certs.client.cert),
        "--tls-client-key", str(certs.client.key), "--protect-metrics", "--api-key", "k"])
    public, services, gateway = serve.resolve_tls(args)
    plan = serve.Plan(model=model, draft=model, device="cpu", log_dir=tmp_path, public_tls=public,
                      service_tls=services, gateway_tls=gateway)
    server, ca, client = certs.server, certs.ca.pem, certs.client
    service_flags = {"--tls-cert": server.cert, "--tls-key": server.key, "--tls-ca": ca.cert}
    for cmd in (serve.target_command(args, plan, tmp_path / "t.port"),
                serve.draft_command(args, plan, tmp_path / "d.port")):
        assert {f: flag_value(cmd, f) for f in service_flags} == {f: str(p.resolve()) for f, p in service_flags.items()}
        assert "--tls-client-cert" not in cmd
    gateway_flags = {"--tls-cert": server.cert, "--tls-key": server.key, "--tls-ca": ca.cert,
                     "--tls-client-cert": client.cert, "--tls-client-key": client.key}
    cmd = serve.gateway_command(args, plan, "127.0.0.1:1", [])
    assert {f: flag_value(cmd, f) for f in gateway_flags} == {f: str(p.resolve()) for f, p in gateway_flags.items()}
    assert "--protect-metrics" in cmd
    # Without --tls-ca only the public side is TLS, and the gateway presents the serving pair by default.
    args = serve.build_parser().parse_args(["--model", str(model), "--tls-cert", str(certs.server.cert),
                                            "--tls-key", str(certs.server.key)])
    assert serve.resolve_tls(args)[1:] == (None, None)
    args.tls_ca = str(certs.ca.pem.cert)
    assert serve.resolve_tls(args)[2].cert == certs.server.cert.resolve()
    args.tls_key = None
    with pytest.raises(serve.ServeError, match="go together"):
        serve.resolve_tls(args)


# ---------------------------------------------------------------------------- end to end

class TlsServe:
    """`tandem serve` on a tiny pair with TLS outside and mutual TLS inside."""

    def __init__(self, tmp: Path, certs: Certs):
        model = make_tiny_llama(tmp / "target", "gqa")
        draft = make_tiny_eagle3(tmp / "draft", model)
        (self.port, self.grpc_port), self.logs = serve.free_ports(2), tmp / "logs"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--draft", str(draft),
             "--device", "cpu", "--kv-cache-gb", "0.01", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
             "--api-key", KEY, "--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key),
             "--tls-ca", str(certs.ca.pem.cert), "--tls-client-cert", str(certs.client.cert),
             "--tls-client-key", str(certs.client.key), "--log-dir", str(self.logs)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        self.banner = self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> str:
        deadline, lines = time.time() + timeout, []
        while time.time() < deadline and (line := self.proc.stdout.readline()):
            lines.append(line)
            if "Press Ctrl-C" in line:
                return "".join(lines)
        self.proc.kill()
        raise AssertionError(f"serve never got ready:\n{''.join(lines)}\n{self.proc.stderr.read()}")

    def service(self, name: str) -> str:
        return f"127.0.0.1:{int((self.logs / f'{name}.port').read_text())}"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=90)
        return self.proc.returncode


@pytest.fixture(scope="module")
def tls_serve(tmp_path_factory, certs):
    s = TlsServe(tmp_path_factory.mktemp("tls-serve"), certs)
    yield s
    assert s.stop() == 0


def test_serve_with_certificates_serves_rest_over_tls_with_the_key(tls_serve, certs):
    assert f"https://127.0.0.1:{tls_serve.port}/v1" in tls_serve.banner
    url = f"https://127.0.0.1:{tls_serve.port}"
    verify = ssl.create_default_context(cafile=str(certs.ca.pem.cert))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                   verify=verify, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, verify=verify, timeout=60).status_code == 401
    assert httpx.get(f"{url}/health", verify=verify, timeout=10).status_code == 200
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP is not served on the TLS port
        httpx.get(f"http://127.0.0.1:{tls_serve.port}/health", timeout=10)


def test_serve_with_certificates_serves_grpc_over_tls_with_the_key(tls_serve, certs):
    with open_channel(f"127.0.0.1:{tls_serve.grpc_port}", ClientTLS(ca=certs.ca.pem.cert)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        out = list(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=3, ignore_eos=True), timeout=60,
                                 metadata=[("authorization", f"Bearer {KEY}")]))
        assert out[-1].usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=3), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_refused(f"127.0.0.1:{tls_serve.grpc_port}", None)  # no plaintext


@pytest.mark.parametrize("name", ["target", "draft0"])
def test_serve_with_a_ca_makes_the_services_refuse_all_but_the_gateway(tls_serve, certs, name):
    address = tls_serve.service(name)
    assert_refused(address, None)
    assert_refused(address, ClientTLS(ca=certs.ca.pem.cert))
    assert_refused(address, ClientTLS(ca=certs.ca.pem.cert, cert=certs.rogue.cert, key=certs.rogue.key))
    gateway_side = ClientTLS(ca=certs.ca.pem.cert, cert=certs.client.cert, key=certs.client.key)
    assert health(address, gateway_side) == health_pb2.HealthCheckResponse.SERVING


def test_over_mutual_tls_each_draft_reads_its_features_from_the_target(tls_serve, certs):
    """The drafts' one call to the target (ReadFeatures) goes through the same mutual TLS: a draft
    presents the services' certificate, and the features it reads arrive."""
    verify = ssl.create_default_context(cafile=str(certs.ca.pem.cert))
    r = httpx.post(f"https://127.0.0.1:{tls_serve.port}/v1/completions", verify=verify, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "hello", "max_tokens": 16, "ignore_eos": True, "speculation": "always"})
    assert r.status_code == 200 and r.json()["spec_stats"]["verify_steps"] > 0
    line = next(line for line in tls_serve.banner.splitlines() if "draft0 metrics" in line)
    metrics = scrape(line.split()[-1])
    assert metrics["tandem_draft_feature_read_seconds_count"] > 0 and metrics["tandem_draft_feature_bytes_total"] > 0
    assert "cannot read features" not in (tls_serve.logs / "draft0.log").read_text()
