"""Where the gateway finds its draft replicas: a fixed list, a DNS name, or a file.

`--draft` takes one of:
- `HOST:PORT[,HOST:PORT...]`: a fixed list, used as given for the gateway's life
  (gRPC resolves each HOST itself and connects to one of its addresses, as before).
- `dns:///NAME:PORT`: every address NAME resolves to is a replica. On Kubernetes
  NAME is a headless Service, whose DNS answer lists the Ready pods. The name is
  resolved again every `--draft-resolve-interval` seconds.
- `file:///PATH`: one `HOST:PORT` per line (`#` starts a comment), read again
  every interval: for places where something else keeps the list (a mounted
  ConfigMap, a config agent), and for tests that cannot change DNS.

A dynamic source answers `None` when it cannot tell (a DNS timeout, an unreadable
file): the pool then keeps what it has, so a flaky resolver never drops replicas.
An authoritative empty answer (the name does not exist, the file is empty) means
no replicas: their requests decode plainly, which never changes output.
"""

from __future__ import annotations

import enum
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tandem.gateway")

DNS_PREFIX = "dns:///"
FILE_PREFIX = "file://"

# getaddrinfo's errors that mean "this name has no addresses" rather than "could not ask".
_NO_SUCH_NAME = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}

Resolver = Callable[..., list]  # socket.getaddrinfo's signature


class SourceKind(enum.Enum):
    STATIC = "static"
    DNS = "dns"
    FILE = "file"


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{address!r}: write an IPv6 address in brackets, [ADDR]:PORT")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class DraftSource:
    """Parsed `--draft`: what kind of source, and what to resolve."""

    kind: SourceKind
    addresses: tuple[str, ...] = ()  # STATIC
    host: str = ""  # DNS
    port: int = 0  # DNS
    path: Path | None = None  # FILE
    interval_s: float = 5.0  # DNS and FILE: seconds between resolutions
    resolver: Resolver = field(default=socket.getaddrinfo, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"--draft-resolve-interval must be positive, got {self.interval_s}")
        if self.kind == SourceKind.DNS and (not self.host or not 0 < self.port < 65536):
            raise ValueError(f"a dns source needs NAME:PORT, got {self.host!r}:{self.port}")
        if self.kind == SourceKind.FILE and self.path is None:
            raise ValueError("a file source needs a path")

    @property
    def dynamic(self) -> bool:
        return self.kind != SourceKind.STATIC

    def describe(self) -> str:
        if self.kind == SourceKind.DNS:
            return f"{DNS_PREFIX}{join_host_port(self.host, self.port)}"
        if self.kind == SourceKind.FILE:
            return f"{FILE_PREFIX}{self.path}"
        return ",".join(self.addresses) or "none"

    def resolve(self) -> tuple[str, ...] | None:
        """The replicas' addresses now, sorted; None when the source cannot tell."""
        if self.kind == SourceKind.STATIC:
            return self.addresses
        if self.kind == SourceKind.DNS:
            return self._resolve_dns()
        return self._read_file()

    def _resolve_dns(self) -> tuple[str, ...] | None:
        try:
            infos = self.resolver(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                return ()
            log.warning("resolving %s failed (%s); keeping the current draft replicas", self.describe(), exc)
            return None
        except OSError as exc:
            log.warning("resolving %s failed (%s); keeping the current draft replicas", self.describe(), exc)
            return None
        return tuple(sorted({join_host_port(sockaddr[0], sockaddr[1]) for *_, sockaddr in infos}))

    def _read_file(self) -> tuple[str, ...] | None:
        assert self.path is not None
        try:
            text = self.path.read_text()
        except OSError as exc:
            log.warning("reading %s failed (%s); keeping the current draft replicas", self.path, exc)
            return None
        found = []
        for n, line in enumerate(text.splitlines(), 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            try:
                split_host_port(entry)
            except ValueError as exc:
                log.warning("%s line %d: %s (skipped)", self.path, n, exc)
                continue
            found.append(entry)
        return tuple(sorted(set(found)))


def parse_draft_source(spec: str, interval_s: float = 5.0, resolver: Resolver = socket.getaddrinfo) -> DraftSource:
    """`--draft`'s value -> a DraftSource. '' and 'none' are an empty static list (no speculation)."""
    spec = spec.strip()
    if spec.startswith(DNS_PREFIX):
        host, port = split_host_port(spec[len(DNS_PREFIX):])
        return DraftSource(kind=SourceKind.DNS, host=host, port=port, interval_s=interval_s, resolver=resolver)
    if spec.startswith(FILE_PREFIX):
        path = spec[len(FILE_PREFIX):]
        if not path.startswith("/"):
            raise ValueError(f"{spec!r}: a file source is file:///ABSOLUTE/PATH")
        return DraftSource(kind=SourceKind.FILE, path=Path(path), interval_s=interval_s)
    # Anything else is the fixed list, passed to gRPC as before (so its own target
    # schemes, such as unix:PATH, still work for one replica each).
    addresses = tuple(a.strip() for a in spec.split(",") if a.strip() and a.strip() != "none")
    return DraftSource(kind=SourceKind.STATIC, addresses=addresses, interval_s=interval_s)


def wait_for_replicas(source: DraftSource, timeout_s: float, poll_s: float = 1.0) -> tuple[str, ...]:
    """Resolve until at least one replica is listed or timeout_s passes (then: whatever there is).

    On Kubernetes the draft pods usually start with the gateway; a headless
    Service lists a pod only once it is Ready, so the first answer is often empty.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = source.resolve() or ()
        if found or not source.dynamic or time.monotonic() >= deadline:
            return found
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
