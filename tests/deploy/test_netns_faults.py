"""Faults on a real link between namespace P (TransferSource) and namespace D (TransferSink), UCX over TCP.

Every case is bounded (pytest-timeout, and each wait has its own deadline), restores the link in a finally, and
ends by asserting both sides idle: D has no pull in flight and (once the caller frees its views, as the connector
does on a failed load) no pool region; P has no staged request and no region. D's `timeout_s` = 2 s, P's
`lease_s` = 4 s (D renews it every second while it pulls) and `grace_s` = 1 s (regions freed by lease stay
unused that long). The expected outcome of each case is in its docstring; "the failure policy applies" at this level
means: D gets exactly one failed terminal event per unfinished stream (the connector maps it to
`kv_load_failure_policy`), and nothing hangs.
"""

from __future__ import annotations

import os
import signal
import time
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
    pytest.mark.timeout(180),
]

TIMEOUT_S, LEASE_S, GRACE_S, SLACK_S = 2.0, 4.0, 1.0, 2.0
RATE_MBIT = 200.0  # 25 MB/s: a 16 MiB stream takes ~0.67 s, long enough to cut it half-way


def src_cfg(pair: NetPair) -> TransportConfig:
    return TransportConfig(pool_bytes=96 * MB, lease_s=LEASE_S, grace_s=GRACE_S, host=pair.link.addr_a)


