"""TransferSource + TransferSink in one process: real zmq side channel, fake NIXL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch
import zmq

from lynx_connector.transport import protocol as proto
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import TransferEvent
from lynx_connector.transport.pool import StagingFullError
from lynx_connector.transport.replies import AUTH_RETRIES
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

from .fakes import TEST_KEY, FakeFabric, FakeNixlWrapper

pytestmark = pytest.mark.timeout(60)

COMPAT = {"model": "smollm2", "layers": 30, "kv_heads": 3, "head_size": 64, "codec": "lynx", "codec_version": 1}


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def collect(sink: TransferSink, n: int, timeout: float = 5.0) -> list[TransferEvent]:
    evs: list[TransferEvent] = []
    wait_for(lambda: len(evs.extend(sink.poll()) or evs) >= n, timeout)
    return evs


@pytest.fixture
def pair(fabric: FakeFabric) -> Iterator[tuple[TransferSource, TransferSink]]:
    cfg = TransportConfig(pool_bytes=1 << 22, chunk_bytes=64 << 10, timeout_s=1.5, lease_s=30.0, retry_s=0.01,
                          key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"), record_posts=True)
    yield src, sink
    sink.close()
    src.close()


def stage(src: TransferSource, req: str, a: int, r: int, publish: bool = True):
    st = src.alloc(req, a, r)
    st.anchor.copy_(torch.randint(0, 256, (a,), dtype=torch.uint8))
    if r:
        st.residual.copy_(torch.randint(0, 256, (r,), dtype=torch.uint8))
    if publish:
        src.publish(req)
    return st


def test_pull_byte_exact_and_done_frees_p(pair) -> None:
    src, sink = pair
    st = stage(src, "p1", 100_000, 300_000)
    st2 = stage(src, "p2", 50_000, 0)
    loc = sink.pool.alloc_request("d1", 100_000, 300_000)
    loc2 = sink.pool.alloc_request("d2", 50_000, 0)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, loc.residual)
    sink.pull("d2", *src.address, *src.ticket("p2"), loc2.anchor, None)
    evs = collect(sink, 3)
    assert all(e.ok for e in evs) and {(e.req_id, e.stream) for e in evs} == {
        ("d1", "anchor"), ("d1", "residual"), ("d2", "anchor")}
    assert torch.equal(loc.anchor, st.anchor) and torch.equal(loc.residual, st.residual)
    assert torch.equal(loc2.anchor, st2.anchor)
    wait_for(lambda: src.stats()["regions_live"] == 0)
    assert sorted(src.poll()) == ["p1", "p2"] and src.stats()["bytes_allocated"] == 0
    sink.release("d1")  # idempotent after the automatic done
    assert sink.pool.regions_live == 3  # D's views are the caller's
    sink.pool.free_request("d1")
    sink.pool.free_request("d2")
    assert sink.pool.regions_live == 0 and sink.stats()["peers"] == 1


def test_not_ready_until_published(pair) -> None:
    src, sink = pair
    st = stage(src, "p1", 4096, 4096, publish=False)
    loc = sink.pool.alloc_request("d1", 4096, 4096)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, loc.residual)
    time.sleep(0.2)
    assert sink.poll() == []
    src.publish("p1")
    evs = collect(sink, 2)
    assert all(e.ok for e in evs) and torch.equal(loc.residual, st.residual)


def test_unpublished_times_out_and_size_mismatch(pair) -> None:
    src, sink = pair
    stage(src, "p1", 4096, 0, publish=False)
    stage(src, "p2", 4096, 8192)
    loc = sink.pool.alloc_request("d1", 4096, 0)
    loc2 = sink.pool.alloc_request("d2", 4096, 4096)
    t0 = time.monotonic()
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
    sink.pull("d2", *src.address, *src.ticket("p2"), loc2.anchor, loc2.residual)
    evs = collect(sink, 3)
    by = {(e.req_id, e.stream): e for e in evs}
    assert "size mismatch" in by[("d2", "anchor")].error and "8192" in by[("d2", "residual")].error
    assert not by[("d1", "anchor")].ok and "not ready" in by[("d1", "anchor")].error
    assert 1.4 < time.monotonic() - t0 < 3.0
    wait_for(lambda: src.stats()["freed_done"] == 2)  # the failed pulls told P to free: p2 at once, and p1,
    src.abort("p1")  # staged but never published (its writer is still at it), once its writer gives up
    assert src.stats()["regions_live"] == 0 and src.stats()["requests_live"] == 0


def test_incompatible_handshake_names_fields(pair, fabric: FakeFabric) -> None:
    src, _ = pair
    """v2: the peer learns only that it was refused (incompatible, named in its error); the differing fields go
    to P's log, never to the peer."""
    other = TransferSink(TransportConfig(pool_bytes=1 << 16, timeout_s=2.0, key=TEST_KEY),
                         {**COMPAT, "layers": 32, "codec": "int8"}, nixl=FakeNixlWrapper(fabric, "D2"))
    try:
        loc = other.pool.alloc_request("x", 4096, 0)
        other.pull("x", *src.address, "a" * 32, "b" * 32, loc.anchor, None)
        (ev,) = collect(other, 1)
        assert not ev.ok and "incompatible" in ev.error and other.stats()["peers"] == 0
        assert "layers" not in ev.error and "int8" not in ev.error
        # refused each time D tried again (a refusal may be a handshake P dropped under a flood of Hellos)
        assert src.stats()["auth_failed"] == 1 + AUTH_RETRIES and src.stats()["sessions"] == 0
    finally:
        other.close()


