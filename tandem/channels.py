"""Client channels to tandem's services: plaintext, TLS or mutual TLS, with bounded messages."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from tandem.grpc_host import GRPC_OPTIONS
from tandem.tls import ClientTLS

# A service that restarts is reconnected to within about this long. grpc's default backoff
# grows to 120 s, so a target or draft back after a minute's outage could sit unused for
# another minute or two; between a cluster's own services a reconnect attempt every two
# seconds costs nothing.
MAX_RECONNECT_BACKOFF_MS = 2000
RECONNECT_OPTIONS: list[tuple[str, object]] = [
    ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
SERVICE_CHANNEL_OPTIONS: list[tuple[str, object]] = [*GRPC_OPTIONS, *RECONNECT_OPTIONS]


def open_channel(address: str, tls: ClientTLS | None = None,
                 options: Sequence[tuple[str, object]] = SERVICE_CHANNEL_OPTIONS) -> grpc.Channel:
    """A channel to `address`; `tls` None means plaintext (a trusted network, e.g. one host)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.grpc_credentials(), options=list(options))
