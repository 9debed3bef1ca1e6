"""A lean client for one streamed HTTP/1.1 POST: its server-sent events' data, as `tandem bench` reads them.

`tandem bench` measures the server, so its client must not be what limits a level. With httpx's streaming (its
HTTP parser, its async machinery, a line iterator) the client took 134-139 us of CPU per streamed chunk on the dev
machine: against the test suite's fake REST server, 64 streams of a token every 7 ms (`never` at 64 requests on an
H100) came to 5,683-5,783 chunks a second of 9,143, at 77-79% of a core, first tokens at 70-95 ms (p50); this
client took 45-58 us a chunk and delivered 7,610-7,808 a second, first tokens at 36-62 ms (`bench/bench_client.py`;
BENCHMARKS.md, "The bench's own client"). Here each request is one connection (`Connection: close`): the status
line and headers, then the body as the server frames it (chunked, a length, or to the close), cut into `data:`
lines. A request's time to first token therefore includes its connection's setup: on one host a fraction of a
millisecond; across a network a round trip, and with https the TLS handshake's too.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    """The server answered with a status other than 200: its body's start says why."""


async def post_events(url: str, path: str, body: dict, on_data: Callable[[bytes], None],
                      timeout: float = 600.0) -> None:
    """POSTs `body` as JSON to `url` + `path` and hands each server-sent event's data (bytes, `data: ` cut off,
    `[DONE]` included) to `on_data` as it arrives, until the stream ends. Raises HTTPStatusError for a status other
    than 200, OSError for a connection that fails or breaks, TimeoutError past `timeout` seconds for the whole
    request. (A callback, not an async generator: a timeout's scope must not span the consumer's own awaits.)"""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if tls else 80)
    payload = json.dumps(body).encode()
    head = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n").encode()
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=tls)
        try:
            writer.write(head + payload)
            status, headers = await _read_head(reader)
            if status != 200:
                text = b"".join([piece async for piece in _body(reader, headers)]).decode(errors="replace")
                raise HTTPStatusError(f"HTTP {status}: {text[:300]}")
            pending = b""
            async for piece in _body(reader, headers):
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: "):
                        on_data(line[6:].rstrip(b"\r"))
            if pending.startswith(b"data: "):
                on_data(pending[6:].rstrip(b"\r"))
        finally:
            writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names lower-cased) of a response."""
    status_line = await reader.readline()
    fields = status_line.split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit():
        raise OSError(f"not an HTTP response: {status_line[:100]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(fields[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives, unframed: chunked transfer, a content length, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise OSError("the connection closed inside a chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            piece = await reader.read(min(left, 1 << 16))
            if not piece:
                raise OSError("the connection closed before the body's length")
            left -= len(piece)
            yield piece
    else:
        while piece := await reader.read(1 << 16):
            yield piece