def _pull_once(src: TransferSource, fabric: FakeFabric, compat: dict, name: str) -> TransferEvent:
    """A D of ``compat`` pulls a staged 4 KiB anchor from ``src``; its one event."""
    other = TransferSink(TransportConfig(pool_bytes=1 << 16, timeout_s=2.0, key=TEST_KEY), compat,
                         nixl=FakeNixlWrapper(fabric, name))
    try:
        stage(src, name, 4096, 0)
        loc = other.pool.alloc_request("x", 4096, 0)
        other.pull("x", *src.address, *src.ticket(name), loc.anchor, None)
        (ev,) = collect(other, 1)
        return ev
    finally:
        other.close()


def test_later_compat_fields(fabric: FakeFabric, caplog: pytest.LogCaptureFixture) -> None:
    """The model identity fields (proto.LATER_COMPAT_FIELDS) are compared when D sends them; a D of an earlier
    release, which does not, still passes (P's HelloOk hash covers the fields it sent) and P says what it could not
    compare; a P of an earlier release (no such fields) refuses a D that sends them, as it refuses any unknown field."""
    ident = {"model_revision": "c0ffee", "rope": '{"rope_theta": 100000.0, "rope_type": "default"}'}
    assert set(ident) == set(proto.LATER_COMPAT_FIELDS)
    cfg = TransportConfig(pool_bytes=1 << 22, timeout_s=2.0, key=TEST_KEY)
    src = TransferSource(cfg, {**COMPAT, **ident}, nixl=FakeNixlWrapper(fabric, "P"))
    try:
        assert _pull_once(src, fabric, {**COMPAT, **ident}, "same").ok
        with caplog.at_level("WARNING"):
            assert _pull_once(src, fabric, dict(COMPAT), "earlier").ok
        assert "earlier release did not send model_revision, rope" in caplog.text
        for field, value in (("model_revision", "beef"), ("rope", '{"factor": 2.0, "rope_type": "linear"}')):
            ev = _pull_once(src, fabric, {**COMPAT, **ident, field: value}, f"other-{field}")
            assert not ev.ok and "incompatible" in ev.error
        assert src.stats()["auth_failed"] == 2 * (1 + AUTH_RETRIES)
    finally:
        src.close()
    earlier_p = TransferSource(cfg, dict(COMPAT), nixl=FakeNixlWrapper(fabric, "P0"))
    try:
        ev = _pull_once(earlier_p, fabric, {**COMPAT, **ident}, "newer-d")
        assert not ev.ok and "incompatible" in ev.error
    finally:
        earlier_p.close()


