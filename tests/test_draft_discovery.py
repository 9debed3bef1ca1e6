"""Draft replica discovery: parsing --draft, resolving names and files, and the pool following them."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

from gateway.discovery import DraftSource, SourceKind, parse_draft_source, wait_for_replicas
from gateway.draft_pool import DraftPool, feature_layers_match
from gateway.main import build_parser
from tandem.errors import Unavailable


@dataclass
class FakeInfo:
    feature_layers: tuple[int, ...]


class FakeClient:
    """A DraftClient stand-in: health and feature layers set by the test, close() recorded."""

    def __init__(self, address: str, layers: tuple[int, ...] = (2, 4, 5)):
        self.address = address
        self.layers = layers
        self.up = True
        self.closed = False

    def healthy(self) -> bool:
        return self.up

    def info(self) -> FakeInfo:
        return FakeInfo(self.layers)

    def close(self) -> None:
        self.closed = True


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def addrinfo(*pairs: tuple[str, int]) -> list:
    """What getaddrinfo answers: one entry per (address, port), IPv4 and IPv6 shapes."""
    out = []
    for host, port in pairs:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sockaddr = (host, port, 0, 0) if family == socket.AF_INET6 else (host, port)
        out.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
    return out


# --- parsing --------------------------------------------------------------------------------------

def test_a_plain_list_stays_a_fixed_list_in_the_order_given():
    src = parse_draft_source("b:2,a:1, none ,")
    assert src.kind == SourceKind.STATIC and not src.dynamic
    assert src.resolve() == ("b:2", "a:1")
    assert parse_draft_source("").resolve() == () and parse_draft_source("none").resolve() == ()


def test_dns_and_file_sources_parse_with_their_interval():
    dns = parse_draft_source("dns:///draft-headless.tandem.svc:50053", 2.5)
    assert (dns.kind, dns.host, dns.port, dns.interval_s, dns.dynamic) == (
        SourceKind.DNS, "draft-headless.tandem.svc", 50053, 2.5, True)
    assert dns.describe() == "dns:///draft-headless.tandem.svc:50053"
    v6 = parse_draft_source("dns:///[fd00::1]:7")
    assert (v6.host, v6.port) == ("fd00::1", 7)
    f = parse_draft_source("file:///etc/tandem/drafts")
    assert f.kind == SourceKind.FILE and str(f.path) == "/etc/tandem/drafts"


@pytest.mark.parametrize("spec", ["dns:///nameonly", "dns:///name:0", "dns:///:5", "file://relative/path"])
def test_a_malformed_source_is_refused(spec):
    with pytest.raises(ValueError):
        parse_draft_source(spec)


def test_a_non_positive_interval_is_refused():
    with pytest.raises(ValueError, match="interval"):
        DraftSource(kind=SourceKind.DNS, host="x", port=1, interval_s=0)


def test_the_gateway_parser_keeps_the_list_flag_and_adds_discovery_flags():
    args = build_parser().parse_args(["--target", "t:1", "--draft", "dns:///d:2", "--draft-resolve-interval",
                                      "0.5", "--draft-wait", "3"])
    assert (args.draft, args.draft_resolve_interval, args.draft_wait) == ("dns:///d:2", 0.5, 3.0)
    assert build_parser().parse_args(["--target", "t:1", "--draft", "a:1,b:2"]).draft == "a:1,b:2"


# --- resolving --------------------------------------------------------------------------------------

def test_dns_answers_become_sorted_unique_addresses_with_ipv6_in_brackets():
    answers = addrinfo(("10.0.0.9", 50053), ("10.0.0.2", 50053), ("10.0.0.9", 50053), ("fd00::3", 50053))
    src = parse_draft_source("dns:///d:50053", resolver=lambda host, port, type: answers)
    assert src.resolve() == ("10.0.0.2:50053", "10.0.0.9:50053", "[fd00::3]:50053")


def test_a_name_that_does_not_exist_means_no_replicas_but_a_failed_lookup_means_no_change():
    def nxdomain(*_a, **_k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def timeout(*_a, **_k):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    assert parse_draft_source("dns:///d:1", resolver=nxdomain).resolve() == ()
    assert parse_draft_source("dns:///d:1", resolver=timeout).resolve() is None


def test_the_real_resolver_resolves_localhost():
    assert "127.0.0.1:50053" in parse_draft_source("dns:///localhost:50053").resolve()


def test_a_file_source_reads_one_address_per_line_and_skips_comments_and_junk(tmp_path):
    f = tmp_path / "drafts"
    f.write_text("# replicas\n10.0.0.2:50053\n\n10.0.0.1:50053  # the first\nnot-an-address\n10.0.0.2:50053\n")
    src = parse_draft_source(f"file://{f}")
    assert src.resolve() == ("10.0.0.1:50053", "10.0.0.2:50053")
    f.write_text("")
    assert src.resolve() == ()
    f.unlink()
    assert src.resolve() is None  # unreadable: keep what we have


def test_start_up_waits_for_a_first_replica_of_a_dynamic_source(tmp_path):
    f = tmp_path / "drafts"
    f.write_text("")
    threading.Timer(0.2, lambda: f.write_text("127.0.0.1:9\n")).start()
    assert wait_for_replicas(parse_draft_source(f"file://{f}"), timeout_s=10, poll_s=0.05) == ("127.0.0.1:9",)
    f.write_text("")
    assert wait_for_replicas(parse_draft_source(f"file://{f}"), timeout_s=0.1, poll_s=0.05) == ()


# --- the pool following a source --------------------------------------------------------------------

def make_pool(addresses: list[str], lost: list):
    clients: dict[str, FakeClient] = {}

    def make(address: str) -> FakeClient:
        clients[address] = FakeClient(address)
        return clients[address]

    pool = DraftPool([make(a) for a in addresses], on_lost=lost.append, make_client=make)
    return pool, clients


def test_a_new_address_is_appended_and_joins_once_its_health_check_passes():
    lost: list = []
    pool, clients = make_pool(["a:1"], lost)
    pool.replicas[0].healthy = True
    pool.reconcile(["a:1", "b:1"])
    assert [r.client.address for r in pool.replicas] == ["a:1", "b:1"] and pool.replicas[1].index == 1
    assert not pool.replicas[1].healthy
    clients["b:1"].up = False
    prober = threading.Thread(target=pool.probe_forever, args=(0.01,), daemon=True)
    prober.start()
    time.sleep(0.1)
    assert not pool.replicas[1].healthy  # not serving yet
    clients["b:1"].up = True
    wait_until(lambda: pool.replicas[1].healthy)
    assert pool.least_loaded() is not None and len(pool.healthy()) == 2
    pool.stop()
    prober.join(2)


def test_a_vanished_address_is_retired_in_place_and_its_requests_are_handed_to_failover():
    lost: list = []
    pool, clients = make_pool(["a:1", "b:1"], lost)
    for r in pool.replicas:
        r.healthy = True
    a = pool.replicas[0]
    a.requests.add("req-1")
    queued = a.submit(lambda: "ran")  # queued before the retirement: still runs
    pool.reconcile(["b:1"])
    assert pool.replicas[0] is a and a.index == 0 and a.retired and not a.healthy
    assert lost == [a]  # the core's on_lost: it detaches req-1 and re-attaches it to b after catch-up
    assert queued.result(timeout=5) == "ran"
    wait_until(lambda: clients["a:1"].closed)
    with pytest.raises(Unavailable, match="retired"):
        a.submit(lambda: "never").result(timeout=5)
    assert pool.least_loaded() is pool.replicas[1]
    pool.stop()


def test_a_returning_address_gets_a_new_entry_and_the_retired_one_is_never_probed_back():
    lost: list = []
    pool, clients = make_pool(["a:1"], lost)
    pool.replicas[0].healthy = True
    pool.reconcile([])
    pool.reconcile(["a:1"])
    old, new = pool.replicas
    assert old.retired and not new.retired and new.index == 1 and new.client is not old.client
    prober = threading.Thread(target=pool.probe_forever, args=(0.01,), daemon=True)
    prober.start()
    wait_until(lambda: new.healthy)
    time.sleep(0.05)
    assert not old.healthy
    pool.stop()
    prober.join(2)


def test_a_replica_with_other_feature_layers_is_not_admitted(caplog):
    lost: list = []
    pool, clients = make_pool([], lost)
    pool.admission = feature_layers_match(lambda: (2, 4, 5))
    pool.reconcile(["good:1", "odd:1"])
    clients["odd:1"].layers = (1, 2, 3)
    prober = threading.Thread(target=pool.probe_forever, args=(0.01,), daemon=True)
    prober.start()
    wait_until(lambda: pool.replicas[0].healthy)
    time.sleep(0.1)  # several probe rounds
    assert not pool.replicas[1].healthy
    assert "[1, 2, 3]" in pool.replicas[1].refused
    assert sum("not admitted" in r.getMessage() for r in caplog.records) == 1  # said once, not every round
    clients["odd:1"].layers = (2, 4, 5)  # e.g. redeployed with the right checkpoint
    wait_until(lambda: pool.replicas[1].healthy)
    pool.stop()
    prober.join(2)


def test_following_a_source_applies_answers_and_ignores_unknown_ones():
    lost: list = []
    pool, _ = make_pool(["a:1"], lost)
    answers = iter([None, ["a:1", "b:1"], None, RuntimeError("resolver bug"), ["b:1"]])
    seen = threading.Event()

    def resolve():
        try:
            answer = next(answers)
        except StopIteration:
            seen.set()
            return None
        if isinstance(answer, Exception):
            raise answer
        return answer

    pool.follow(resolve, 0.01)
    assert seen.wait(5)
    assert [(r.client.address, r.retired) for r in pool.replicas] == [("a:1", True), ("b:1", False)]
    with pytest.raises(RuntimeError):
        pool.follow(resolve, 0.01)
    pool.stop()
