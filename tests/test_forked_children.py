"""Children forked by a process that uses gRPC must reach exec.

gRPC's fork support restarts its poller in a forked child; a child made by
Popen with a preexec_fn (a real fork) then sometimes aborts before exec
(grpc/grpc#43055). `tandem serve` and the multi-host tests start processes that
way, so the tandem package turns fork support off.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.services import REPO

FORKS = 300  # with fork support on, about 1.6% abort: 300 forks catch it with probability above 99%

CHILD = f"""
import subprocess
from concurrent import futures

import tandem  # noqa: F401
import grpc

server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{{port}}")
grpc.channel_ready_future(channel).result(timeout=10)
codes = [subprocess.Popen(["true"], preexec_fn=lambda: None, stderr=subprocess.DEVNULL).wait()
         for _ in range({FORKS})]
print(sum(code != 0 for code in codes))
"""


def test_children_forked_by_a_process_using_grpc_all_reach_exec():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # the package's own doing
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0", f"{out.stdout.strip()} of {FORKS} children died before exec"
