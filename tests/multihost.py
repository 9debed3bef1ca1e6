"""Several 'hosts' on one machine for tests: network namespaces joined by veth links, or loopback addresses.

`NetnsNetwork` gives each host its own network namespace with one veth link to a
bridge in a hub namespace, on a private subnet that exists only inside these
namespaces; processes run there through `ip netns exec` and talk over real TCP
across the links. A per-namespace /etc/netns/NAME/hosts (bind-mounted over
/etc/hosts by `ip netns exec`) lets a test make one name resolve to several
addresses and change that while processes run. `LoopbackNetwork` is the
fallback where namespaces cannot be made: the hosts are 127.0.0.x addresses of
this namespace. Both clean up everything they made (processes first, then
namespaces and /etc/netns entries), also when a test fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.services import REPO

NETNS_ETC = Path("/etc/netns")
SUBNET = "10.217.0"  # private to the namespaces these tests make; never configured on the machine itself
LOCALHOST_LINES = "127.0.0.1 localhost\n::1 localhost\n"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why network namespaces with veth links cannot be made here, or None when they can."""
    if os.environ.get("TANDEM_TEST_NO_NETNS"):  # to run the loopback fallback on a machine that has both
        return "TANDEM_TEST_NO_NETNS is set"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"network namespaces need root (this test runs as uid {os.geteuid()})"
    probe = f"t17probe{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", probe)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        if veth.returncode != 0:
            return f"cannot make a veth link in a namespace: {veth.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe)


def _die_with_test() -> None:
    """preexec_fn: the child gets SIGKILL if the test process dies (survives `ip netns exec`'s exec)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Host:
    """One machine of the test: an address and a way to run commands there."""

    name: str
    ip: str
    prefix: tuple[str, ...] = ()  # ("ip", "netns", "exec", NS) or nothing

    def argv(self, *cmd: str) -> list[str]:
        return [*self.prefix, *cmd]


class Network:
    """Hosts plus the processes started on them; subclasses say how hosts are made."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.hosts: dict[str, Host] = {}
        self.procs: list[tuple[str, subprocess.Popen, object]] = []

    def start(self, host: Host, name: str, cmd: list[str]) -> subprocess.Popen:
        """Run `cmd` on `host`, its output in tmp/NAME.log; stopped by close()."""
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 (closed in close())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(host.argv(*cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                preexec_fn=_die_with_test)
        self.procs.append((name, proc, log))
        return proc

    def python(self, host: Host, name: str, *args: str) -> subprocess.Popen:
        return self.start(host, name, [sys.executable, *args])

    def run_python(self, host: Host, code: str, *args: str, timeout: float = 30) -> str:
        """Run a short Python snippet on `host` and return its stdout (raises on failure)."""
        out = subprocess.run(host.argv(sys.executable, "-c", code, *args), capture_output=True, text=True,
                             timeout=timeout, cwd=REPO)
        if out.returncode != 0:
            raise RuntimeError(f"on {host.name}: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def http_get(self, host: Host, url: str) -> tuple[int, str]:
        """GET url from `host`; (status, body), status 0 when it cannot connect."""
        code = ("import sys, urllib.request, urllib.error\n"
                "try:\n"
                "    r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n"
                "    print(e.code)\n"
                "except OSError:\n"
                "    print(0)\n")
        status, _, body = self.run_python(host, code, url).partition("\n")
        return int(status), body

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def check_running(self) -> None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None and name != "load":
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")

    def stop(self, name: str, timeout: float = 20) -> None:
        for n, proc, _log in self.procs:
            if n == name and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def close(self) -> None:
        for _name, proc, _log in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _name, proc, log in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


class NetnsNetwork(Network):
    """Each host a network namespace, linked by a veth pair to a bridge in a hub namespace."""

    def __init__(self, tmp: Path):
        super().__init__(tmp)
        self.tag = f"t17{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.namespaces: list[str] = []
        self.hub = self._namespace("hub")
        self._must("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._must("-n", self.hub, "link", "set", "br0", "up")

    def _must(self, *args: str) -> None:
        out = _ip(*args)
        if out.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def _namespace(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        self._must("netns", "add", ns)
        self.namespaces.append(ns)
        self._must("-n", ns, "link", "set", "lo", "up")
        return ns

    def add_host(self, role: str) -> Host:
        ns = self._namespace(role)
        ip = f"{SUBNET}.{len(self.hosts) + 2}"
        port = f"v{len(self.hosts)}"
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        self.set_hosts_file(ns, {})
        self._must("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._must("-n", self.hub, "link", "set", port, "master", "br0", "up")
        self._must("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        self._must("-n", ns, "link", "set", "eth0", "up")
        host = Host(role, ip, ("ip", "netns", "exec", ns))
        self.hosts[role] = host
        return host

    def namespace_of(self, host: Host) -> str:
        return host.prefix[-1]

    @staticmethod
    def set_hosts_file(ns: str, names: dict[str, list[str]]) -> None:
        """What /etc/hosts says inside `ns`: name -> addresses.

        Written in place, not replaced: `ip netns exec` bind-mounted this very file,
        and a process already running sees the new text only through the same inode.
        """
        lines = LOCALHOST_LINES + "".join(f"{ip} {name}\n" for name, ips in names.items() for ip in ips)
        with open(NETNS_ETC / ns / "hosts", "w") as f:
            f.write(lines)

    def close(self) -> None:
        try:
            super().close()
        finally:
            for ns in reversed(self.namespaces):
                _ip("netns", "del", ns)
                shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            try:
                NETNS_ETC.rmdir()  # only when empty: we may have made it, others may use it
            except OSError:
                pass


class LoopbackNetwork(Network):
    """Each host a distinct 127.0.0.x address of this namespace (Linux routes all of 127/8 to lo)."""

    def add_host(self, role: str) -> Host:
        host = Host(role, f"127.0.0.{len(self.hosts) + 2}")
        self.hosts[role] = host
        return host
