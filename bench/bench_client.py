"""`tandem bench`'s own client against the fake REST server: chunks a second, its CPU a chunk, first tokens.

    python bench/bench_client.py [--streams 1,16,64] [--tokens 128] [--token-delay 0.007]

bench/rest_stream.py's server (the OpenAI-compatible app over the test suite's fake engine, a token per stream
every --token-delay seconds) in a process of its own; in this one, tandem.bench.run_level at each number of
streams, two requests a stream. The ideal is streams / token-delay chunks a second: a client that falls short of
it while the server has CPU to spare is what limits the level. `PYTHONPATH=<other checkout>` runs that tree's
client. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # after PYTHONPATH: another checkout's client wins


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16,64", help="concurrent streams per level")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a request")
    ap.add_argument("--token-delay", type=float, default=0.007, help="the fake engine's seconds per step")
    args = ap.parse_args(argv)
    from tandem.bench import run_level

    # This checkout's server, whichever checkout's client PYTHONPATH names.
    spec = importlib.util.spec_from_file_location("rest_stream", REPO / "bench" / "rest_stream.py")
    rest_stream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rest_stream)
    start_server = rest_stream.start_server

    server, port = start_server(args.token_delay)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(run_level(url, ["hi"], "never", 4, 8, 16))  # warm-up
        for streams in (int(x) for x in args.streams.split(",")):
            cpu0, t0 = time.process_time(), time.perf_counter()
            level = asyncio.run(run_level(url, ["hi"], "never", streams, 2 * streams, args.tokens))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            chunks, ideal = 2 * streams * args.tokens, streams / args.token_delay
            print(f"{streams:4d} streams: {chunks / wall:8.0f} chunks a second (ideal {ideal:8.0f}); "
                  f"client CPU {1e6 * cpu / chunks:6.1f} us a chunk ({100 * cpu / wall:5.1f}% of a core); "
                  f"first token p50 {1e3 * level.ttft_p50_s:6.1f} ms", flush=True)
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
