"""The side channel over IPv6 (``side_channel_host`` "[::1]" or a bare IPv6 address, as ``$(POD_IP)`` expands in
an IPv6 cluster): P's real zmq socket binds it, D's connects to it and pulls, inside a network namespace this test
creates (its own loopback: no traffic leaves it). NIXL is the fake fabric here: its transfers do not go through
the side channel (tests/deploy/test_netns_transport.py runs real NIXL over a veth)."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.config import LynxConfig
from lynx_connector.lab import netns
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource
from tests.transport.fakes import TEST_KEY, FakeFabric, FakeNixlWrapper
from tests.transport.test_transport_source_sink import COMPAT, collect, stage

_ok, _why = netns.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces: {_why}"),
              pytest.mark.timeout(120)]


def test_a_pull_over_an_ipv6_side_channel() -> None:
    host = LynxConfig.from_extra_config({"side_channel_host": "::1"}).side_channel_host
    assert host == "[::1]"  # written as zmq (and D's kv_transfer_params) need it
    fabric = FakeFabric()
    with netns.Topology() as topo:
        ns = topo.add_namespace("v6")
        with netns.entered(ns):  # the endpoints' zmq and service threads are created in it
            src = TransferSource(TransportConfig(pool_bytes=1 << 20, key=TEST_KEY, host=host), COMPAT,
                                 nixl=FakeNixlWrapper(fabric, "P"))
            sink = TransferSink(TransportConfig(pool_bytes=1 << 20, key=TEST_KEY, timeout_s=5.0), COMPAT,
                                nixl=FakeNixlWrapper(fabric, "D"))
        try:
            assert src.address[0] == "[::1]"
            st = stage(src, "p1", 4096, 1024)
            loc = sink.pool.alloc_request("d1", 4096, 1024)
            sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, loc.residual)
            events = collect(sink, 2)
            assert all(ev.ok for ev in events), [ev.error for ev in events]
            assert torch.equal(loc.anchor, st.anchor) and torch.equal(loc.residual, st.residual)
        finally:
            sink.close()
            src.close()
