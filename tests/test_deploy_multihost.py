"""Gateway, target and drafts on separate 'hosts' over real TCP; a draft replica joins under load, one leaves.

With network namespaces (root, iproute2), each service runs in its own namespace
linked by veth to a bridge, and the gateway finds the drafts the Kubernetes way:
every address of one DNS name (here from the gateway's /etc/hosts, which the
test rewrites while it runs), resolved again every 0.3 s. Where namespaces
cannot be made that variant is skipped with the reason, and the same test runs
on distinct loopback addresses with a replica list file instead of DNS.

It shows: a replica started during load is picked up without a restart and
receives requests (its own load metric goes above zero); a replica that drops
out of the source is retired and its requests carry on elsewhere; and every
greedy output equals the output of a stack where nothing changed.
"""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.multihost import Host, LoopbackNetwork, NetnsNetwork, Network, netns_unavailable
from tests.services import REPO

DEMO = REPO / "demo"
NUM_PROMPTS = 6
MAX_TOKENS = 20
DRAFT_NAME = "draft.tandem.test"
TARGET_NAME = "target.tandem.test"
RESOLVE_INTERVAL_S = 0.3


@functools.cache
def _netns_problem() -> str | None:
    return netns_unavailable()


@pytest.fixture(params=["netns", "loopback"])
def network(request, tmp_path):
    problem = _netns_problem()
    if request.param == "netns":
        if problem:
            pytest.skip(f"network namespaces cannot be made here ({problem}); the loopback variant runs instead")
        net: Network = NetnsNetwork(tmp_path)
    else:
        if problem is None:
            pytest.skip("network namespaces work here, so the netns variant runs instead of this fallback")
        net = LoopbackNetwork(tmp_path)
    try:
        yield net
    finally:
        net.close()


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def wait_for(what: str, cond: Callable[[], bool], net: Network, timeout: float = 120, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        net.check_running()
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{net.log(n)[-2500:]}" for n, _, _ in net.procs)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(poll)


def metric(net: Network, client: Host, url: str, name: str) -> float | None:
    status, body = net.http_get(client, url)
    if status != 200:
        return None
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


class Placement:
    """Where the services listen and how the gateway is told which draft replicas exist."""

    def __init__(self, net: Network, gateway: Host):
        self.net, self.gateway = net, gateway
        self.netns = isinstance(net, NetnsNetwork)
        self.list_file = net.tmp / "drafts.txt"

    def port(self, host: Host, fixed: int) -> int:
        # Namespaced hosts have their own port space, so every replica can use the same
        # port behind one name, as on Kubernetes; loopback hosts share this machine's.
        return fixed if self.netns else free_port(host.ip)

    def target_address(self, target: Host, port: int) -> str:
        return f"{TARGET_NAME}:{port}" if self.netns else f"{target.ip}:{port}"

    def draft_source(self, port: int) -> str:
        return f"dns:///{DRAFT_NAME}:{port}" if self.netns else f"file://{self.list_file}"

    def announce(self, target: Host, drafts: list[tuple[Host, int]]) -> None:
        if self.netns:
            assert isinstance(self.net, NetnsNetwork)
            self.net.set_hosts_file(self.net.namespace_of(self.gateway),
                                    {TARGET_NAME: [target.ip], DRAFT_NAME: [h.ip for h, _ in drafts]})
        else:
            self.list_file.write_text("".join(f"{h.ip}:{p}\n" for h, p in drafts))


def start_draft(net: Network, host: Host, name: str, port: int, metrics_port: int) -> None:
    net.python(host, name, "-m", "tandem.cli", "draft", "--model", str(DEMO / "draft"), "--target-model",
               str(DEMO / "target"), "--device", "cpu", "--host", host.ip, "--port", str(port),
               "--num-blocks", "256", "--metrics-port", str(metrics_port))


def test_a_draft_replica_started_under_load_is_used_and_a_vanished_one_retired_without_changing_output(
        network: Network, tmp_path: Path):
    net = network
    target, draft0, draft1, gateway, client = (net.add_host(r) for r in
                                               ("target", "draft0", "draft1", "gateway", "client"))
    place = Placement(net, gateway)
    target_port = place.port(target, 50052)
    draft_port = {h.name: place.port(h, 50053) for h in (draft0, draft1)}
    metrics_port = {h.name: place.port(h, 9090) for h in (draft0, draft1)}
    rest_port, grpc_port = place.port(gateway, 8000), place.port(gateway, 50051)
    place.announce(target, [(draft0, draft_port["draft0"])])

    net.python(target, "target", "-m", "tandem.cli", "target", "--model", str(DEMO / "target"), "--device", "cpu",
               "--host", target.ip, "--port", str(target_port), "--num-blocks", "512", "--block-size", "16")
    start_draft(net, draft0, "draft0", draft_port["draft0"], metrics_port["draft0"])
    net.python(gateway, "gateway", "-m", "tandem.cli", "gateway",
               "--target", place.target_address(target, target_port),
               "--draft", place.draft_source(draft_port["draft0"]),
               "--draft-resolve-interval", str(RESOLVE_INTERVAL_S), "--draft-wait", "120",
               "--host", gateway.ip, "--port", str(rest_port), "--grpc-port", str(grpc_port), "--no-profile")
    url = f"http://{gateway.ip}:{rest_port}"
    wait_for("the gateway's /health", lambda: net.http_get(client, f"{url}/health")[0] == 200, net, poll=0.5)

    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    (tmp_path / "prompts.json").write_text(json.dumps([r["prompt"] for r in rows[:NUM_PROMPTS]]))
    phase1_done, stop, out = tmp_path / "phase1.done", tmp_path / "stop", tmp_path / "load.json"
    load = net.python(client, "load", "-m", "tests.multihost_load", "--url", url,
                      "--prompts", str(tmp_path / "prompts.json"), "--max-tokens", str(MAX_TOKENS),
                      "--workers", "3", "--phase1-done", str(phase1_done), "--stop-file", str(stop),
                      "--out", str(out))
    try:
        wait_for("the reference outputs", lambda: phase1_done.exists() or load.poll() is not None, net)
        assert load.poll() is None, net.log("load")

        # A second replica starts while the load runs, then appears under the same name.
        start_draft(net, draft1, "draft1", draft_port["draft1"], metrics_port["draft1"])
        draft1_metrics = f"http://{draft1.ip}:{metrics_port['draft1']}/metrics"
        wait_for("draft1 to load", lambda: metric(net, client, draft1_metrics, "tandem_draft_sequences")
                 is not None, net, poll=0.5)
        place.announce(target, [(draft0, draft_port["draft0"]), (draft1, draft_port["draft1"])])
        wait_for("draft1 to hold requests", lambda: (metric(net, client, draft1_metrics,
                                                            "tandem_draft_sequences") or 0) > 0, net, timeout=90)
        assert f"draft replica {draft1.ip}:{draft_port['draft1']} is healthy" in net.log("gateway")

        # The first replica drops out of the name (as a scaled-down pod does): retired, requests move.
        place.announce(target, [(draft1, draft_port["draft1"])])
        gone = f"draft replica {draft0.ip}:{draft_port['draft0']} is gone from the source"
        wait_for("draft0's retirement", lambda: gone in net.log("gateway"), net, timeout=30)
        retired_at = time.time()
        net.stop("draft0")
        time.sleep(3)  # load keeps running on draft1 alone
    finally:
        stop.write_text("stop")
        load.wait(120)
    result = json.loads(out.read_text())

    reference = [r["text"] for r in result["reference"]]
    assert not result["errors"], result["errors"]
    assert [r["text"] for r in result["phase1"]] == reference  # speculation changes nothing
    assert any(r["spec_stats"]["verify_steps"] > 0 for r in result["phase1"])
    later = [r for r in result["phase2"] if r["finished_at"] > retired_at]
    assert len(result["phase2"]) >= 6 and later, f"{len(result['phase2'])} requests under load, {len(later)} late"
    mismatched = [r["prompt"] for r in result["phase2"] if r["text"] != reference[r["prompt"]]]
    assert not mismatched, f"outputs changed for prompts {mismatched}"
    # After draft0 left, drafting went on: draft1 served the trees.
    assert any(r["spec_stats"]["verify_steps"] > 0 for r in later)
