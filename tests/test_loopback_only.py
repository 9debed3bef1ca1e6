"""Every service listens on 127.0.0.1 unless told otherwise: gRPC, REST and, with --tp, the ranks'
rendezvous and links (a TCP rendezvous store listened on every interface)."""

from __future__ import annotations

import sys

import pytest

from tests.listening import is_loopback, listening
from tests.services import Service

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_every_process_of_the_stack_listens_on_loopback_only(byte_stack):
    for name, proc in [("target", byte_stack.target.proc), ("draft", byte_stack.drafts[0].proc),
                       ("gateway", byte_stack.gateway)]:
        addresses = listening(proc.pid)
        assert addresses, name
        assert all(is_loopback(a) for a, _ in addresses), (name, addresses)
    gateway = dict((port, a) for a, port in listening(byte_stack.gateway.pid))
    assert {byte_stack.port, byte_stack.grpc_port} <= set(gateway)


def test_a_tensor_parallel_target_listens_on_loopback_only(tiny_llama, tmp_path):
    target = Service(["target", "--model", str(tiny_llama("gqa")), "--tp", "2", "--num-blocks", "16"], tmp_path,
                     "tp2")
    try:
        target.wait_serving()
        addresses = listening(target.proc.pid)
        assert len(addresses) >= 3  # gRPC, and each rank's gloo link
        assert all(is_loopback(a) for a, _ in addresses), addresses
    finally:
        assert target.stop() == 0
