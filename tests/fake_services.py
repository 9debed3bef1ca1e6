"""Stand-ins for `tandem target|draft|gateway`, to test `tandem serve`'s supervision without models.

Run as `python tests/fake_services.py <command> [flags]`. Each one binds like
the real service (target/draft: a free port reported in --port-file, gRPC
health; gateway: REST /health on --port and gRPC health on --grpc-port),
writes what it was started with and when it was stopped under $FAKE_RECORD_DIR,
and misbehaves on request:
  FAKE_DIE=<name>           exit 3 shortly after becoming ready
  FAKE_DIE_AT_START=<name>  exit 4 before binding anything
where <name> is target, draft0, draft1, ... or gateway.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tandem.grpc_host import ServiceHost


def record(name: str, what: str, data: object) -> None:
    (Path(os.environ["FAKE_RECORD_DIR"]) / f"{name}.{what}").write_text(json.dumps(data))


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def main() -> int:
    command, argv = sys.argv[1], sys.argv[2:]
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    p.add_argument("--port-file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int)
    args, _ = p.parse_known_args(argv)
    name = Path(args.port_file).stem if args.port_file else command
    record(name, "argv", [command, *argv])
    record(name, "pid", os.getpid())
    record(name, "lane_spin", os.environ.get("TANDEM_LANE_SPIN_US"))
    print(f"fake {name} starting", flush=True)
    if os.environ.get("FAKE_DIE_AT_START") == name:
        print(f"fake {name} cannot start", flush=True)
        return 4

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if command == "gateway":
        http = ThreadingHTTPServer((args.host, args.port), Health)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        host = ServiceHost(args.host, args.grpc_port, [])
    else:
        host = ServiceHost("127.0.0.1", args.port, [])
    host.start()
    if args.port_file:
        Path(args.port_file).write_text(str(host.port))
    time.sleep(0.3)  # "loading"
    host.set_serving(True)
    print(f"fake {name} serving", flush=True)
    if os.environ.get("FAKE_DIE") == name:
        time.sleep(0.5)
        print(f"fake {name} crashing", flush=True)
        return 3
    stop.wait()
    record(name, "stopped", time.time())
    print(f"fake {name} got SIGTERM", flush=True)
    host.stop(0)
    if command == "gateway":
        time.sleep(0.3)  # draining: the others must still be up meanwhile
    return 0


if __name__ == "__main__":
    sys.exit(main())