def sink_cfg() -> TransportConfig:
    return TransportConfig(pool_bytes=96 * MB, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def pair() -> Iterator[NetPair]:
    with net_pair(mtu=9000) as p:
        p.start_source(src_cfg(p))
        p.start_sink(sink_cfg())
        yield p


@pytest.fixture
def fresh(pair: NetPair) -> Iterator[NetPair]:
    """Both processes alive, link clean and shaped to RATE_MBIT on P's egress; restored afterwards."""
    if not pair.src_proc.is_alive():
        pair.procs.remove(pair.src_proc)
        pair.start_source(src_cfg(pair))
    if not pair.sink_proc.is_alive():
        pair.procs.remove(pair.sink_proc)
        pair.start_sink(sink_cfg())
    pair.topo.shape(pair.p_ns, pair.p_dev, RATE_MBIT)
    try:
        yield pair
    finally:
        for ns, dev in ((pair.p_ns, pair.p_dev), (pair.d_ns, pair.d_dev)):
            pair.topo.set_link_up(ns, dev, True)
            pair.topo.clear(ns, dev)
        if pair.sink_proc.is_alive():  # a failed case must not leak its views into the next one
            pair.sink("free_all")


def wait_bytes(p: NetPair, nbytes: int, timeout: float = 20.0) -> None:
    """Block until `nbytes` more have left P's veth: the stream is really flowing (cut by progress, not time)."""
    start = p.topo.counters(p.p_ns, p.p_dev)["tx_bytes"]
    end = time.monotonic() + timeout
    while p.topo.counters(p.p_ns, p.p_dev)["tx_bytes"] - start < nbytes:
        assert time.monotonic() < end, f"fewer than {nbytes} bytes crossed the link in {timeout}s"
        time.sleep(0.02)


def sink_idle(p: NetPair, req_ids: list[str]) -> None:
    st = p.sink("stats")
    assert st["pulls_live"] == 0, st
    for r in req_ids:
        p.sink("free", r)
    st = p.sink("stats")
    assert st["pool_regions_live"] == 0 and st["pool_bytes_allocated"] == 0, st


def recovers(p: NetPair, req: str) -> None:
    """After the fault is lifted, a new request goes through byte-exact (the sink re-handshakes)."""
    sums = p.src("stage", [(req, 512 * 1024, 512 * 1024, 9)], True)
    p.pull((req, 512 * 1024, 512 * 1024))
    evs = p.events(2, 30)
    # small streams: both READs are in flight at once and may complete in either order within one poll
    assert sorted((e[2], e[3]) for e in evs) == [("anchor", True), ("residual", True)], evs
    assert p.sink("crc", req) == tuple(sums[req])
    sink_idle(p, [req])
    p.wait_source_idle(5)


def cut(p: NetPair, how: str) -> None:
    if how == "blackhole":  # 100% loss both ways, interfaces stay up
        p.topo.blackhole(p.p_ns, p.p_dev)
        p.topo.blackhole(p.d_ns, p.d_dev)
    else:
        p.topo.set_link_up(p.p_ns, p.p_dev, False)


def restore(p: NetPair) -> None:
    for ns, dev in ((p.p_ns, p.p_dev), (p.d_ns, p.d_dev)):
        p.topo.set_link_up(ns, dev, True)
        p.topo.clear(ns, dev)
    p.topo.shape(p.p_ns, p.p_dev, RATE_MBIT)


@pytest.mark.parametrize("how", ["blackhole", "link_down"])
def test_link_cut_during_anchor(fresh: NetPair, how: str) -> None:
    """Link cut once 2 MiB of a 32 MiB anchor crossed (~2.7 s at 100 Mbit/s; blackhole = 100% loss / ip link
    set down).
    Expected: D fails BOTH streams (anchor first) within timeout_s (+slack) of the cut, no hang; D idle; P frees
    the staging within lease_s (+slack) of the cut at the latest (D's "done" may not get through); after the
    link is restored a new request is served."""
    p = fresh
    req = f"ca-{how}"
    p.topo.shape(p.p_ns, p.p_dev, 100.0)
    p.src("stage", [(req, 32 * MB, 8 * MB, -1)], True)
    p.pull((req, 32 * MB, 8 * MB))
    wait_bytes(p, 2 * MB)
    cut(p, how)
    t_cut = time.monotonic()
    evs = p.events(2, TIMEOUT_S + SLACK_S + 3)
    assert [(e[2], e[3]) for e in evs] == [("anchor", False), ("residual", False)], evs
    assert all(e[4] for e in evs)
    assert evs[-1][0] - t_cut <= TIMEOUT_S + SLACK_S, evs[-1][0] - t_cut
    sink_idle(p, [req])
    p.wait_source_idle(LEASE_S + GRACE_S + SLACK_S + max(0.0, t_cut - time.monotonic()))
    restore(p)
    recovers(p, f"{req}-after")


@pytest.mark.parametrize("how", ["blackhole", "link_down"])
def test_link_cut_during_residual(fresh: NetPair, how: str) -> None:
    """Link cut right after the 1 MiB anchor landed, while a 24 MiB residual flows (~2 s at 100 Mbit/s).
    Expected: anchor ok, residual failed within timeout_s (+slack) of the cut; D idle; P freed within lease_s
    (+slack); service recovers after the link is restored."""
    p = fresh
    req = f"cr-{how}"
    p.src("stage", [(req, 1 * MB, 24 * MB, -2)], True)
    p.topo.shape(p.p_ns, p.p_dev, 100.0)  # the 24 MiB residual takes ~2 s: the cut lands inside it
    p.pull((req, 1 * MB, 24 * MB))
    first = p.events(1, 20)
    assert (first[0][2], first[0][3]) == ("anchor", True), first
    cut(p, how)
    t_cut = time.monotonic()
    evs = p.events(1, TIMEOUT_S + SLACK_S + 3)
    assert [(e[2], e[3]) for e in evs] == [("residual", False)], evs
    assert evs[0][0] - t_cut <= TIMEOUT_S + SLACK_S
    sink_idle(p, [req])
    p.wait_source_idle(LEASE_S + GRACE_S + SLACK_S)
    restore(p)
    recovers(p, f"{req}-after")


def test_prefill_killed_during_residual(fresh: NetPair) -> None:
    """P SIGKILLed while the residual flows. Expected: residual failed within timeout_s (+slack) of the kill
    (TCP RST or stall), D idle; a restarted P is served by the same sink."""
    p = fresh
    p.src("stage", [("pk", 1 * MB, 24 * MB, -3)], True)
    p.pull(("pk", 1 * MB, 24 * MB))
    first = p.events(1, 20)
    assert (first[0][2], first[0][3]) == ("anchor", True), first
    os.kill(p.src_proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    evs = p.events(1, TIMEOUT_S + SLACK_S + 3)
    assert [(e[2], e[3]) for e in evs] == [("residual", False)], evs
    assert evs[0][0] - t_kill <= TIMEOUT_S + SLACK_S
    sink_idle(p, ["pk"])
    p.src_proc.join(10)
    p.procs.remove(p.src_proc)
    p.start_source(src_cfg(p))
    recovers(p, "pk-after")


def test_decode_killed_during_residual(fresh: NetPair) -> None:
    """D SIGKILLed while the residual flows. Expected: P never hears "done", frees the staging by lease within
    lease_s (+slack) of the kill (counter freed_lease +1), and serves a restarted D."""
    p = fresh
    before = p.src("stats")["freed_lease"]
    p.src("stage", [("dk", 1 * MB, 24 * MB, -4)], True)
    p.pull(("dk", 1 * MB, 24 * MB))
    first = p.events(1, 20)
    assert (first[0][2], first[0][3]) == ("anchor", True), first
    os.kill(p.sink_proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    p.sink_proc.join(10)
    st = p.wait_source_idle(LEASE_S + GRACE_S + SLACK_S)
    assert time.monotonic() - t_kill <= LEASE_S + GRACE_S + SLACK_S + 1
    assert st["freed_lease"] == before + 1, st
    p.procs.remove(p.sink_proc)
    p.start_sink(sink_cfg())
    recovers(p, "dk-after")


def test_a_pull_that_outlasts_the_lease_is_kept_alive(fresh: NetPair) -> None:
    """A 24 MiB residual over 25 Mbit/s takes about 8 s, twice P's lease (issue 14.3: before KeepAlive, P freed
    and reused the regions under the READ). Expected: D's KeepAlives renew the lease; both streams ok and
    byte-exact; P frees on D's done, not by lease; both sides idle."""
    p = fresh
    before = p.src("stats")
    p.topo.shape(p.p_ns, p.p_dev, 25.0)
    sums = p.src("stage", [("ka", 1 * MB, 24 * MB, 7)], True)
    p.pull(("ka", 1 * MB, 24 * MB))
    evs = p.events(2, 40)
    assert [(e[2], e[3]) for e in evs] == [("anchor", True), ("residual", True)], evs
    assert evs[1][6] > 1.5 * LEASE_S, evs[1][6]  # the pull really outlasted the lease
    assert p.sink("crc", "ka") == tuple(sums["ka"])
    sink_idle(p, ["ka"])
    st = p.wait_source_idle(5)
    assert st["freed_lease"] == before["freed_lease"] and st["freed_done"] == before["freed_done"] + 1, st
    assert st["renewed"] >= before["renewed"] + 4, st


def test_packet_loss_is_survived(fresh: NetPair) -> None:
    """2% random loss on P's egress (no shaping). Expected: TCP retransmits; both streams ok and byte-exact
    within the timeout, the qdisc really dropped packets, both sides idle."""
    p = fresh
    p.topo.clear(p.p_ns, p.p_dev)
    p.topo.set_loss(p.p_ns, p.p_dev, 0.02)
    sums = p.src("stage", [("pl", 4 * MB, 8 * MB, 5)], True)
    p.pull(("pl", 4 * MB, 8 * MB))
    evs = p.events(2, 60)
    assert [(e[2], e[3]) for e in evs] == [("anchor", True), ("residual", True)], evs
    assert p.sink("crc", "pl") == tuple(sums["pl"])
    drops = sum(int(q.get("drops", 0)) for q in p.topo.qdisc_stats(p.p_ns, p.p_dev))
    assert drops > 0
    sink_idle(p, ["pl"])
    p.wait_source_idle(5)


def test_delay() -> None:
    """20 ms one-way delay (RTT 40 ms) on a TAP "wire" (the kernel here has no netem). Expected: both streams ok
    and byte-exact; time to anchor >= one READ round trip (40 ms) and well within timeout_s; both sides idle."""
    delay_ms = 20.0
    with net_pair(mtu=9000, delay_ms=delay_ms) as p:
        p.start_source(src_cfg(p))
        p.start_sink(sink_cfg())
        sums = p.src("stage", [("dl", 2 * MB, 2 * MB, 6)], True)
        p.pull(("dl", 2 * MB, 2 * MB))
        evs = p.events(2, 30)
        assert [(e[2], e[3]) for e in evs] == [("anchor", True), ("residual", True)], evs
        assert p.sink("crc", "dl") == tuple(sums["dl"])
        t_anchor = evs[0][6]
        print(f"delay {delay_ms} ms one way: time to anchor (2 MiB) {t_anchor:.3f}s, residual {evs[1][6]:.3f}s")
        assert 2 * delay_ms / 1e3 <= t_anchor < TIMEOUT_S, t_anchor
        sink_idle(p, ["dl"])
        p.wait_source_idle(5)
        assert p.topo.wires[0].frames > 2 * MB // 9000
