"""The REST layer's own cost per streamed chunk: the OpenAI-compatible server over the test
suite's fake engine (no models, no services), N streaming clients at once, and the server
process's CPU time per chunk it delivered.

    python bench/rest_stream.py [--streams 1,16,64] [--chunks 6000] [--token-delay 0.001]

The server runs in a process of its own (uvicorn, as `tandem gateway` runs it), so the CPU
it reports is the server's: the event loop's streaming (queue hand-over, JSON, SSE, HTTP
writes) plus the fake engine's thread, which is the same in any tree being compared. Each
client is a bare asyncio connection that reads its stream to the end. `PYTHONPATH=<other
checkout>` serves that tree's gateway. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # after PYTHONPATH: another checkout's gateway wins


def serve(port: int, token_delay: float) -> None:
    import uvicorn

    from gateway.openai_api import create_app
    from tests.fake_engine import FakeEngine, make_char_tokenizer

    engine = FakeEngine(make_char_tokenizer(Path(tempfile.mkdtemp(prefix="tandem-rest-"))),
                        max_model_len=1_000_000, max_queue=4096)
    engine.token_delay = token_delay
    uvicorn.run(create_app(engine), host="127.0.0.1", port=port, log_level="warning", log_config=None)


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far, summed over its threads to the nanosecond (schedstat; /proc's
    stat counts clock ticks of 10 ms, too coarse for a level of a second)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


async def one_stream(port: int, tokens: int, seed: int) -> int:
    """Streams one completion to its end; returns the SSE events it carried."""
    body = json.dumps({"model": "tiny-fake", "prompt": "hi", "max_tokens": tokens, "stream": True,
                       "seed": seed, "speculation": "never"}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    if b"data: [DONE]" not in data:
        raise RuntimeError(f"a stream ended without [DONE]: {data[:300]!r}")
    return data.count(b"data: ") - 1


async def run_level(port: int, streams: int, tokens: int) -> int:
    counts = await asyncio.gather(*(one_stream(port, tokens, seed) for seed in range(streams)))
    return sum(counts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(token_delay: float, timeout: float = 120.0) -> tuple[subprocess.Popen, int]:
    """This file's server in a process of its own, once it accepts connections: (the process, its port).
    The caller terminates it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--token-delay", str(token_delay)])
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit("the server did not start") from None
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16,64", help="concurrent streams per level")
    ap.add_argument("--chunks", type=int, default=6000, help="chunks per level, spread over its streams")
    ap.add_argument("--token-delay", type=float, default=0.001, help="the fake engine's seconds per step")
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.token_delay)
        return 0
    server, port = start_server(args.token_delay)
    try:
        asyncio.run(run_level(port, 2, 20))  # warm-up
        for streams in (int(x) for x in args.streams.split(",")):
            cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
            chunks = asyncio.run(run_level(port, streams, max(1, args.chunks // streams)))
            wall, cpu = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
            print(f"{streams:4d} streams: {chunks:6d} chunks in {wall:6.2f} s ({chunks / wall:8.1f} a second); "
                  f"server CPU {1e6 * cpu / chunks:7.1f} us a chunk ({100 * cpu / wall:5.1f}% of a core)",
                  flush=True)
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