def test_malformed_messages_rejected_listener_keeps_serving(pair) -> None:
    """Outside a session every malformed, oversized or unexpected message gets the same Error("refused");
    a v1 Hello gets "unsupported_version"; the listener keeps serving."""
    src, sink = pair
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 3000)
    raw.connect("tcp://{}:{}".format(*src.address))
    v1_hello = b"\x83\xa4type\xa5hello\xa1v\x01\xa6compat\x80"
    try:
        for junk in [b"\xc1", b"not msgpack at all", b"x" * (3 << 15),
                     proto.encode(proto.Query(v=proto.VERSION, transfer_id="a" * 32, token="b" * 32)),
                     proto.encode(proto.Regions(v=proto.VERSION, transfer_id="a" * 32, anchor_offset=0, anchor_nbytes=1,
                                                residual_offset=-1, residual_nbytes=0, generation=1))]:
            raw.send(junk)
            reply = proto.decode(raw.recv(), 1 << 20)
            assert isinstance(reply, proto.Error) and (reply.code, reply.message) == ("refused", "refused")
        raw.send_multipart([b"a", b"b"])
        assert proto.decode(raw.recv(), 1 << 20).code == "refused"
        raw.send(v1_hello)
        assert proto.decode(raw.recv(), 1 << 20).code == "unsupported_version"
    finally:
        raw.close()
    assert src.stats()["malformed"] >= 3 and src.stats()["refused"] >= 2 and src.stats()["other_version"] == 1
    st = stage(src, "p1", 4096, 0)
    loc = sink.pool.alloc_request("d1", 4096, 0)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
    (ev,) = collect(sink, 1)
    assert ev.ok and torch.equal(loc.anchor, st.anchor)


