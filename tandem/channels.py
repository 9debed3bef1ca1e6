"""Client channels to tandem's services: plaintext, TLS or mutual TLS, with bounded messages."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from tandem.grpc_host import GRPC_OPTIONS
from tandem.tls import ClientTLS


def open_channel(address: str, tls: ClientTLS | None = None,
                 options: Sequence[tuple[str, object]] = GRPC_OPTIONS) -> grpc.Channel:
    """A channel to `address`; `tls` None means plaintext (a trusted network, e.g. one host)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.grpc_credentials(), options=list(options))
