"""The transport between two "hosts": TransferSource in namespace P, TransferSink in namespace D, one veth link,
UCX forced onto TCP over it (`UCX_TLS=tcp`, `UCX_NET_DEVICES=<veth>`), shaped and broken with tc / ip link.

Settings of the fault cases: D's `timeout_s` = 2 s (a stalled chunk or silent peer fails the pull),
P's `lease_s` = 4 s (staging D never says "done" for is freed). "Idle" means: D's sink has no pull in flight and
its pool no region; P has no staged request and no region.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest

from lynx_connector.lab import netns
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.nixl_wrapper import nixl_available

from .netpair import MB, NetPair, net_pair

_ok, _why = netns.available()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.nixl,
    pytest.mark.skipif(not _ok, reason=f"network namespaces: {_why}"),
    pytest.mark.skipif(not nixl_available(), reason="NIXL not installed"),
]

TIMEOUT_S, LEASE_S = 2.0, 4.0
SLACK_S = 2.0  # scheduling slack on the loaded 2-core box


def src_cfg(pair: NetPair) -> TransportConfig:
    return TransportConfig(pool_bytes=96 * MB, lease_s=LEASE_S, host=pair.link.addr_a)


def sink_cfg(link_gbps: float | None = None) -> TransportConfig:
    return TransportConfig(pool_bytes=96 * MB, timeout_s=TIMEOUT_S, link_gbps=link_gbps)


@pytest.fixture(scope="module")
def pair() -> Iterator[NetPair]:
    with net_pair(mtu=9000) as p:
        p.start_source(src_cfg(p))
        p.start_sink(sink_cfg())
        yield p


@pytest.fixture
def fresh(pair: NetPair) -> Iterator[NetPair]:
    """The module's pair with both processes alive and the link clean before and after the test."""
    if not pair.src_proc.is_alive():
        pair.start_source(src_cfg(pair))
    if not pair.sink_proc.is_alive():
        pair.start_sink(sink_cfg())
    try:
        yield pair
    finally:
        for ns, dev in ((pair.p_ns, pair.p_dev), (pair.d_ns, pair.d_dev)):
            pair.topo.clear(ns, dev)
            pair.topo.set_link_up(ns, dev, True)


def assert_idle(pair: NetPair, req_ids: list[str], p_within: float) -> None:
    """D: nothing in flight, pool empty once the caller frees its views; P: staging freed within `p_within`."""
    st = pair.sink("stats")
    assert st["pulls_live"] == 0, st
    for r in req_ids:
        pair.sink("free", r)
    st = pair.sink("stats")
    assert st["pool_regions_live"] == 0 and st["pool_bytes_allocated"] == 0, st
    pair.wait_source_idle(p_within)


def roundtrip_ok(pair: NetPair, req: str, nbytes: int = 256 * 1024) -> float:
    """One small request end to end (recovery check); returns its time to anchor."""
    sums = pair.src("stage", [(req, nbytes, nbytes, 7)], True)
    pair.pull((req, nbytes, nbytes))
    evs = pair.events(2, 30)
    assert [e[3] for e in evs] == [True, True], evs
    assert pair.sink("crc", req) == tuple(sums[req])
    assert_idle(pair, [req], 5)
    return evs[0][6]


@pytest.mark.timeout(240)
def test_kv_crosses_the_veth_over_tcp(fresh: NetPair) -> None:
    """Byte-exact pull P -> D; the payload is counted on P's veth, not on its loopback (no cma, no lo)."""
    p = fresh
    lo0, v0 = p.topo.counters(p.p_ns, "lo"), p.topo.counters(p.p_ns, p.p_dev)
    sums = p.src("stage", [("x1", 6 * MB, 10 * MB, 1)], True)
    p.pull(("x1", 6 * MB, 10 * MB))
    evs = p.events(2, 30)
    assert [(e[2], e[3]) for e in evs] == [("anchor", True), ("residual", True)], evs
    assert p.sink("crc", "x1") == tuple(sums["x1"])
    lo1, v1 = p.topo.counters(p.p_ns, "lo"), p.topo.counters(p.p_ns, p.p_dev)
    assert v1["tx_bytes"] - v0["tx_bytes"] >= 16 * MB
    assert lo1["tx_bytes"] - lo0["tx_bytes"] < MB
    assert_idle(p, ["x1"], 5)