def test_lease_expiry_abort_and_pool_full(fabric: FakeFabric) -> None:
    """A lease that runs out frees the request, but its regions stay out of use for the grace period (a D may
    still be reading them): nothing allocated meanwhile lands on them."""
    cfg = TransportConfig(pool_bytes=1 << 16, lease_s=0.3, grace_s=1.0, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    try:
        leased = stage(src, "leased", 1000, 1000)
        stage(src, "kept", 1000, 0, publish=False)  # unpublished: no lease running
        with pytest.raises(StagingFullError):
            src.alloc("big", 1 << 16, 0)
        wait_for(lambda: src.stats()["requests_live"] == 1, timeout=3.0)
        t_freed = time.monotonic()
        assert src.poll() == ["leased"] and src.stats()["freed_lease"] == 1
        assert src.stats()["bytes_quarantined"] == 2048 and src.stats()["regions_live"] == 3
        held = [src.alloc(f"n{i}", 1000, 0) for i in range(61)]  # every free region, none of the quarantined
        assert {h.anchor_offset for h in held}.isdisjoint({leased.anchor_offset, leased.residual_offset})
        with pytest.raises(StagingFullError):
            src.alloc("n-more", 1000, 0)
        wait_for(lambda: src.stats()["bytes_quarantined"] == 0, timeout=3.0)
        assert time.monotonic() - t_freed >= 0.9
        assert src.alloc("after-grace", 1000, 0).anchor_offset in (leased.anchor_offset, leased.residual_offset)
        assert src.abort("kept") and not src.abort("kept")
        for i in range(61):
            src.abort(f"n{i}")
        src.abort("after-grace")
        assert src.stats()["regions_live"] == 0 and "kept" in src.poll()
    finally:
        src.close()


def pull_from_a_bare_router(fabric: FakeFabric, timeout_s: float) -> tuple[zmq.Socket, TransferSink, float]:
    """A zmq ROUTER on 127.0.0.1 standing in for P (it answers only what the test sends), and a sink that has
    started one pull ("d") from it; returns them and the pull's start time."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sink = TransferSink(TransportConfig(pool_bytes=1 << 16, timeout_s=timeout_s, key=TEST_KEY), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    loc = sink.pool.alloc_request("d", 4096, 4096)
    t0 = time.monotonic()
    sink.pull("d", "127.0.0.1", port, "a" * 32, "b" * 32, loc.anchor, loc.residual)
    return router, sink, t0


def test_silent_peer_fails_within_timeout(fabric: FakeFabric) -> None:
    silent, sink, t0 = pull_from_a_bare_router(fabric, 0.5)
    try:
        evs = collect(sink, 2, timeout=3.0)
        assert time.monotonic() - t0 < 1.5
        assert [e.stream for e in evs] == ["anchor", "residual"] and all("did not serve" in e.error for e in evs)
        assert sink.stats()["peers"] == 0 and sink.stats()["pulls_live"] == 0
    finally:
        sink.close()
        silent.close()


def test_a_p_of_another_protocol_version_fails_the_pull_at_once(fabric: FakeFabric) -> None:
    """A rolling upgrade across a protocol change: P answers D's Hello with its Error in its own version (as every
    release does). D fails the pull at once, naming both versions, counts it, owes that P no Done and sends no
    more Hellos; before, it dropped the answer as malformed and re-sent Hellos until timeout_s."""
    other = proto.VERSION - 1
    old_p, sink, t0 = pull_from_a_bare_router(fabric, 5.0)
    try:
        assert old_p.poll(3000)
        ident, hello = old_p.recv_multipart()
        assert isinstance(proto.decode(hello, 1 << 16), proto.Hello)
        old_p.send_multipart([ident, proto.encode(proto.Error(v=other, code="unsupported_version",
                                                              message=f"this prefill instance speaks protocol {other}"))])
        evs = collect(sink, 2, timeout=3.0)
        assert time.monotonic() - t0 < 2.0  # not timeout_s
        assert [e.stream for e in evs] == ["anchor", "residual"] and not any(e.ok for e in evs)
        assert all(f"protocol {other}, this decode instance {proto.VERSION}" in e.error for e in evs), evs[0].error
        st = sink.stats()
        assert st["other_version"] == 1 and st["peers"] == 0 and st["pulls_live"] == 0
        assert st["dones_owed"] == 0  # that P cannot read our Done: its lease frees what it staged
        assert not old_p.poll(300)  # no Hello re-sent
    finally:
        sink.close()
        old_p.close()


def test_p_counts_a_hello_of_another_version_apart_from_malformed_frames(pair) -> None:
    """P answers a Hello of another protocol version with unsupported_version and counts other_version (a D of
    another release during an upgrade), not malformed (which the operators' attack alert watches)."""
    src, _ = pair
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{src.address[1]}")
    try:
        d.send(proto.encode(proto.Hello(v=proto.VERSION + 1, nonce_d=b"n" * 16, compat_hash="0" * 64)))
        assert d.poll(3000)
        err = proto.decode(d.recv(), 1 << 16)
        assert isinstance(err, proto.Error) and err.code == "unsupported_version"
        wait_for(lambda: src.stats()["other_version"] == 1)
        assert src.stats()["malformed"] == 0
        # anything else that merely carries another "v" is no Hello: malformed, which the security alert watches
        d.send(msgspec.msgpack.encode({"v": 99, "type": "anything"}))
        assert d.poll(3000)
        assert proto.decode(d.recv(), 1 << 16).code == "unsupported_version"
        wait_for(lambda: src.stats()["malformed"] == 1)
        assert src.stats()["other_version"] == 1
    finally:
        d.close()


def hung_pull(src: TransferSource, sink: TransferSink, p_req: str, d_req: str) -> FakeNixlWrapper:
    """A pull whose NIXL reads never complete (D's fake NIXL hangs), once they are in flight."""
    dnixl: FakeNixlWrapper = sink._nixl  # type: ignore[assignment]
    dnixl.hang = True
    stage(src, p_req, 8192, 0)
    loc = sink.pool.alloc_request(d_req, 8192, 0)
    sink.pull(d_req, *src.address, *src.ticket(p_req), loc.anchor, None)
    wait_for(lambda: dnixl.live_handles > 0)
    return dnixl


def test_nixl_failure_mid_transfer_and_abort(pair) -> None:
    src, sink = pair
    dnixl: FakeNixlWrapper = sink._nixl  # type: ignore[assignment]
    stage(src, "p1", 8192, 65536)
    loc = sink.pool.alloc_request("d1", 8192, 65536)
    dnixl.fail_peers.add("P")
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, loc.residual)
    evs = collect(sink, 2)
    assert not any(e.ok for e in evs) and "ERR" in evs[0].error
    assert sink.stats()["peers"] == 0  # dropped: the next pull re-handshakes
    dnixl.fail_peers.clear()
    hung_pull(src, sink, "p2", "d2")
    sink.abort("d2")
    assert dnixl.live_handles == 0 and sink.stats()["pulls_live"] == 0
    wait_for(lambda: src.stats()["regions_live"] == 0)
    time.sleep(0.1)
    assert sink.poll() == []
    with pytest.raises(ValueError, match="inside"):
        sink.pull("d3", *src.address, "c" * 32, "d" * 32, torch.zeros(8, dtype=torch.uint8), None)


