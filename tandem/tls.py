"""TLS settings of tandem's servers and clients, from certificate flags.

Servers (REST via uvicorn, gRPC via grpc.ssl_server_credentials) serve a
certificate chain and key (PEM files). A server given a CA (`client_ca`)
requires every caller to present a certificate signed by it: mutual TLS, which
is how the target and draft services accept only the gateway. Clients (the
gateway's channels to the target and drafts) verify the server against a CA
and, for mutual TLS, present a certificate of their own.

Files are read once, at start-up; rotating certificates means restarting.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


def _readable(path: Path, what: str) -> None:
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")


@dataclass(frozen=True, kw_only=True)
class ServerTLS:
    cert: Path  # PEM certificate chain this server presents
    key: Path  # PEM private key of `cert`
    client_ca: Path | None = None  # when set, callers must present a certificate signed by this CA

    def __post_init__(self) -> None:
        _readable(self.cert, "TLS certificate")
        _readable(self.key, "TLS key")
        if self.client_ca is not None:
            _readable(self.client_ca, "TLS CA")

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca else None,
            require_client_auth=self.mutual)

    def uvicorn_kwargs(self) -> dict[str, object]:
        """uvicorn.Config keyword arguments that serve HTTPS with these files."""
        out: dict[str, object] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.client_ca is not None:
            out.update(ssl_ca_certs=str(self.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        return out


@dataclass(frozen=True, kw_only=True)
class ClientTLS:
    ca: Path  # PEM CA bundle the server's certificate must chain to
    cert: Path | None = None  # PEM certificate this client presents (mutual TLS)
    key: Path | None = None  # PEM private key of `cert`

    def __post_init__(self) -> None:
        _readable(self.ca, "TLS CA")
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if self.cert is not None and self.key is not None:
            _readable(self.cert, "TLS client certificate")
            _readable(self.key, "TLS client key")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None)


# ---------------------------------------------------------------------------- flags

def add_server_tls_arguments(p: argparse.ArgumentParser, client_ca_help: str | None) -> None:
    """--tls-cert/--tls-key, and --tls-ca when `client_ca_help` says what a CA means here."""
    g = p.add_argument_group("TLS")
    g.add_argument("--tls-cert", metavar="PEM", default=None,
                   help="serve TLS with this certificate chain (with --tls-key); default: plaintext")
    g.add_argument("--tls-key", metavar="PEM", default=None, help="the private key of --tls-cert")
    if client_ca_help is not None:
        g.add_argument("--tls-ca", metavar="PEM", default=None, help=client_ca_help)


def server_tls_from_args(args: argparse.Namespace, with_client_ca: bool) -> ServerTLS | None:
    """The server's TLS from its flags (None: plaintext); ValueError for an incomplete set."""
    ca = getattr(args, "tls_ca", None) if with_client_ca else None
    if args.tls_cert is None and args.tls_key is None:
        if ca is not None:
            raise ValueError("--tls-ca requires --tls-cert and --tls-key: mutual TLS needs a server certificate")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerTLS(cert=Path(args.tls_cert), key=Path(args.tls_key), client_ca=Path(ca) if ca else None)


def add_client_tls_arguments(p: argparse.ArgumentParser) -> None:
    """The gateway's side of its links to the target and drafts (--tls-ca is the CA they chain to)."""
    g = p.add_argument_group("TLS to the target and draft services")
    g.add_argument("--tls-ca", metavar="PEM", default=None,
                   help="connect to the target and drafts over TLS, verifying their certificates against "
                        "this CA (default: plaintext)")
    g.add_argument("--tls-client-cert", metavar="PEM", default=None,
                   help="certificate to present to the target and drafts (mutual TLS; with --tls-client-key)")
    g.add_argument("--tls-client-key", metavar="PEM", default=None, help="the private key of --tls-client-cert")


def client_tls_from_args(args: argparse.Namespace) -> ClientTLS | None:
    if args.tls_ca is None:
        if args.tls_client_cert or args.tls_client_key:
            raise ValueError("--tls-client-cert/--tls-client-key need --tls-ca to verify the services")
        return None
    return ClientTLS(ca=Path(args.tls_ca), cert=Path(args.tls_client_cert) if args.tls_client_cert else None,
                     key=Path(args.tls_client_key) if args.tls_client_key else None)


SERVICE_CA_HELP = ("require every caller to present a certificate signed by this CA (mutual TLS: only the "
                   "gateway, holding such a certificate, gets in); needs --tls-cert/--tls-key")


def service_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """A target or draft service's gRPC credentials from its TLS flags; exits on a bad set."""
    try:
        tls = server_tls_from_args(args, with_client_ca=True)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return tls.grpc_credentials() if tls else None
