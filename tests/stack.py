"""A whole tandem stack (target, draft replicas, gateway) as real processes, for end-to-end tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gateway.serve import free_ports
from tests.listening import listening
from tests.services import REPO, Service


def _lost_its_port(log: str) -> bool:
    """Whether a gateway's log says another process held its REST or gRPC port."""
    return "address already in use" in log.lower() or "the address is in use" in log


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text endpoint's samples, by name with labels."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Gateway:
    """A `tandem gateway` process over services that are already running."""

    ATTEMPTS = 3  # ports another process took first are drawn again

    def __init__(self, tmp: Path, target: str, drafts: list[str], *gateway_args: str, name: str = "gateway"):
        self.log_path = tmp / f"{name}.log"
        argv = [sys.executable, "-m", "tandem.cli", "gateway", "--target", target, "--draft", ",".join(drafts),
                *gateway_args]
        for attempt in range(1, self.ATTEMPTS + 1):
            # Taken together: two ports asked for one after the other were once the same one (the gateway's
            # gRPC server took it, then its REST server failed to bind).
            self.port, self.grpc_port = free_ports(2)
            self._log = open(self.log_path, "w")  # noqa: SIM115
            self.proc = subprocess.Popen([*argv, "--port", str(self.port), "--grpc-port", str(self.grpc_port)],
                                         stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)})
            self.url = f"http://127.0.0.1:{self.port}"
            try:
                self.wait_ready()
                return
            except RuntimeError:
                self._log.close()
                if attempt == self.ATTEMPTS or not _lost_its_port(self.log_path.read_text(errors="replace")):
                    raise

    def wait_ready(self, timeout: float = 120) -> None:
        """Until this gateway's own process listens on its port and the port answers /health. A port drawn free
        may be taken by another test's gateway before this one binds it, and that one answers /health (a likely
        cause of stop 53: a test's requests going to another test's gateway, then meeting its drain's 503 and
        its exit)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.log_path.read_text()}")
            try:
                if (any(port == self.port for _, port in listening(self.proc.pid))
                        and httpx.get(f"{self.url}/health", timeout=2).status_code == 200):
                    return
            except (httpx.HTTPError, OSError):  # OSError: its /proc entries, as it exits
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway not ready:\n{self.log_path.read_text()}")

    def metrics(self) -> dict[str, float]:
        return scrape(f"{self.url}/metrics")

    def complete(self, prompt: str, **body) -> dict:
        r = httpx.post(f"{self.url}/v1/completions", json={"prompt": prompt, **body}, timeout=120)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class Stack(Gateway):
    """Target and draft services, then a gateway over them (the gateway's methods are the stack's)."""

    def __init__(self, tmp: Path, target_dir: Path, draft_dirs: list[Path], *gateway_args: str,
                 target_args: tuple[str, ...] = ("--num-blocks", "256", "--block-size", "8"),
                 draft_args: tuple[str, ...] = (), drafts_read_target: bool = False, step_lanes: bool = True):
        """drafts_read_target: the drafts get --target, and read the features the target holds.
        step_lanes: the services also serve their step streams on same-host lanes (as under `tandem
        serve`), which the gateway then uses; off: gRPC only."""
        self.tmp = tmp
        # A socket's path has a limit of about 100 bytes: a short directory of its own, not tmp.
        self.lane_dir = Path(tempfile.mkdtemp(prefix="tandem-lane-")) if step_lanes else None
        lane = ("--step-lane", str(self.lane_dir)) if step_lanes else ()
        target_args, draft_args = (*target_args, *lane), (*draft_args, *lane)
        self.target = Service(["target", "--model", str(target_dir), *target_args], tmp, "target")
        if drafts_read_target:  # the target's address is known once its port is bound
            draft_args = (*draft_args, "--target", self.target.address)
        self.drafts = [Service(["draft", "--model", str(d), "--target-model", str(target_dir), *draft_args], tmp,
                               f"draft{i}")
                       for i, d in enumerate(draft_dirs)]
        self.target.wait_serving()
        for d in self.drafts:
            d.wait_serving()
        super().__init__(tmp, self.target.address, [d.address for d in self.drafts], *gateway_args)
        self.gateway, self.gateway_log = self.proc, self.log_path

    def stop(self) -> None:
        super().stop()
        for d in self.drafts:
            d.stop()
        self.target.stop()
        if self.lane_dir is not None:
            shutil.rmtree(self.lane_dir, ignore_errors=True)
