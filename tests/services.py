"""Start tandem services as real subprocesses for tests, and stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


class Service:
    """One service process; `port` 0 lets it pick a free port (read back from its port file)."""

    def __init__(self, args: list[str], tmp: Path, name: str, port: int = 0):
        self.args, self.tmp, self.name = list(args), tmp, name
        port_file = tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        self.log_path = tmp / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        self.log = open(self.log_path, "a")  # noqa: SIM115 (a restart appends to the same log)
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args, "--port", str(port),
                                      "--port-file", str(port_file)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.port = self._wait_port(port_file)
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as in a crash."""
        self.proc.kill()
        self.proc.wait()
        self.channel.close()
        self.log.close()

    def restarted(self) -> Service:
        """The same service started again at the same address (after kill() or stop())."""
        return Service(self.args, self.tmp, self.name, port=self.port)

    def _wait_port(self, port_file: Path, timeout: float = 120) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if port_file.exists() and port_file.read_text():
                return int(port_file.read_text())
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited early:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        raise TimeoutError(f"service did not bind a port:\n{self.log_path.read_text()}")

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    def wait_serving(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited:\n{self.log_path.read_text()}")
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"service not serving:\n{self.log_path.read_text()}")

    def stop(self, timeout: float = 30) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
