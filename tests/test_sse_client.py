"""tandem.sse_client: `tandem bench`'s lean client for a streamed POST, against small servers that frame their
bodies each way HTTP/1.1 allows, and against the OpenAI-compatible app over the fake engine."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tandem.sse_client import HTTPStatusError, post_events
from tests.bench_scripts import load_bench_script


async def serve_once(reply: list[bytes], seen: list[bytes]) -> tuple[asyncio.Server, int]:
    """A server that reads one request (kept in `seen`) and writes `reply`'s pieces one at a time."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        seen.append(head + await reader.readexactly(length))
        for piece in reply:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def events_from(reply: list[bytes], timeout: float = 10.0) -> tuple[list[bytes], list[bytes]]:
    async def run() -> tuple[list[bytes], list[bytes]]:
        seen, got = [], []
        server, port = await serve_once(reply, seen)
        async with server:
            await post_events(f"http://127.0.0.1:{port}/base/", "/v1/completions", {"prompt": "hi"}, got.append,
                              timeout=timeout)
        return got, seen
    return asyncio.run(run())


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


def test_events_split_across_chunks_arrive_whole_and_in_order():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, seen = events_from([head, *chunked(b'data: {"a": 1}\n\nda', b'ta: {"b": 2}\r\n\r\n', b"data: [DONE]\n\n")])
    assert got == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
    # The request: POST to the URL's path and the given one, the body as JSON, one connection for it.
    request = seen[0].decode()
    assert request.startswith("POST /base/v1/completions HTTP/1.1\r\n") and "Connection: close" in request
    assert json.loads(request.split("\r\n\r\n", 1)[1]) == {"prompt": "hi"}


def test_a_body_with_a_length_or_read_to_the_close_gives_the_same_events():
    body = b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    sized = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body[:9], body[9:]]
    assert events_from(sized)[0] == [b"1", b"2", b"[DONE]"]
    assert events_from([b"HTTP/1.1 200 OK\r\n\r\n", body[:13], body[13:]])[0] == [b"1", b"2", b"[DONE]"]


def test_a_status_other_than_200_raises_with_the_start_of_the_body():
    body = b'{"error": {"message": "max_tokens must be at least 1"}}'
    reply = [b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body), body]
    with pytest.raises(HTTPStatusError, match="HTTP 400: .*max_tokens must be at least 1"):
        events_from(reply)


def test_a_server_that_stops_answering_times_out_instead_of_hanging():
    reply = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", *chunked(b"data: 1\n\n")[:1]]

    async def run() -> None:
        seen: list[bytes] = []
        started = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            for piece in reply:
                writer.write(piece)
            started.set()
            await asyncio.sleep(30)  # nothing more, the connection held open

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            began = time.monotonic()
            with pytest.raises(TimeoutError):
                await post_events(f"http://127.0.0.1:{port}", "/x", {}, seen.append, timeout=0.5)
            assert time.monotonic() - began < 5 and seen == [b"1"]

    asyncio.run(run())


def test_a_refused_connection_and_a_non_http_url_raise_clear_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it closes
    with pytest.raises(OSError):
        asyncio.run(post_events(f"http://127.0.0.1:{port}", "/x", {}, print, timeout=5))
    with pytest.raises(ValueError, match="not an http"):
        asyncio.run(post_events("ftp://example.org", "/x", {}, print))


def test_a_completion_streamed_by_the_openai_app_reads_as_its_chunks_and_done():
    """The OpenAI-compatible app over the test suite's fake engine, under uvicorn (bench/rest_stream.py's server):
    the text chunks, the usage chunk and [DONE], as `tandem bench` reads them."""
    rest_stream = load_bench_script("rest_stream")
    server, port = rest_stream.start_server(token_delay=0.001, timeout=60)
    try:
        got: list[bytes] = []
        body = {"model": "tiny-fake", "prompt": "hi", "max_tokens": 12, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        asyncio.run(post_events(f"http://127.0.0.1:{port}", "/v1/completions", body, got.append, timeout=60))
        chunks = [json.loads(data) for data in got[:-1]]
        assert got[-1] == b"[DONE]"
        assert chunks[-1]["usage"]["completion_tokens"] == 12  # the usage chunk, last before [DONE]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert len(text) == 12 and chunks[-1]["choices"] == []  # the fake engine's characters, in two-token deltas
    finally:
        server.terminate()
        server.wait(10)