def _time_to_anchor(p: NetPair, tag: str, anchor: int, residual: int, reps: int) -> tuple[list[float], list[list]]:
    times, orders = [], []
    for i in range(reps):
        rid = f"{tag}{i}"
        p.src("stage", [(rid, anchor, residual, -3)], True)
        p.pull((rid, anchor, residual))
        evs = p.events(2, 60)
        assert all(e[3] for e in evs), evs
        orders.append([e[2] for e in evs])
        times.append(next(e[6] for e in evs if e[2] == "anchor"))
        assert_idle(p, [rid], 5)
    return times, orders


def _overtake(p: NetPair, tag: str) -> list[tuple[str, str]]:
    """c1 (small anchor, big residual) pulled; c2 pulled while c1's residual flows: c2's anchor lands first."""
    c1, c2 = f"{tag}c1", f"{tag}c2"
    p.src("stage", [(c1, 256 * 1024, 12 * MB, -5), (c2, 256 * 1024, 256 * 1024, -6)], True)
    p.pull((c1, 256 * 1024, 12 * MB))
    first = p.events(1, 30)
    assert first[0][2] == "anchor" and first[0][3], first
    p.pull((c2, 256 * 1024, 256 * 1024))
    evs = first + p.events(3, 60)
    assert all(e[3] for e in evs), evs
    assert_idle(p, [c1, c2], 5)
    return [(e[1][len(tag):], e[2]) for e in evs]


@pytest.mark.timeout(400)
def test_shaped_link_agrees_with_transport_pacing(fresh: NetPair) -> None:
    """Same rate two ways: tc tbf at RATE on the veth with an unpaced transport, vs an unshaped veth with the
    transport's token bucket at the same `link_gbps`. Median time-to-anchor of a 24 MiB anchor agrees within
    10%; anchors come before residuals and a later request's anchor overtakes a residual in both."""
    p = fresh
    rate_mbit, anchor, residual, reps = 300.0, 24 * MB, 4 * MB, 3
    ideal = anchor / (rate_mbit * 1e6 / 8)
    roundtrip_ok(p, "warm")  # handshake done, so both measurements time the data only
    p.topo.shape(p.p_ns, p.p_dev, rate_mbit)
    shaped, shaped_orders = _time_to_anchor(p, "s", anchor, residual, reps)
    shaped_overtake = _overtake(p, "s")
    p.topo.clear(p.p_ns, p.p_dev)
    paced_proc, paced_conn = p.sink_proc, p.sink_conn
    # a second sink in D, paced by the transport itself
    p.start_sink(sink_cfg(link_gbps=rate_mbit / 1000))
    try:
        roundtrip_ok(p, "pwarm")
        paced, paced_orders = _time_to_anchor(p, "p", anchor, residual, reps)
        paced_overtake = _overtake(p, "p")
    finally:
        p.stop_sink()
        p.sink_proc, p.sink_conn = paced_proc, paced_conn
    ms, mp_ = statistics.median(shaped), statistics.median(paced)
    print(f"time to anchor at {rate_mbit} Mbit/s ({anchor >> 20} MiB, ideal {ideal:.3f}s): "
          f"shaped {[round(t, 3) for t in shaped]} median {ms:.3f}; paced {[round(t, 3) for t in paced]} "
          f"median {mp_:.3f}; shaped/paced {ms / mp_:.3f}")
    assert abs(ms - mp_) / mp_ <= 0.10, (shaped, paced)
    assert all(o == ["anchor", "residual"] for o in shaped_orders + paced_orders)
    for order in (shaped_overtake, paced_overtake):
        assert order.index(("c2", "anchor")) < order.index(("c1", "residual")), order
    assert ms >= 0.9 * ideal  # the shaper really limited the rate