def test_release_of_a_pull_in_flight_drops_it_like_abort(pair) -> None:
    """``release`` while reads are in flight: they are cancelled (no handle left, no later event), and D's staging
    is quarantined, not reusable at once, since NIXL's release does not wait for a read already posted."""
    src, sink = pair
    dnixl = hung_pull(src, sink, "p1", "d1")
    sink.release("d1")
    wait_for(lambda: sink.stats()["pulls_live"] == 0)
    assert dnixl.live_handles == 0
    wait_for(lambda: src.stats()["regions_live"] == 0)
    sink.free_staging("d1")
    assert sink.pool.regions_live > 0  # quarantined for lease_grace_s
    time.sleep(0.1)
    assert sink.poll() == []


def test_anchor_only_pull_leaves_the_residual_unread(pair) -> None:
    """Decoding on the anchor alone: D passes no residual view and P's residual is never read (but freed)."""
    src, sink = pair
    st = stage(src, "p1", 4096, 8192)
    loc = sink.pool.alloc_request("d1", 4096, 0)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
    (ev,) = collect(sink, 1)
    assert ev.ok and ev.stream == "anchor" and torch.equal(loc.anchor, st.anchor)
    time.sleep(0.2)
    assert sink.poll() == []  # no residual event
    wait_for(lambda: src.stats()["regions_live"] == 0)  # done sent after the anchor: P freed both regions


@pytest.mark.parametrize("host", ["a b", "*", "", ".", "-", "_", "_a", "a..b", "tcp://h", "h:1", "[zz]", "x" * 254])
def test_a_peer_address_zmq_cannot_connect_to_is_refused_at_once(pair, host) -> None:
    """Such a host raised inside the sink's service thread (sockets left open and registered at every resend of
    the Done owed to it) and the pull failed only at its deadline, as an unanswered peer: now pull and discard
    refuse it at once, naming it, and nothing is owed."""
    src, sink = pair
    loc = sink.pool.alloc_request("d1", 4096, 0)
    with pytest.raises(ValueError, match="bad peer address"):
        sink.pull("d1", host, 5555, "a" * 32, "b" * 32, loc.anchor, None)
    with pytest.raises(ValueError, match="bad peer address"):
        sink.discard(host, 5555, "a" * 32, "b" * 32)
    assert sink.stats()["dones_owed"] == 0 and sink.stats()["pulls_live"] == 0


def test_peer_addresses_d_accepts() -> None:
    from lynx_connector.transport.link import check_peer_addr

    for host in ("127.0.0.1", "localhost", "p-0.prefill.svc", "prefill-0.lynx.default.svc.cluster.local", "[::1]",
                 "[fd00::1:2]", "[fe80::1%eth0]", "lynx_prefill_1", "a" * 63 + "." + "b" * 63):
        check_peer_addr(host, 5555)
    for host, port in (("127.0.0.1", 0), ("127.0.0.1", 65536), ("127.0.0.1", True), ("127.0.0.1", "80"),
                       (b"127.0.0.1", 80), ("a" * 64, 80)):
        with pytest.raises(ValueError, match="bad peer address"):
            check_peer_addr(host, port)


