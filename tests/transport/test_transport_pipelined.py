"""Pipelined transfer at the transport level (docs/PROTOCOL.md section 6), real zmq side channel, fake NIXL:
P publishes a request's regions in part (layer-wise), D reads only what is ready and asks again for the rest;
a concurrent-flow pull (``wait_s``) waits for a request P does not know yet; a P that stops publishing
mid-request fails the pull at D's deadline and both sides free everything."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

from .fakes import TEST_KEY, FakeFabric, FakeNixlWrapper
from .test_transport_source_sink import COMPAT, collect, wait_for

pytestmark = pytest.mark.timeout(60)

A, R = 120_000, 240_000
LAYERS = 6


@pytest.fixture
def pair(fabric: FakeFabric):
    cfg = TransportConfig(pool_bytes=1 << 22, chunk_bytes=16 << 10, timeout_s=1.5, lease_s=30.0, retry_s=0.005,
                          pipeline_poll_s=0.005, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"), record_posts=True)
    yield src, sink
    sink.close()
    src.close()


def _layer(n: int, i: int) -> slice:
    return slice(n * i // LAYERS, n * (i + 1) // LAYERS)


def _publish_layers(src, st, want_a, want_r, layers) -> None:
    """P encodes ``layers`` of request "p" one by one (the planes' bytes from ``want_*``), publishing each; the
    last layer of the request publishes it whole."""
    for i in layers:
        st.anchor[_layer(A, i)] = want_a[_layer(A, i)]
        st.residual[_layer(R, i)] = want_r[_layer(R, i)]
        if i < LAYERS - 1:
            src.publish_partial("p", _layer(A, i).stop, _layer(R, i).stop)
        else:
            src.publish("p")
        time.sleep(0.02)


def test_layers_are_read_as_they_are_published(pair) -> None:
    src, sink = pair
    st = src.alloc("p", A, R)
    want_a = torch.randint(0, 256, (A,), dtype=torch.uint8)
    want_r = torch.randint(0, 256, (R,), dtype=torch.uint8)
    loc = sink.pool.alloc_request("d", A, R)
    for i in range(2):  # two layers encoded before D asks
        st.anchor[_layer(A, i)] = want_a[_layer(A, i)]
        st.residual[_layer(R, i)] = want_r[_layer(R, i)]
    src.publish_partial("p", _layer(A, 1).stop, _layer(R, 1).stop)
    sink.pull("d", *src.address, *src.ticket("p"), loc.anchor, loc.residual)
    wait_for(lambda: any(off + n > 0 for _, _, off, n in sink.post_log))
    time.sleep(0.1)
    # only the published prefix was read: nothing beyond layer 2 of either plane
    assert max(off + n for _, s, off, n in sink.post_log if s == "anchor") <= _layer(A, 1).stop
    assert max((off + n for _, s, off, n in sink.post_log if s == "residual"), default=0) <= _layer(R, 1).stop
    assert sink.poll() == []  # no stream complete yet
    _publish_layers(src, st, want_a, want_r, range(2, LAYERS))
    evs = collect(sink, 2)
    assert all(e.ok for e in evs), evs
    assert torch.equal(loc.anchor, want_a) and torch.equal(loc.residual, want_r)
    wait_for(lambda: src.stats()["requests_live"] == 0)  # D's done freed P
    sink.pool.free_request("d")
    wait_for(lambda: src.stats()["mac_s"] > 0 and sink.stats()["mac_s"] > 0)  # the MACs' cost, both service threads


def test_concurrent_flow_waits_for_a_request_p_does_not_know_yet(pair) -> None:
    src, sink = pair
    tid, token = "ab" * 16, "cd" * 16  # minted by the proxy, given to D before P has the request
    loc = sink.pool.alloc_request("d", A, 0)
    sink.pull("d", *src.address, tid, token, loc.anchor, None, wait_s=5.0)
    time.sleep(2.5)  # longer than unknown_grace_s (2 s) and timeout_s: a sequential pull would have failed
    assert sink.poll() == []
    st = src.alloc("p", A, 0, transfer_id=tid, token=token)
    st.anchor.copy_(torch.arange(A, dtype=torch.int64).to(torch.uint8))
    src.publish("p")
    evs = collect(sink, 1)
    assert evs[0].ok and torch.equal(loc.anchor, st.anchor)
    sink.pool.free_request("d")


def test_concurrent_flow_gives_up_at_its_deadline(pair) -> None:
    src, sink = pair
    loc = sink.pool.alloc_request("d", A, 0)
    t0 = time.monotonic()
    sink.pull("d", *src.address, "ef" * 16, "01" * 16, loc.anchor, None, wait_s=1.0)
    evs = collect(sink, 1, timeout=5.0)
    assert not evs[0].ok and "did not serve" in evs[0].error and time.monotonic() - t0 >= 0.9
    wait_for(lambda: sink.stats()["pulls_live"] == 0)
    sink.pool.free_request("d")


def test_p_that_stops_publishing_fails_the_pull_and_frees_both_sides(pair) -> None:
    src, sink = pair
    src.alloc("p", A, R)
    src.publish_partial("p", _layer(A, 0).stop, _layer(R, 0).stop)
    loc = sink.pool.alloc_request("d", A, R)
    sink.pull("d", *src.address, *src.ticket("p"), loc.anchor, loc.residual)
    evs = collect(sink, 2, timeout=6.0)  # P never publishes more: D gives up after timeout_s without progress
    assert not any(e.ok for e in evs) and "published no more" in evs[0].error
    # D's done reached P while P (as far as it knows) still writes the request: its regions are not reused
    # under the writer, and freed when the writer stops
    wait_for(lambda: src.stats()["freed_done"] == 1)
    assert src.stats()["requests_live"] == 1 and src.stats()["bytes_allocated"] > 0
    assert src.publish_partial("p", A, R) is False  # the writer hears it was given up
    assert src.publish("p") is False
    assert src.stats()["requests_live"] == 0
    sink.pool.free_request("d")
    assert sink.stats()["pulls_live"] == 0


def test_done_tells_p_the_link_time_of_a_pipelined_read_without_p_forward(fabric: FakeFabric) -> None:
    """P's link meter (auto) takes each transfer's link time from D's Done (``link_s``, protocol v4): the time
    D's reads were in flight, not the time D waited for P's layers. Emulated link: 360 KB at 28.8 Mbit/s = 0.1 s,
    against P's 0.5 s forward of its last layer. A transfer D does not read whole is not measured."""
    rate = (A + R) / 0.1
    cfg = TransportConfig(pool_bytes=1 << 22, chunk_bytes=16 << 10, timeout_s=1.5, lease_s=30.0, retry_s=0.005,
                          pipeline_poll_s=0.005, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(dataclasses.replace(cfg, link_gbps=rate * 8 / 1e9), COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        st = src.alloc("p", A, R)
        want_a = torch.randint(0, 256, (A,), dtype=torch.uint8)
        want_r = torch.randint(0, 256, (R,), dtype=torch.uint8)
        loc = sink.pool.alloc_request("d", A, R)
        _publish_layers(src, st, want_a, want_r, range(LAYERS - 1))
        t0 = time.monotonic()
        sink.pull("d", *src.address, *src.ticket("p"), loc.anchor, loc.residual)
        wait_for(lambda: sink.stats()["bytes_done"] >= _layer(A, LAYERS - 2).stop + _layer(R, LAYERS - 2).stop)
        time.sleep(0.5)  # P's forward of the last layer: D has read everything readable and waits
        _publish_layers(src, st, want_a, want_r, [LAYERS - 1])
        assert all(e.ok for e in collect(sink, 2))
        wait_for(lambda: src.stats()["requests_live"] == 0)
        ((end, link_s, nbytes),) = src.take_pulled()
        assert nbytes == A + R and end - t0 > 0.5
        assert 0.1 * 0.9 < link_s < 0.2, link_s  # the bytes at the link's rate; the 0.5 s wait left out
        sink.pool.free_request("d")
        src.alloc("q", 4 * A, 4 * R)  # D gives up on this one while reading it (0.4 s): Done without a measure
        src.publish("q")
        loc = sink.pool.alloc_request("e", 4 * A, 4 * R)
        sink.pull("e", *src.address, *src.ticket("q"), loc.anchor, loc.residual)
        wait_for(lambda: sink.stats()["bytes_done"] > A + R)
        sink.abort("e")
        wait_for(lambda: src.stats()["requests_live"] == 0)
        assert src.take_pulled() == []
        sink.pool.free_request("e")
        src.alloc("s", A, R)  # D reads the anchor only: P counts the bytes D read, not the bytes it staged
        src.publish("s")
        loc = sink.pool.alloc_request("f", A, 0)
        sink.pull("f", *src.address, *src.ticket("s"), loc.anchor, None)
        assert all(e.ok for e in collect(sink, 1))
        wait_for(lambda: src.stats()["requests_live"] == 0)
        ((_, link_s, nbytes),) = src.take_pulled()
        assert nbytes == A and A / rate * 0.9 < link_s < A / rate * 2, link_s
        sink.pool.free_request("f")
    finally:
        sink.close()
        src.close()


def test_partial_publish_is_bounded_by_the_regions(pair) -> None:
    src, _ = pair
    src.alloc("p", A, R)
    with pytest.raises(ValueError, match="outside the regions"):
        src.publish_partial("p", A + 1, 0)
    with pytest.raises(KeyError):
        src.publish_partial("nope", 0, 0)


def test_watched_pull_takes_d_staging_only_once_p_has_staged_it(pair) -> None:
    """Concurrent flow: D watches a request P does not have yet; it is reported staged once P answers its regions,
    and nothing is read before D attaches its own staging."""
    src, sink = pair
    tid, token = "ab" * 16, "cd" * 16
    sink.watch("d", *src.address, tid, token, A, R, wait_s=5.0)
    time.sleep(0.2)
    assert sink.staged() == [] and sink.poll() == []
    st = src.alloc("p", A, R, transfer_id=tid, token=token)
    want_a = torch.randint(0, 256, (A,), dtype=torch.uint8)
    want_r = torch.randint(0, 256, (R,), dtype=torch.uint8)
    st.anchor[_layer(A, 0)] = want_a[_layer(A, 0)]
    st.residual[_layer(R, 0)] = want_r[_layer(R, 0)]
    src.publish_partial("p", _layer(A, 0).stop, _layer(R, 0).stop)
    wait_for(lambda: "d" in {s.req_id for s in sink._staged})
    assert [s.req_id for s in sink.staged()] == ["d"] and sink.staged() == []  # reported once
    time.sleep(0.1)
    assert sink.post_log == [] and sink.poll() == []  # no staging of D's: nothing read yet
    loc = sink.pool.alloc_request("d", A, R)
    sink.attach("d", loc.anchor, loc.residual)
    _publish_layers(src, st, want_a, want_r, range(1, LAYERS))
    evs = collect(sink, 2)
    assert all(e.ok for e in evs), evs
    assert torch.equal(loc.anchor, want_a) and torch.equal(loc.residual, want_r)
    wait_for(lambda: src.stats()["requests_live"] == 0)
    sink.pool.free_request("d")
    assert sink.stats()["pulls_live"] == 0


def test_staged_pull_keeps_p_lease_until_attached(fabric: FakeFabric) -> None:
    cfg = TransportConfig(pool_bytes=1 << 22, chunk_bytes=16 << 10, timeout_s=3.0, lease_s=0.6, retry_s=0.005,
                          pipeline_poll_s=0.005, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        st = src.alloc("p", A, 0)
        st.anchor.fill_(7)
        src.publish("p")
        sink.watch("d", *src.address, *src.ticket("p"), A, 0)
        wait_for(lambda: "d" in {s.req_id for s in sink._staged})
        time.sleep(1.5)  # 2.5 leases: without KeepAlives P would have freed it
        assert src.stats()["requests_live"] == 1
        loc = sink.pool.alloc_request("d", A, 0)
        sink.attach("d", loc.anchor, None)
        evs = collect(sink, 1)
        assert evs[0].ok and int(loc.anchor.min()) == 7 == int(loc.anchor.max())
        wait_for(lambda: src.stats()["requests_live"] == 0)
        sink.pool.free_request("d")
    finally:
        sink.close()
        src.close()


def test_staged_pull_never_attached_fails_and_frees_p(pair) -> None:
    src, sink = pair  # timeout_s 1.5: a staged pull waits 2 x timeout_s for D's staging
    src.alloc("p", A, R)
    src.publish("p")
    sink.watch("d", *src.address, *src.ticket("p"), A, R)
    evs = collect(sink, 2, timeout=6.0)
    assert not any(e.ok for e in evs) and "never given D's staging" in evs[0].error
    assert [s.req_id for s in sink.staged()] == ["d"]
    wait_for(lambda: src.stats()["requests_live"] == 0)
    assert sink.stats()["pulls_live"] == 0 and sink.pool.regions_live == 0


def _watch_until_staged(src, sink) -> None:
    """P stages and publishes request "p" whole; D watches it as "d" until the sink reports it staged."""
    src.alloc("p", A, R)
    src.publish("p")
    sink.watch("d", *src.address, *src.ticket("p"), A, R)
    wait_for(lambda: "d" in {s.req_id for s in sink._staged})


def test_attach_with_other_sizes_fails_the_pull(pair) -> None:
    src, sink = pair
    _watch_until_staged(src, sink)
    loc = sink.pool.alloc_request("d", A, 0)
    sink.attach("d", loc.anchor, None)
    evs = collect(sink, 2)
    assert not any(e.ok for e in evs) and "attach" in evs[0].error
    wait_for(lambda: src.stats()["requests_live"] == 0)
    sink.pool.free_request("d")


def test_aborting_a_staged_pull_frees_p(pair) -> None:
    src, sink = pair
    _watch_until_staged(src, sink)
    sink.abort("d")
    wait_for(lambda: src.stats()["requests_live"] == 0)
    assert sink.poll() == [] and sink.stats()["pulls_live"] == 0


@pytest.mark.parametrize("p_mode, sizes", [("bf16", (A, 0)), ("speculative", (A // 4, R))])
def test_watched_pull_takes_the_sizes_of_the_mode_p_names(pair, p_mode, sizes) -> None:
    """Auto in the concurrent flow: D watches without knowing the mode; P's Regions name the mode auto chose (and
    why), which picks D's sizes from its layouts; the transfer then reads exactly that mode's planes."""
    src, sink = pair
    layouts = {"bf16": (A, 0), "full": (A // 4, R), "speculative": (A // 4, R)}
    st = src.alloc("p", *sizes, mode=p_mode, auto_reason="slow_link")
    want_a = torch.randint(0, 256, (sizes[0],), dtype=torch.uint8)
    want_r = torch.randint(0, 256, (sizes[1],), dtype=torch.uint8)
    st.anchor.copy_(want_a)
    if sizes[1]:
        st.residual.copy_(want_r)
    src.publish("p")
    sink.watch("d", *src.address, *src.ticket("p"), 1, 0, layouts=layouts)
    wait_for(lambda: bool(sink._staged))
    assert sink.staged() == [("d", p_mode, "slow_link")]
    loc = sink.pool.alloc_request("d", *sizes)
    sink.attach("d", loc.anchor, loc.residual if sizes[1] else None, order="whole")
    evs = collect(sink, 2 if sizes[1] else 1)
    assert all(e.ok for e in evs), evs
    assert torch.equal(loc.anchor, want_a) and (not sizes[1] or torch.equal(loc.residual, want_r))
    wait_for(lambda: src.stats()["requests_live"] == 0)
    sink.pool.free_request("d")
    assert sink.stats()["pulls_live"] == 0


def test_watched_pull_fails_when_p_names_a_mode_it_does_not_accept(pair) -> None:
    """P staged it under a mode D did not offer (e.g. a lossy one D's allowed_modes refuse): the pull fails with
    the mode named, nothing is read, and P's staging is freed."""
    src, sink = pair
    src.alloc("p", A, 0, mode="int4")
    src.publish("p")
    sink.watch("d", *src.address, *src.ticket("p"), 1, 0, layouts={"bf16": (A, 0), "full": (A // 4, R)})
    evs = collect(sink, 1)
    assert not evs[0].ok and "as mode 'int4', not one of the modes this pull accepts (bf16, full)" in evs[0].error
    assert sink.staged() == [] and sink.post_log == []
    wait_for(lambda: src.stats()["requests_live"] == 0)
    assert sink.stats()["pulls_live"] == 0 and sink.pool.regions_live == 0


def test_a_source_refuses_a_mode_name_that_regions_could_not_carry(pair) -> None:
    src, _ = pair
    for bad in ("Full", "x" * 33, "a b"):
        with pytest.raises(ValueError, match="at most 32 characters"):
            src.alloc("p", A, 0, mode=bad)
    assert src.stats()["requests_live"] == 0


def test_p_whose_encode_fails_after_d_gave_up_frees_its_staging(pair) -> None:
    """D's Done comes while P still encodes (the staging is kept for the writer), then P's encode fails and it
    rejects the request instead of publishing it: the staging must be freed then, not held for good."""
    src, sink = pair
    src.alloc("p", A, R)
    src.publish_partial("p", _layer(A, 0).stop, _layer(R, 0).stop)
    loc = sink.pool.alloc_request("d", A, R)
    sink.pull("d", *src.address, *src.ticket("p"), loc.anchor, loc.residual)
    collect(sink, 2, timeout=6.0)
    wait_for(lambda: src.stats()["freed_done"] == 1)
    assert src.stats()["requests_live"] == 1 and src.stats()["bytes_allocated"] > 0  # kept for the writer
    src.reject("p", "encode", "the encoder failed")  # what the worker does when an encode raises
    assert src.stats()["requests_live"] == 0 and src.stats()["bytes_allocated"] == 0
    assert src.stats()["regions_live"] == 0
    sink.pool.free_request("d")

def test_concurrent_flow_fails_early_when_p_answers_nothing(fabric: FakeFabric) -> None:
    """A P whose port refuses connections (a closed port on 127.0.0.1: no P process there) fails a concurrent-flow
    pull at once, naming it, not after its long wait for P to get the request (nor after timeout_s, as before)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody answers there
    cfg = TransportConfig(pool_bytes=1 << 22, timeout_s=5.0, retry_s=0.005, pipeline_poll_s=0.005, key=TEST_KEY)
    sink = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        t0 = time.monotonic()
        sink.watch("d", "127.0.0.1", port, "ab" * 16, "cd" * 16, A, 0, wait_s=30.0)
        evs = collect(sink, 1, timeout=10.0)
        assert not evs[0].ok and "refuses connections" in evs[0].error and time.monotonic() - t0 < 3.0, evs
        assert sink.stats()["peer_gone"] == 1 and sink.stats()["dones_owed"] == 0
    finally:
        sink.close()
