"""No reuse under a live pull (issue 14.3): D renews P's lease of what it pulls, P answers a transfer it no longer
holds as gone, a region freed by lease waits out a grace period, every staging has its own generation, and a
lease too short for the configured link and pool is a start-up error. Real zmq side channel, fake NIXL, D paced
so that one pull outlasts P's lease several times."""

from __future__ import annotations

import time

import pytest
import torch

from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.pool import StagingPool
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

from .fakes import TEST_KEY, FakeFabric, FakeNixlWrapper
from .test_transport_source_sink import COMPAT, collect, stage, wait_for

pytestmark = pytest.mark.timeout(60)

NBYTES = 1 << 20
P_LEASE_S = 0.6
D_GBPS = 0.004  # 0.5 MB/s: the 1 MiB anchor takes about 2 s, more than three of P's leases


def _pair(fabric: FakeFabric) -> tuple[TransferSource, TransferSink]:
    src = TransferSource(TransportConfig(pool_bytes=1 << 22, lease_s=P_LEASE_S, grace_s=0.5, key=TEST_KEY), COMPAT,
                         nixl=FakeNixlWrapper(fabric, "P"))
    # D's own lease_s is not what it renews by: P tells D its lease in HelloOk
    sink = TransferSink(TransportConfig(pool_bytes=1 << 22, chunk_bytes=64 << 10, link_gbps=D_GBPS, lease_s=30.0,
                                        timeout_s=5.0, retry_s=0.01, key=TEST_KEY), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    return src, sink


def test_keepalive_renews_the_lease_of_a_pull_that_outlasts_it(fabric: FakeFabric) -> None:
    src, sink = _pair(fabric)
    try:
        st = stage(src, "p1", NBYTES, 0)
        tid, tok = src.ticket("p1")
        loc = sink.pool.alloc_request("d1", NBYTES, 0)
        t0 = time.monotonic()
        sink.pull("d1", *src.address, tid, tok, loc.anchor, None)
        (ev,) = collect(sink, 1, timeout=15.0)
        took = time.monotonic() - t0
        assert ev.ok, ev.error
        assert took > 3 * P_LEASE_S, took  # the pull really outlasted P's lease
        assert torch.equal(loc.anchor, st.anchor) and ev.generation == st.generation
        s = src.stats()
        assert s["freed_lease"] == 0 and s["renewed"] >= 3 and sink.stats()["keepalives"] >= 3, (s, sink.stats())
        wait_for(lambda: src.stats()["freed_done"] == 1 and src.stats()["regions_live"] == 0)
    finally:
        sink.close()
        src.close()


def test_a_transfer_p_no_longer_holds_fails_the_pull_at_once(fabric: FakeFabric) -> None:
    """P freed the staging while D reads it (here: aborted on P; a lease run out is answered the same way): D's
    next KeepAlive is answered 'gone' and the pull fails within a quarter lease, not at the end of the READ."""
    src, sink = _pair(fabric)
    try:
        stage(src, "p1", NBYTES, 0)
        stage(src, "p2", NBYTES, 0)
        loc1, loc2 = sink.pool.alloc_request("d1", NBYTES, 0), sink.pool.alloc_request("d2", NBYTES, 0)
        sink.pull("d1", *src.address, *src.ticket("p1"), loc1.anchor, None)
        sink.pull("d2", *src.address, *src.ticket("p2"), loc2.anchor, None)
        wait_for(lambda: sink.stats()["chunks_posted"] > 0, timeout=5.0)
        assert src.abort("p1")
        t_abort = time.monotonic()
        evs = {}
        wait_for(lambda: evs.update({e.req_id: e for e in sink.poll()}) or "d1" in evs, timeout=5.0)
        assert time.monotonic() - t_abort < P_LEASE_S, "failed by the KeepAlive answer, not at the READ's end"
        assert not evs["d1"].ok and "no longer holds" in evs["d1"].error, evs["d1"]
        evs.update({e.req_id: e for e in collect(sink, 1, timeout=15.0)})
        assert evs["d2"].ok, evs["d2"].error  # the other pull of the same peer goes on
        assert sink.stats()["lease_lost"] == 1 and src.stats()["keepalive_gone"] >= 1
        wait_for(lambda: src.stats()["regions_live"] == 0 and sink.stats()["pulls_live"] == 0)
    finally:
        sink.close()
        src.close()


def test_every_staging_has_its_own_generation() -> None:
    pool = StagingPool(1 << 16)
    a = pool.alloc_request("a", 1000, 1000)
    pool.free_request("a")
    b = pool.alloc_request("b", 1000, 1000)  # the same regions again: a new tenancy
    assert b.anchor_offset == a.anchor_offset and b.generation > a.generation


@pytest.mark.parametrize("gbps, lease_s, ok", [(0.001, 60.0, False), (0.01, 60.0, True), (None, 0.5, True)])
def test_lease_must_cover_draining_a_full_pool(gbps: float | None, lease_s: float, ok: bool) -> None:
    # 16 MiB at 1 Mb/s takes 134 s (> 60 s); at 10 Mb/s 13 s
    kw = dict(pool_bytes=16 << 20, link_gbps=gbps, lease_s=lease_s)
    if ok:
        cfg = TransportConfig(**kw)
        assert cfg.lease_grace_s == max(cfg.timeout_s, cfg.pool_drain_s or 0.0)
    else:
        with pytest.raises(ValueError, match=r"lease_s \(60 s\) is shorter than the 134\.2 s a full staging pool"):
            TransportConfig(**kw)


def test_d_warns_of_a_p_lease_shorter_than_its_timeout(fabric: FakeFabric, caplog: pytest.LogCaptureFixture) -> None:
    """P's lease_s >= timeout_s is checked within one instance's config; D checks P's lease (HelloOk) against its
    own timeout_s, which a request may wait for D's staging without renewing the lease (sequential flow)."""
    src, sink = _pair(fabric)  # P's lease 0.6 s, D's timeout_s 5 s
    try:
        stage(src, "p1", 4096, 0)
        loc = sink.pool.alloc_request("d1", 4096, 0)
        sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
        (ev,) = collect(sink, 1, timeout=15.0)
        assert ev.ok, ev.error
        assert "leases staging for 0.6s, less than this D's timeout_s 5s" in caplog.text
    finally:
        sink.close()
        src.close()