def test_a_connect_that_zmq_still_refuses_fails_that_pull_only(pair, monkeypatch) -> None:
    """Should zmq refuse an address the check let through, the pull fails at once naming the peer, nothing stays
    open or registered, no Done is owed, and the sink goes on serving (and closes)."""
    from lynx_connector.transport import link

    src, sink = pair
    monkeypatch.setattr(link, "check_peer_addr", lambda host, port: None)
    loc = sink.pool.alloc_request("d1", 4096, 0)
    sink.pull("d1", ".", 5555, "a" * 32, "b" * 32, loc.anchor, None)
    (ev,) = collect(sink, 1)
    assert not ev.ok and "cannot connect to peer .:5555" in ev.error
    sink.discard(".", 5555, "c" * 32, "d" * 32)
    time.sleep(0.1)
    assert sink.stats()["dones_owed"] == 0 and sink.stats()["peers"] == 0
    assert len(sink._poller.sockets) == 1  # the waker only
    st = stage(src, "p2", 4096, 0)
    loc2 = sink.pool.alloc_request("d2", 4096, 0)
    sink.pull("d2", *src.address, *src.ticket("p2"), loc2.anchor, None)
    (ev,) = collect(sink, 1)
    assert ev.ok and torch.equal(loc2.anchor, st.anchor)
    ctx, poller = zmq.Context.instance(), zmq.Poller()
    with pytest.raises(zmq.ZMQError):
        link.PeerLink(ctx, poller, (".", 5555), 1 << 16, TEST_KEY)
    assert poller.sockets == []


def _blocking_step(sink: TransferSink) -> tuple[threading.Event, threading.Event]:
    """The sink's next scheduler step blocks (a NIXL call that hangs) until ``release`` is set: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real_step = sink._sched.step

    def blocking_step():  # noqa: ANN202
        if not entered.is_set():
            entered.set()
            release.wait(30.0)
        return real_step()

    sink._sched.step = blocking_step
    return entered, release


def test_close_leaves_a_stuck_service_thread_its_sockets(fabric: FakeFabric, caplog: pytest.LogCaptureFixture) -> None:
    """A sink whose service thread does not stop (here one scheduler step blocks, standing in for a NIXL call
    that hangs) is not torn down under it: close() warns and returns; its sockets, NIXL agent and zmq context
    are closed once the thread stops (zmq sockets are not thread-safe: before, they were closed under the live
    thread; a context left open instead hangs whoever garbage-collects it, in term())."""
    nixl = FakeNixlWrapper(fabric, "D")
    sink = TransferSink(TransportConfig(pool_bytes=1 << 20, key=TEST_KEY), COMPAT, nixl=nixl)
    entered, release = _blocking_step(sink)

    sink._waker.wake()
    assert entered.wait(5.0)
    try:
        sink.close()
        assert sink._thread.is_alive() and not nixl.closed
        assert "did not stop within 5 s" in caplog.text
    finally:
        release.set()
    wait_for(lambda: nixl.closed and sink._ctx.closed)
    assert not sink._thread.is_alive()


def test_an_abort_the_stuck_service_thread_never_acknowledged_quarantines_the_staging(
        fabric: FakeFabric, caplog: pytest.LogCaptureFixture) -> None:
    """``abort`` gives up waiting for a service thread that does not answer (a NIXL call that hangs): it cannot
    know whether the request's reads were still in flight, so ``free_staging`` keeps its regions out of reuse for
    ``lease_grace_s`` as for a torn pull (before: they went back to the free list at once, where a late read could
    land in the next request's staging)."""
    nixl = FakeNixlWrapper(fabric, "D")
    sink = TransferSink(TransportConfig(pool_bytes=1 << 20, key=TEST_KEY, timeout_s=0.2), COMPAT, nixl=nixl)
    entered, release = _blocking_step(sink)
    try:
        sink.pool.alloc_request("d1", 4096, 0)
        sink.pool.alloc_request("d2", 4096, 0)
        sink._waker.wake()
        assert entered.wait(5.0)
        sink.abort("d1")
        assert "abort(d1) not acknowledged" in caplog.text
        sink.free_staging("d1")
        assert sink.pool.quarantined_bytes > 0
        sink.free_staging("d2")  # never aborted: nothing in flight, reusable at once
        held = sink.pool.quarantined_bytes
        sink.free_staging("d1")  # once: a second free changes nothing
        assert sink.pool.quarantined_bytes == held
    finally:
        release.set()
        sink.close()
