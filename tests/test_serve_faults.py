"""`tandem serve` on the demo pair, end to end: it restarts a target that was SIGKILLed at the same
address and a stream in flight completes unchanged; on SIGTERM a stream in flight finishes, new
requests get 503 and gRPC health says NOT_SERVING meanwhile, and every child exits.

The target is paced (at least 25 ms a step) so that the streams are surely still running when
the target is killed and when SIGTERM arrives; outputs do not depend on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.serve import free_ports
from tests.faults import NOT_SERVING, StreamResult, grpc_health, rest_stream, start, wait_for
from tests.listening import process_tree
from tests.services import REPO

PROMPT = "def parse_header(line):\n"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")  # a zombie awaiting a parent that has exited is gone too
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"


def child_pid(serve_pid: int, command: str) -> int:
    """The pid of serve's child running `tandem <command>`."""
    for pid in process_tree(serve_pid)[1:]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command.encode() in argv[:4]:
            return pid
    raise AssertionError(f"no {command} child of {serve_pid}")


@pytest.fixture()
def served(tmp_path):
    port, grpc_port = free_ports(2)
    log = open(tmp_path / "serve.err", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--device", "cpu", "--port", str(port),
         "--grpc-port", str(grpc_port), "--max-model-len", "512", "--log-dir", str(tmp_path / "logs"),
         "--target-args=--emulate-step-cost 25,0 --num-blocks 512", "--gateway-args=--no-profile"],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    out = []
    while not any("Press Ctrl-C" in line for line in out):
        line = proc.stdout.readline()
        assert line, f"serve exited before it was ready:\n{(tmp_path / 'serve.err').read_text()}"
        out.append(line)
    proc.url, proc.grpc_port, proc.err = f"http://127.0.0.1:{port}", grpc_port, tmp_path / "serve.err"
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


def body(max_tokens: int) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "speculation": "never"}


def test_serve_restarts_a_killed_target_under_a_stream_then_drains_on_sigterm(served):
    undisturbed = httpx.post(f"{served.url}/v1/completions", json=body(64), timeout=120).json()["choices"][0]["text"]
    stream = StreamResult("rest")
    start(rest_stream, served.url, body(64), stream)
    wait_for(lambda: stream.chunks > 0, "the stream to be under way")
    os.kill(child_pid(served.pid, "target"), signal.SIGKILL)
    assert stream.done.wait(180), "the stream never ended"
    assert (stream.outcome, stream.error, stream.text) == ("completed", "", undisturbed)
    assert "restarting target in 1 s" in served.err.read_text()

    children = process_tree(served.pid)[1:]
    draining = StreamResult("rest")
    start(rest_stream, served.url, body(96), draining)
    wait_for(lambda: draining.chunks > 0, "the second stream to be under way")
    served.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{served.url}/health", timeout=5).status_code == 503, "/health to say 503")
    refused = httpx.post(f"{served.url}/v1/completions", json=body(4), timeout=30)
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert grpc_health(served.grpc_port) == NOT_SERVING
    assert served.wait(120) == 0
    assert draining.done.wait(30)
    assert (draining.outcome, draining.error) == ("completed", ""), draining.message
    wait_for(lambda: all(gone(pid) for pid in children), "every child to exit", timeout=30)
