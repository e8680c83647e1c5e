"""Side-channel recovery (issue 13): lost messages, a silent request, a paused or restarted P, a full pool.

TransferSource + TransferSink in one process, real zmq side channel, fake NIXL. Losses are made by wrapping the
source's reply path; a "paused" P is its service thread held in a lock (its socket keeps queueing)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from lynx_connector.transport import protocol as proto
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.pool import StagingAbandoned
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

from .fakes import TEST_KEY, FakeFabric, FakeNixlWrapper
from .test_transport_source_sink import COMPAT, collect, stage, wait_for

pytestmark = pytest.mark.timeout(60)

CFG = dict(pool_bytes=1 << 22, chunk_bytes=64 << 10, lease_s=30.0, retry_s=0.01, key=TEST_KEY)


@pytest.fixture
def pair(fabric: FakeFabric) -> Iterator[tuple[TransferSource, TransferSink]]:
    src = TransferSource(TransportConfig(**CFG, timeout_s=3.0), COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=3.0, resend_s=0.2, reconnect_s=0.8), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    yield src, sink
    sink.close()
    src.close()


def drop_replies(src: TransferSource, should_drop) -> list[str]:
    """Make the source lose the replies for which ``should_drop(msg)`` is true; returns the dropped kinds."""
    dropped: list[str] = []
    real = src._reply_sealed

    def reply(ident: bytes, sess, msg: proto.Message, **kw) -> bool:
        if should_drop(msg):
            dropped.append(type(msg).__name__)
            return False
        return real(ident, sess, msg, **kw)

    src._reply_sealed = reply  # type: ignore[method-assign]
    return dropped


def pausable(src: TransferSource) -> threading.Lock:
    """A lock that, while held, stops the source's service thread from reading its socket (P goes silent; its
    socket keeps queueing what arrives)."""
    gate = threading.Lock()
    real_drain = src._drain_socket

    def paused_drain() -> None:
        with gate:
            real_drain()

    src._drain_socket = paused_drain  # type: ignore[method-assign]
    return gate


def pull(sink: TransferSink, src: TransferSource, req: str, a: int = 3000, r: int = 2000):
    v = sink.pool.alloc_request(req, a, r)
    try:
        tid, token = src.ticket(req)
    except KeyError:  # not expected yet: the test stages it later with these credentials
        tid, token = src.expect(req)
    sink.pull(req, *src.address, tid, token, v.anchor, v.residual)
    return v


def test_lost_hello_and_regions_replies_are_asked_again(pair) -> None:
    """Before: a lost reply left the pull waiting in silence until timeout_s, then failed every pull of the
    peer. Now the unanswered Hello and Query are sent again after resend_s."""
    src, sink = pair
    first = {"HelloOk": True, "Regions": True}

    def once(msg: proto.Message) -> bool:
        kind = type(msg).__name__
        if first.get(kind):
            first[kind] = False
            return True
        return False

    dropped = drop_replies(src, once)
    st = stage(src, "a", 3000, 2000)
    t0 = time.monotonic()
    v = pull(sink, src, "a")
    evs = collect(sink, 2, timeout=5.0)
    assert all(e.ok for e in evs), [e.error for e in evs]
    assert dropped == ["HelloOk", "Regions"]
    assert time.monotonic() - t0 < 2.0  # two re-sends of 0.2 s, far inside timeout_s = 3 s
    assert torch.equal(v.anchor, st.anchor) and torch.equal(v.residual, st.residual)
    assert sink.stats()["resent"] >= 2


def test_one_silent_request_fails_alone(pair) -> None:
    """P never answers for request 'mute': it fails at its own deadline; the other requests pulled from the same
    peer before, during and after are all served, and the peer stays cached."""
    src, sink = pair
    stage(src, "mute", 3000, 2000)
    mute = src.ticket("mute")[0]
    drop_replies(src, lambda m: getattr(m, "transfer_id", "") == mute)
    pull(sink, src, "mute")
    oks = []
    for i in range(4):
        stage(src, f"ok{i}", 3000, 2000)
        pull(sink, src, f"ok{i}")
        oks += [e for e in collect(sink, 2, timeout=3.0)]
        time.sleep(0.5)
    evs = collect(sink, 2, timeout=5.0)
    assert all(e.ok for e in oks) and {e.req_id for e in oks} == {f"ok{i}" for i in range(4)}
    assert [e.req_id for e in evs] == ["mute", "mute"] and not any(e.ok for e in evs)
    assert all("did not serve" in e.error and "'mute'" in e.error for e in evs)
    assert sink.stats()["peers"] == 1 and sink.stats()["pulls_live"] == 0
    stage(src, "after", 3000, 2000)
    pull(sink, src, "after")
    assert all(e.ok for e in collect(sink, 2, timeout=3.0))


def test_paused_p_then_resumed_serves_everything(pair) -> None:
    """P's side channel stops for 1.5 s (less than timeout_s) with pulls waiting: D reconnects, asks again and every
    request is served once P answers again; requests after it too."""
    src, sink = pair
    gate = pausable(src)
    for i in range(3):
        stage(src, f"w{i}", 3000, 2000)
    gate.acquire()
    try:
        for i in range(3):
            pull(sink, src, f"w{i}")
        time.sleep(1.5)
        assert sink.poll() == []  # nothing failed while P was silent
    finally:
        gate.release()
    evs = collect(sink, 6, timeout=5.0)
    assert all(e.ok for e in evs), [e.error for e in evs]
    assert sink.stats()["reconnects"] >= 1
    stage(src, "next", 3000, 2000)
    pull(sink, src, "next")
    assert all(e.ok for e in collect(sink, 2, timeout=3.0))
    wait_for(lambda: src.stats()["requests_live"] == 0)


def test_restarted_p_on_the_same_port_is_handshaken_again(fabric: FakeFabric, monkeypatch) -> None:
    """P dies and a new P binds the same port: zmq reconnects by itself, D sees it (socket monitor) and handshakes
    again before it trusts an answer, so every pull after the restart succeeds, the first one too."""
    from lynx_connector.transport import replies

    monkeypatch.setattr(replies, "GONE_REFUSALS", 10**9)  # a P down for a moment, not yet taken as gone
    cfg = TransportConfig(**CFG, timeout_s=3.0)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P1"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=3.0, resend_s=0.2, reconnect_s=0.8), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    try:
        stage(src, "a", 3000, 2000)
        pull(sink, src, "a")
        assert all(e.ok for e in collect(sink, 2))
        port = src.address[1]
        monkeypatch.setattr(src, "_say_goodbye", lambda: 0)  # it dies without a word (killed)
        src.close()
        src = TransferSource(TransportConfig(**{**CFG, "timeout_s": 3.0, "port": port}), COMPAT,
                             nixl=FakeNixlWrapper(fabric, "P2"))
        results = []
        for i in range(3):
            stage(src, f"b{i}", 3000, 2000)
            pull(sink, src, f"b{i}")
            results.append(all(e.ok for e in collect(sink, 2, timeout=8.0)))
        assert results == [True, True, True], results
        assert sink.stats()["pulls_live"] == 0 and sink.stats()["reconnects"] >= 1
    finally:
        sink.close()
        src.close()


def test_rejected_request_fails_at_once_with_p_reason(pair) -> None:
    """P could not stage a request (pool full): D hears the reason at once, not 'unknown request' at its deadline."""
    src, sink = pair
    src.expect("big")
    t0 = time.monotonic()
    pull(sink, src, "big")
    time.sleep(0.3)
    assert sink.poll() == []  # expected: NotReady while P waits for room
    src.reject("big", "staging_full", "P's staging pool is full (staging_mb=4)")
    evs = collect(sink, 2, timeout=2.0)
    assert time.monotonic() - t0 < 1.5
    assert all(not e.ok and "staging_full" in e.error and "staging_mb=4" in e.error for e in evs)
    wait_for(lambda: src.stats()["requests_live"] == 0)
    assert src.stats()["rejected"] == 1


def test_not_ready_retries_back_off(pair) -> None:
    """A request P has not published yet is asked for at most ~1/retry_max_s times a second, not every retry_s."""
    src, sink = pair
    src.expect("slow")
    pull(sink, src, "slow")
    time.sleep(1.0)  # the back-off reaches its cap
    queries = []
    real = src._answer

    def counting(sess, msg):
        if isinstance(msg, proto.Query):
            queries.append(time.monotonic())
        return real(sess, msg)

    src._answer = counting  # type: ignore[method-assign]
    time.sleep(1.0)
    assert 5 <= len(queries) <= 15  # retry_max_s = 0.1 s; retry_s = 0.01 s would give ~100
    src.alloc("slow", 3000, 2000)
    src.publish("slow")
    assert all(e.ok for e in collect(sink, 2, timeout=2.0))


def test_done_lost_while_p_was_silent_is_delivered_later(pair) -> None:
    """D gives up on a pull while P is silent; its Done would be lost with P's silence and P's staging held until
    the lease (30 s here). D keeps owing it and P frees the staging within seconds of answering again."""
    src, sink = pair
    gate = pausable(src)
    stage(src, "late", 3000, 2000)
    gate.acquire()
    try:
        pull(sink, src, "late")
        evs = collect(sink, 2, timeout=6.0)  # D's deadline: 3 s
        assert all(not e.ok and "did not serve" in e.error for e in evs)
        assert sink.stats()["dones_owed"] == 1 and src.stats()["requests_live"] == 1
    finally:
        gate.release()
    t0 = time.monotonic()
    wait_for(lambda: src.stats()["requests_live"] == 0, timeout=10.0)
    assert time.monotonic() - t0 < 10.0 and src.stats()["freed_done"] == 1  # not the 30 s lease
    wait_for(lambda: sink.stats()["dones_owed"] == 0)


def test_request_p_does_not_have_fails_after_the_grace_not_the_deadline(fabric: FakeFabric) -> None:
    """P publishes before it answers for a request, so 'unknown request' (lease expired, P restarted, wrong id)
    is final: D fails it after unknown_grace_s (1 s here), not after timeout_s (20 s)."""
    src = TransferSource(TransportConfig(**CFG, timeout_s=20.0), COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=20.0, unknown_grace_s=1.0), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    try:
        import secrets

        t0 = time.monotonic()
        v = sink.pool.alloc_request("ghost", 3000, 2000)  # a transfer P never heard of
        sink.pull("ghost", *src.address, secrets.token_hex(16), secrets.token_hex(16), v.anchor, v.residual)
        evs = collect(sink, 2, timeout=5.0)
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert all(not e.ok and "does not have transfer" in e.error and "'ghost'" in e.error for e in evs)
        assert sink.stats()["pulls_live"] == 0
    finally:
        sink.close()
        src.close()


def test_an_idle_pause_between_requests_is_not_silence(pair) -> None:
    """Regression (seen in lynx bench load: one reconnect per request in a 0.3 req/s soak): a peer that answered
    everything, then got no question for longer than reconnect_s, is not 'silent' when the next pull asks."""
    src, sink = pair
    for i in range(3):
        stage(src, f"r{i}", 3000, 2000)
        pull(sink, src, f"r{i}")
        assert all(e.ok for e in collect(sink, 2))
        time.sleep(1.2)  # reconnect_s = 0.8 s in this fixture
    assert sink.stats()["reconnects"] == 0 and sink.stats()["resent"] == 0


def test_dones_owed_to_a_peer_are_due_at_once_when_its_session_resumes() -> None:
    """`DoneCourier.resume`: a Done sent while P had dropped the session was refused unread; once the handshake
    is done again, it (and only those owed to that peer) is sent at once with the back-off reset, instead of
    after a back-off that may have grown to seconds."""
    from lynx_connector.transport.link import DoneCourier

    c = DoneCourier(resend_s=0.2, give_up_s=60.0)
    p, other = ("127.0.0.1", 5000), ("127.0.0.1", 5001)
    c.owe(p, ("a" * 32, "t" * 32), now=0.0, measure=(0.5, 4096))
    c.owe(other, ("b" * 32, "u" * 32), now=0.0)
    for t in (0.2, 0.61, 1.42):  # refused while the session was down: the back-off grows
        assert len(c.due(t)) == 2
    assert c.next_time() == pytest.approx(3.02)
    c.resume(p, now=1.5)
    assert c.due(1.5) == [(p, ("a" * 32, "t" * 32), (0.5, 4096))]  # sent again with its measured link
    assert c.next_time() == pytest.approx(1.9)  # p's back-off restarted (0.2 -> 0.4); the other peer's unchanged
    assert c.due(1.91) == [(p, ("a" * 32, "t" * 32), (0.5, 4096))]
    c.ack(p, "a" * 32)
    assert c.due(3.05) == [(other, ("b" * 32, "u" * 32), (0.0, 0))]


def test_a_peer_d_has_nothing_to_do_with_is_closed_after_peer_idle_s(fabric: FakeFabric) -> None:
    """D keeps no connection for good: one to a P it has pulled from and owes nothing is closed after peer_idle_s
    (the next pull handshakes again and succeeds), and so is one to an address where nobody answers (a closed port
    on 127.0.0.1) once its pull has failed and its Done is no longer owed."""
    src = TransferSource(TransportConfig(**CFG, timeout_s=3.0), COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    # lease_s: how long D owes P a Done (the closed port's, here)
    sink = TransferSink(TransportConfig(**{**CFG, "lease_s": 2.0}, timeout_s=0.5, resend_s=0.2, reconnect_s=0.8,
                                        peer_idle_s=1.0), COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        stage(src, "a", 3000, 2000)
        pull(sink, src, "a")
        assert all(e.ok for e in collect(sink, 2))
        assert sink.stats()["peers"] == 1
        wait_for(lambda: sink.stats()["peers"] == 0, timeout=5.0)
        stage(src, "b", 3000, 2000)
        pull(sink, src, "b")
        assert all(e.ok for e in collect(sink, 2))
        sink.pool.free_request("a")
        sink.pool.free_request("b")
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        v = sink.pool.alloc_request("c", 3000, 2000)
        sink.pull("c", "127.0.0.1", closed, "ab" * 16, "cd" * 16, v.anchor, v.residual)
        assert not any(e.ok for e in collect(sink, 2, timeout=5.0))
        sink.pool.free_request("c")
        wait_for(lambda: sink.stats()["peers"] == 0 and sink.stats()["pulls_live"] == 0, timeout=15.0)
    finally:
        sink.close()
        src.close()


def test_a_pull_dropped_with_reads_in_flight_keeps_its_staging_out_of_reuse(fabric: FakeFabric) -> None:
    """NIXL's release of a READ in flight does not wait for it (its bytes may still land), so D's staging of a pull
    aborted mid-read is quarantined for lease_grace_s, never handed to the next request at once; a pull read
    whole is freed at once."""
    src = TransferSource(TransportConfig(**CFG, timeout_s=3.0), COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=3.0), COMPAT, nixl=FakeNixlWrapper(fabric, "D",
                                                                                            delay_s=2.0))
    try:
        stage(src, "a", 3000, 2000)
        pull(sink, src, "a")
        wait_for(lambda: sink.stats()["chunks_posted"] > 0)  # reads posted, not landed (2 s each)
        sink.abort("a")
        sink.free_staging("a")
        assert sink.pool.quarantined_bytes > 0  # (still counted in bytes_allocated until the quarantine ends)
        sink._nixl.delay_s = 0.0
        stage(src, "b", 3000, 2000)
        pull(sink, src, "b")
        assert all(e.ok for e in collect(sink, 2))
        before = sink.pool.quarantined_bytes
        sink.free_staging("b")
        assert sink.pool.quarantined_bytes == before  # read whole: freed at once
    finally:
        sink.close()
        src.close()


def test_a_source_that_cannot_bind_closes_what_it_opened(fabric: FakeFabric) -> None:
    """P's side-channel port is taken: the constructor raises an error naming the address and the setting (it was a
    bare ZMQError under vLLM's engine-core traceback), and its zmq socket and context and the NIXL agent it owns
    are closed (they were left open, with the pool registered, at every failed start)."""
    import os

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cfg = TransportConfig(pool_bytes=1 << 16, host="127.0.0.1", port=busy.getsockname()[1], key=TEST_KEY)
        fds = len(os.listdir("/proc/self/fd"))
        agents = [FakeNixlWrapper(fabric, f"P{i}") for i in range(5)]
        for agent in agents:
            with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{cfg.port}: Address already in use.*"
                                              "side_channel_port"):
                TransferSource(cfg, COMPAT, nixl=agent)
        assert all(a.closed for a in agents)
        assert len(os.listdir("/proc/self/fd")) <= fds + 1
    finally:
        busy.close()


def test_an_error_in_p_service_loop_does_not_stop_it(fabric: FakeFabric, monkeypatch) -> None:
    """An unexpected error in one pass of P's service loop is logged and the loop goes on (it killed P's only
    service thread: no D answered again, no lease expired, staging never freed)."""
    cfg = TransportConfig(pool_bytes=1 << 20, chunk_bytes=64 << 10, timeout_s=3.0, lease_s=30.0, retry_s=0.01,
                          key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        real, calls = src._expire_leases, []

        def flaky() -> None:
            calls.append(1)
            if len(calls) <= 2:
                raise RuntimeError("injected")
            real()

        monkeypatch.setattr(src, "_expire_leases", flaky)
        src._waker.wake()
        wait_for(lambda: len(calls) > 2)
        st = stage(src, "p1", 8192, 0)
        loc = sink.pool.alloc_request("d1", 8192, 0)
        sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
        (ev,) = collect(sink, 1)
        assert ev.ok and torch.equal(loc.anchor, st.anchor) and src._thread.is_alive()
    finally:
        sink.close()
        src.close()


def test_a_late_done_or_lease_frees_only_its_own_transfer(fabric: FakeFabric) -> None:
    """P looks a Done's (or an expired lease's) request up, then frees it without the lock held: if the caller
    aborted it and staged the same request id again in between, the new transfer must not be freed."""
    cfg = TransportConfig(pool_bytes=1 << 20, timeout_s=3.0, lease_s=30.0, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    try:
        stage(src, "p1", 4096, 0)
        old_tid, _ = src.ticket("p1")
        src.abort("p1")
        stage(src, "p1", 4096, 0)  # the same request id, a new transfer
        new_tid, _ = src.ticket("p1")
        assert new_tid != old_tid
        for why in ("done", "lease"):
            assert src._free("p1", why, transfer_id=old_tid) is False
        assert src.ticket("p1")[0] == new_tid and src.stats()["regions_live"] > 0
        assert src._free("p1", "done", transfer_id=new_tid) is True
    finally:
        src.close()


def test_closing_d_tells_p_to_free_what_it_pulled_and_what_it_discarded(fabric: FakeFabric) -> None:
    """D closes with pulls in flight and a discard just queued: P hears a Done for each at once (close ran neither
    the queued commands nor told P of live pulls, so P held that staging until its lease), and close is bounded."""
    cfg = TransportConfig(pool_bytes=1 << 20, chunk_bytes=64 << 10, timeout_s=10.0, lease_s=60.0, retry_s=0.01,
                          key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    dnixl = FakeNixlWrapper(fabric, "D")
    sink = TransferSink(cfg, COMPAT, nixl=dnixl)
    try:
        dnixl.hang = True
        for i in range(4):
            stage(src, f"p{i}", 8192, 0)
            loc = sink.pool.alloc_request(f"d{i}", 8192, 0)
            sink.pull(f"d{i}", *src.address, *src.ticket(f"p{i}"), loc.anchor, None)
        wait_for(lambda: dnixl.live_handles >= 4)
        stage(src, "p9", 8192, 0)
        sink.discard(*src.address, *src.ticket("p9"))
        t0 = time.monotonic()
        sink.close()
        assert time.monotonic() - t0 < 3.0 and dnixl.live_handles == 0
        wait_for(lambda: src.stats()["regions_live"] == 0, timeout=2.0)  # not at the 60 s lease
        assert src.counters["freed_done"] == 5
        time.sleep(0.2)
        assert src.counters["unknown_request"] == 0  # one Done per transfer: a second would count as unknown
        with pytest.raises(RuntimeError, match="closed"):
            sink.discard(*src.address, "a" * 32, "b" * 32)
        sink.close()  # twice: nothing
    finally:
        sink.close()
        src.close()


def test_an_endpoint_whose_constructor_fails_late_closes_what_it_opened(fabric: FakeFabric, monkeypatch) -> None:
    """A failure after the NIXL agent registered its pool (and, on P, after the port was bound): the agent is
    closed and the port free again (both stayed open: the agent with memory registered, the port bound)."""
    from lynx_connector.transport import sink as sink_mod
    from lynx_connector.transport import source as source_mod

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    cfg = TransportConfig(pool_bytes=1 << 16, host="127.0.0.1", key=TEST_KEY)
    monkeypatch.setattr(source_mod, "StatusWriter", broken)
    agent = FakeNixlWrapper(fabric, "P0")
    with pytest.raises(RuntimeError, match="injected"):
        TransferSource(cfg, COMPAT, nixl=agent)
    assert agent.closed
    monkeypatch.setattr(sink_mod, "TransferScheduler", broken)
    agent = FakeNixlWrapper(fabric, "D0")
    with pytest.raises(RuntimeError, match="injected"):
        TransferSink(cfg, COMPAT, nixl=agent)
    assert agent.closed
    monkeypatch.undo()
    with socket.socket() as s:  # a fixed port: bound by the failed source, free again
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fixed = TransportConfig(pool_bytes=1 << 16, host="127.0.0.1", port=port, key=TEST_KEY)
    monkeypatch.setattr(source_mod, "StatusWriter", broken)
    with pytest.raises(RuntimeError, match="injected"):
        TransferSource(fixed, COMPAT, nixl=FakeNixlWrapper(fabric, "P1"))
    monkeypatch.undo()
    src = TransferSource(fixed, COMPAT, nixl=FakeNixlWrapper(fabric, "P2"))
    src.close()


def test_a_pull_queued_behind_close_is_told_to_p_as_a_done(fabric: FakeFabric) -> None:
    """A pull that passed the closed-check in the instant close() began is queued behind its command: it is not
    started, and its P is told to free (it was left in the queue, and P held that staging until its lease)."""
    from lynx_connector.transport.link import PullState

    cfg = TransportConfig(pool_bytes=1 << 20, timeout_s=10.0, lease_s=60.0, retry_s=0.01, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        stage(src, "p9", 8192, 0)
        now = time.monotonic()
        late = ("pull", PullState("d9", tuple(src.address), *src.ticket("p9"), (0, 8192), None, now, now + 10))
        real = sink._cmds

        class Behind:  # the late pull lands right behind close's command
            def put(self, cmd) -> None:
                real.put(cmd)
                if cmd[0] == "close":
                    real.put(late)

            def get_nowait(self):
                return real.get_nowait()

        sink._active.add("d9")
        sink._cmds = Behind()
        sink.close()
        wait_for(lambda: src.counters["freed_done"] == 1, timeout=2.0)
        assert src.stats()["regions_live"] == 0 and real.empty() and "d9" not in sink._active
    finally:
        sink.close()
        src.close()


def test_closing_hurries_only_the_dones_whose_back_off_would_outlast_it() -> None:
    """DoneCourier.hurry: a Done resent with back-off (next send seconds away) is due at once; one sent lately
    keeps its schedule (a resend would reach P as an unknown request if the first one arrived)."""
    from lynx_connector.transport.link import DoneCourier

    c = DoneCourier(resend_s=0.5, give_up_s=60.0)
    c.owe(("h", 1), ("a" * 32, "t"), now=0.0)
    assert [d[1][0] for d in c.due(0.5)] == ["a" * 32]  # resent; next in 1.0 s (at 1.5)
    c.owe(("h", 1), ("b" * 32, "t"), now=0.6)  # sent lately: next at 1.1
    c.hurry(0.6)
    assert [d[1][0] for d in c.due(0.6)] == ["a" * 32]
    assert [d[1][0] for d in c.due(1.1)] == ["b" * 32]


def test_a_closing_p_fails_d_pulls_from_it_at_once_and_nothing_is_owed(fabric: FakeFabric) -> None:
    """P shuts down while D waits on two pulls from it (one P never staged, one it is still writing): P's sealed
    Error("closing") fails both at once, not at their 30 s deadline. D owes P no Done and drops the peer; a pull
    read whole before is untouched. A new P on the same port then serves D as before."""
    cfg = TransportConfig(**CFG, timeout_s=30.0)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P1"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=30.0, resend_s=0.2), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    try:
        stage(src, "whole", 3000, 2000)
        pull(sink, src, "whole")
        assert all(e.ok for e in collect(sink, 2))
        wait_for(lambda: sink.stats()["dones_owed"] == 0)
        pull(sink, src, "never")  # P expects it but never stages it
        stage(src, "writing", 3000, 2000, publish=False)  # staged, not published: NotReady
        pull(sink, src, "writing")
        time.sleep(0.3)
        assert sink.poll() == []
        port = src.address[1]
        src.close()
        evs = collect(sink, 4, timeout=5.0)
        assert sorted(e.req_id for e in evs) == ["never", "never", "writing", "writing"]
        assert all(not e.ok and "shut down" in e.error for e in evs), [e.error for e in evs]
        st = sink.stats()
        assert (st["peer_closed"], st["dones_owed"], st["pulls_live"], st["peers"]) == (1, 0, 0, 0), st
        sink.discard("127.0.0.1", port, "ab" * 16, "cd" * 16)  # the worker discarding a ticket of that P
        time.sleep(0.5)
        st = sink.stats()
        assert (st["dones_owed"], st["peers"]) == (1, 0), st  # owed until a P handshakes there: no connection
        for req in ("whole", "never", "writing"):
            sink.pool.free_request(req)
        assert sink.pool.regions_live == 0
        src = TransferSource(TransportConfig(**{**CFG, "timeout_s": 30.0, "port": port}), COMPAT,
                             nixl=FakeNixlWrapper(fabric, "P2"))
        stage(src, "after", 3000, 2000)
        pull(sink, src, "after")
        assert all(e.ok for e in collect(sink, 2, timeout=8.0))
    finally:
        sink.close()
        src.close()


def test_p_tells_only_live_sessions_it_is_closing_and_logs_nothing_for_gone_ones(fabric: FakeFabric) -> None:
    """A session whose D has gone (its zmq identity unroutable) is skipped quietly: no dropped reply counted."""
    src = TransferSource(TransportConfig(**CFG, timeout_s=3.0), COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=3.0), COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    stage(src, "a", 3000, 2000)
    pull(sink, src, "a")
    assert all(e.ok for e in collect(sink, 2))
    sink.close()  # D gone: its identity no longer routable from P's ROUTER
    wait_for(lambda: src.stats()["requests_live"] == 0)
    time.sleep(0.2)
    dropped = src.stats()["replies_dropped"]
    src.close()
    assert src._told_closing == 0 and src.counters["replies_dropped"] == dropped


def waiting_on_p1(fabric: FakeFabric) -> tuple[TransferSource, TransferSink]:
    """P1 and a D (both with a 30 s deadline) whose pull "never" (P1 expects it, never stages it) waits on P1 in a
    session."""
    src = TransferSource(TransportConfig(**CFG, timeout_s=30.0), COMPAT, nixl=FakeNixlWrapper(fabric, "P1"))
    sink = TransferSink(TransportConfig(**CFG, timeout_s=30.0, resend_s=0.2), COMPAT,
                        nixl=FakeNixlWrapper(fabric, "D"))
    pull(sink, src, "never")
    wait_for(lambda: sink.stats()["handshakes"] == 1)
    return src, sink


def test_a_p_gone_without_a_word_fails_d_pulls_once_its_port_refuses(fabric: FakeFabric, monkeypatch) -> None:
    """P stops without closing in order (killed, or vLLM's abort mode): no goodbye. Its port then refuses D's
    reconnection attempts, which zmq reports at once: after GONE_REFUSALS of them D takes that P as gone and fails
    its waiting pulls (not at their 30 s deadline), owing it no Done. (An attempt that hangs, as across a
    partition, or fails only after REFUSED_WITHIN_S is no refusal: test_a_slow_failed_attempt_is_no_refusal.)"""
    src, sink = waiting_on_p1(fabric)
    try:
        monkeypatch.setattr(src, "_say_goodbye", lambda: 0)  # as if killed: nothing is said
        src.close()
        evs = collect(sink, 2, timeout=5.0)
        assert all(not e.ok and "went away" in e.error for e in evs), [e.error for e in evs]
        st = sink.stats()
        assert (st["peer_gone"], st["peer_closed"], st["dones_owed"], st["pulls_live"], st["peers"]) == (1, 0, 0, 0, 0)
        sink.pool.free_request("never")
    finally:
        sink.close()
        src.close()


def test_an_abandoned_request_that_p_aborts_is_forgotten(pair) -> None:
    """D's Done for a request P expected but had not staged marks it abandoned (P must not stage it later). When P
    then aborts it instead of asking take_abandoned, the mark went with it; it stayed (up to 4096 of them)."""
    src, sink = pair
    tid, token = src.expect("r1")
    sink.discard(*src.address, tid, token)
    wait_for(lambda: src.stats()["freed_done"] == 1)
    assert "r1" in src._abandoned
    src.abort("r1")
    assert "r1" not in src._abandoned and not src.take_abandoned("r1")


def test_a_done_that_comes_while_p_allocates_leaves_nothing_staged(pair, monkeypatch) -> None:
    """D gives up on an expected request (its Done) after P's save queue asked take_abandoned and before alloc
    took the lock again (the pool allocates without it): alloc raises StagingAbandoned and frees what it took;
    before, it staged the request again under the same ticket and held the pool for nobody until the lease
    (review)."""
    src, sink = pair
    tid, token = src.expect("r1")
    real = src.pool.alloc_request

    def alloc_while_d_gives_up(req_id, a, r):  # noqa: ANN001, ANN202
        sink.discard(*src.address, tid, token)
        wait_for(lambda: src.stats()["freed_done"] == 1)
        return real(req_id, a, r)

    monkeypatch.setattr(src.pool, "alloc_request", alloc_while_d_gives_up)
    with pytest.raises(StagingAbandoned, match="gave up"):
        src.alloc("r1", 1 << 16, 0, transfer_id=tid, token=token)
    st = src.stats()
    assert (st["requests_live"], st["bytes_allocated"]) == (0, 0), st
    assert "r1" not in src._abandoned and "r1" not in src._entries


def test_a_slow_failed_attempt_is_no_refusal(monkeypatch) -> None:
    """zmq reports every failed connection attempt as CONNECT_DELAYED then CLOSED, whatever the cause. Only one
    that fails within REFUSED_WITHIN_S counts as refused (nothing listens: that P is gone); one that times out
    (a partition, a crashed host) resets the count, and a connection resets it too."""
    import zmq

    from lynx_connector.transport import link

    clock = [100.0]
    script: list[int] = []

    def next_event(_sock, _flags=0):
        if not script:
            raise zmq.Again()
        return {"event": script.pop(0), "value": 0, "endpoint": b""}

    monkeypatch.setattr(link, "recv_monitor_message", next_event)
    monkeypatch.setattr(link.time, "monotonic", lambda: clock[0])
    ctx, poller = zmq.Context(), zmq.Poller()
    peer = link.PeerLink(ctx, poller, ("127.0.0.1", 9), 1 << 16, TEST_KEY)
    try:
        def attempt(seconds: float) -> None:
            script.append(zmq.EVENT_CONNECT_DELAYED)
            peer.reconnected()
            clock[0] += seconds
            script.append(zmq.EVENT_CLOSED)
            peer.reconnected()

        attempt(0.01)
        assert peer.refusals == 1
        attempt(5.0)  # timed out: says nothing of the P process
        assert peer.refusals == 0
        attempt(0.01)
        attempt(0.01)
        assert peer.refusals == 2
        script.append(zmq.EVENT_CONNECTED)
        peer.reconnected()
        assert peer.refusals == 0
        script.append(zmq.EVENT_CLOSED)  # a CLOSED with no attempt under way is not one
        peer.reconnected()
        assert peer.refusals == 0
    finally:
        peer.close()
        ctx.term()


def test_a_goodbye_read_late_still_counts_as_a_shutdown(fabric: FakeFabric) -> None:
    """D's service thread busy for 0.5 s while P closes in order: P's goodbye and zmq's refusals wait side by side.
    The goodbye is read first: a shutdown (peer_closed), not a P that vanished."""
    import threading

    src, sink = waiting_on_p1(fabric)
    try:
        gate, real = threading.Lock(), sink._serve_once

        def gated() -> None:
            with gate:
                real()

        sink._serve_once = gated  # type: ignore[method-assign]
        time.sleep(0.05)
        with gate:
            src.close()
            time.sleep(0.5)
        evs = collect(sink, 2, timeout=5.0)
        assert all("shut down" in e.error for e in evs), [e.error for e in evs]
        assert (sink.stats()["peer_closed"], sink.stats()["peer_gone"]) == (1, 0)
        sink.pool.free_request("never")
    finally:
        sink.close()
        src.close()


def test_a_done_owed_to_a_closed_address_waits_for_the_next_handshake_there(fabric: FakeFabric) -> None:
    """After P1 shut down, D does not connect to its address for a Done (nobody may listen there), but a Done it
    owes there (a discard of a ticket P2, restarted on that port, issued) is sent once D handshakes with P2."""
    src, sink = waiting_on_p1(fabric)
    try:
        port = src.address[1]
        src.close()
        collect(sink, 2)
        sink.pool.free_request("never")
        src = TransferSource(TransportConfig(**{**CFG, "timeout_s": 30.0, "port": port}), COMPAT,
                             nixl=FakeNixlWrapper(fabric, "P2"))
        stage(src, "x", 3000, 2000)
        sink.discard(*src.address, *src.ticket("x"))  # D's request ended before its pull started
        time.sleep(0.5)
        assert (sink.stats()["peers"], src.stats()["requests_live"]) == (0, 1)  # no connection yet
        stage(src, "y", 3000, 2000)
        pull(sink, src, "y")  # the next pull handshakes with P2: the Done owed there goes too
        assert all(e.ok for e in collect(sink, 2))
        wait_for(lambda: src.stats()["freed_done"] == 2 and src.stats()["requests_live"] == 0)
        wait_for(lambda: sink.stats()["dones_owed"] == 0)
    finally:
        sink.close()
        src.close()


def test_send_failures_to_a_peer_that_is_not_there_are_logged_once_per_interval(caplog) -> None:
    """A D whose P is partitioned or gone, with many pulls waiting: once zmq's queue to the unconnected peer is
    full, every send fails. One warning per LOG_EVERY_S, not one per send (review: a flood)."""
    import zmq

    from lynx_connector.transport import link

    ctx, poller = zmq.Context(), zmq.Poller()
    with socket.socket() as s:  # a closed port on 127.0.0.1: nobody answers
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = link.PeerLink(ctx, poller, ("127.0.0.1", port), 1 << 16, TEST_KEY)
    try:
        for _ in range(3000):  # past zmq's send queue (1000 messages by default): every later send fails
            peer.hello("0" * 64)
        said = [r for r in caplog.records if "send failed" in r.getMessage()]
        assert len(said) == 1, len(said)
        assert peer._send_log.suppressed >= 1000
    finally:
        peer.close()
        ctx.term()
