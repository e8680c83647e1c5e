"""Integration: a real TransferSource in a spawned process, real TransferSinks here, real NIXL over loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from lynx_connector.lab.peer import crc, start_source_process
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import TransferEvent
from lynx_connector.transport.nixl_wrapper import nixl_available
from lynx_connector.transport.sink import TransferSink

from .fakes import TEST_KEY

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.timeout(90),
    pytest.mark.skipif(not nixl_available(), reason="NIXL not installed"),
]

COMPAT = {"model": "smollm2", "layers": 30, "kv_heads": 3, "head_size": 64, "codec": "lynx", "codec_version": 1}
MB = 1 << 20


def call(conn, *cmd):
    conn.send(cmd)
    assert conn.poll(60), f"source process did not answer {cmd[0]}"
    tag, val = conn.recv()
    assert tag == "ok", val
    return val


def ticket(conn, req_id: str) -> tuple[str, str]:
    return tuple(call(conn, "tickets", [req_id])[req_id])


def wait_events(sink: TransferSink, n: int, timeout: float) -> list[tuple[float, TransferEvent]]:
    out: list[tuple[float, TransferEvent]] = []
    end = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < end, f"only {len(out)} of {n} events: {out}"
        out.extend((time.monotonic(), e) for e in sink.poll())
        time.sleep(0.002)
    return out


@pytest.fixture(scope="module")
def source() -> Iterator[tuple]:
    proc, conn, addr = start_source_process(TransportConfig(pool_bytes=96 * MB, lease_s=60.0, key=TEST_KEY), COMPAT)
    yield proc, conn, addr
    if proc.is_alive():
        conn.send(("stop",))
        proc.join(10)
    if proc.is_alive():
        proc.kill()


@pytest.fixture(scope="module")
def sink() -> Iterator[TransferSink]:
    s = TransferSink(TransportConfig(pool_bytes=96 * MB, timeout_s=3.0, key=TEST_KEY), COMPAT)
    yield s
    s.close()


def test_byte_exact_and_done_frees_p(source, sink: TransferSink) -> None:
    _, conn, addr = source
    specs = [("a1", 3 * MB + 17, 5 * MB + 3, 11), ("a2", 777, 0, 12), ("a3", 4 * MB, 4 * MB, 13)]
    sums = call(conn, "stage", specs, True)
    views = {r: sink.pool.alloc_request(r, a, b) for r, a, b, _ in specs}
    for r, st in views.items():
        sink.pull(r, *addr, *ticket(conn, r), st.anchor, st.residual)
    evs = [e for _, e in wait_events(sink, 5, 30)]
    assert all(e.ok for e in evs), evs
    for r, st in views.items():
        assert (crc(st.anchor), crc(st.residual)) == tuple(sums[r])
    end = time.monotonic() + 10
    while sorted(call(conn, "freed")) != ["a1", "a2", "a3"]:
        assert time.monotonic() < end, "P did not free its staging after D's done"
        time.sleep(0.05)
    assert call(conn, "stats")["regions_live"] == 0
    for r in views:
        sink.pool.free_request(r)
    assert sink.pool.regions_live == 0


def test_malformed_and_incompatible_handshakes_rejected(source, sink: TransferSink) -> None:
    _, conn, addr = source
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(f"tcp://{addr[0]}:{addr[1]}")
    try:
        raw.send(b"\x93\x01\x02\x03")
        assert proto.decode(raw.recv(), 1 << 20).code == "refused"
        raw.send(proto.encode(proto.Hello(v=proto.VERSION, nonce_d=b"n" * 16, compat_hash="0" * 64)))
        ch = proto.decode(raw.recv(), 1 << 20)  # a Challenge: nothing about P but its proof
        assert isinstance(ch, proto.Challenge)
        skey = proto.session_key(TEST_KEY, b"n" * 16, ch.nonce_p)
        auth = proto.Auth(v=proto.VERSION, proof_d=proto.proof_d(TEST_KEY, b"n" * 16, ch.nonce_p),
                          compat={**COMPAT, "head_size": 128, "dtype": "fp8"})
        raw.send(proto.seal(skey, proto.D_TO_P, 1, proto.encode(auth)))
        err = proto.decode(raw.recv(), 1 << 20)
        assert (err.code, err.message) == ("refused", "refused")  # the compat diff goes to P's log only
    finally:
        raw.close()
    sums = call(conn, "stage", [("b1", 1000, 2000, 5)], True)  # the listener still serves
    st = sink.pool.alloc_request("b1", 1000, 2000)
    sink.pull("b1", *addr, *ticket(conn, "b1"), st.anchor, st.residual)
    assert all(e.ok for _, e in wait_events(sink, 2, 20))
    assert (crc(st.anchor), crc(st.residual)) == tuple(sums["b1"])
    sink.pool.free_request("b1")



def test_wait_returns_when_a_stream_lands_and_times_out_when_nothing_does(source, sink: TransferSink) -> None:
    """`TransferSink.wait` (D's worker on an empty engine step): it returns False after its timeout with nothing in
    flight, and True as soon as an event is there, well before a long timeout; nothing is consumed by waiting."""
    _, conn, addr = source
    t0 = time.monotonic()
    assert sink.wait(0.2) is False
    assert 0.15 <= time.monotonic() - t0 < 5.0
    call(conn, "stage", [("w1", 2 * MB, 2 * MB, 21)], True)
    st = sink.pool.alloc_request("w1", 2 * MB, 2 * MB)
    sink.pull("w1", *addr, *ticket(conn, "w1"), st.anchor, st.residual)
    t0 = time.monotonic()
    assert sink.wait(30.0) is True
    assert time.monotonic() - t0 < 20.0
    assert sink.wait(30.0) is True  # not consumed: poll() takes the events
    evs = [e for _, e in wait_events(sink, 2, 30)]
    assert all(e.ok for e in evs), evs
    sink.pool.free_request("w1")

@pytest.fixture(scope="module")
def paced_sink() -> Iterator[TransferSink]:
    s = TransferSink(TransportConfig(pool_bytes=96 * MB, timeout_s=3.0, link_gbps=0.4, key=TEST_KEY), COMPAT)
    yield s
    s.close()


def test_priority_anchor_overtakes_residual_under_pacing(source, paced_sink: TransferSink) -> None:
    _, conn, addr = source
    call(conn, "stage", [("c1", 256 * 1024, 16 * MB, 21), ("c2", 256 * 1024, 256 * 1024, 22)], True)
    v1 = paced_sink.pool.alloc_request("c1", 256 * 1024, 16 * MB)
    v2 = paced_sink.pool.alloc_request("c2", 256 * 1024, 256 * 1024)
    paced_sink.pull("c1", *addr, *ticket(conn, "c1"), v1.anchor, v1.residual)
    first = wait_events(paced_sink, 1, 20)
    assert first[0][1].stream == "anchor" and first[0][1].ok
    time.sleep(0.05)  # c1's residual is now in flight (16 MiB at 50 MB/s: ~0.33 s)
    paced_sink.pull("c2", *addr, *ticket(conn, "c2"), v2.anchor, v2.residual)
    evs = [e for _, e in wait_events(paced_sink, 3, 30)]
    order = [(e.req_id, e.stream) for e in evs]
    assert order.index(("c2", "anchor")) < order.index(("c1", "residual")), order
    assert all(e.ok for e in evs)
    r1 = next(e for e in evs if e.req_id == "c1" and e.stream == "residual")
    assert r1.nbytes / r1.seconds <= 0.4e9 / 8 * 1.1  # paced: never faster than the link (+ initial chunk)
    for r in ("c1", "c2"):
        paced_sink.pool.free_request(r)


def test_p_measures_the_link_from_d_done_link_times(source, paced_sink: TransferSink) -> None:
    """Protocol v4: each Done carries the link time D's reads of the transfer took. Two transfers read together
    over D's emulated 0.4 Gbit/s link share it, so P's meter (the bytes over the sum of the link times) reads the
    link's rate, not half of it, and not less for the time the pulls waited to start."""
    from lynx_connector.auto import LinkMeter

    _, conn, addr = source
    call(conn, "pulled")  # drop the samples of earlier tests
    specs = [("m1", 2 * MB, 6 * MB, 31), ("m2", 2 * MB, 6 * MB, 32)]
    call(conn, "stage", specs, True)
    views = {r: paced_sink.pool.alloc_request(r, a, b) for r, a, b, _ in specs}
    for r, v in views.items():
        paced_sink.pull(r, *addr, *ticket(conn, r), v.anchor, v.residual)
    evs = [e for _, e in wait_events(paced_sink, 4, 30)]
    assert all(e.ok for e in evs), evs
    end, pulled = time.monotonic() + 10, []
    while len(pulled) < 2:
        assert time.monotonic() < end, f"P did not hear both Dones: {pulled}"
        pulled += call(conn, "pulled")
        time.sleep(0.05)
    assert sorted(n for _, _, n in pulled) == [8 * MB, 8 * MB]
    link_s = sum(s for _, s, _ in pulled)
    assert 16 * MB / (0.4e9 / 8) * 0.95 < link_s < 16 * MB / (0.4e9 / 8) * 1.15, pulled  # ~0.34 s in all
    meter = LinkMeter(window_s=60.0)
    meter.add(pulled)
    assert meter.rate() == pytest.approx(0.4e9 / 8, rel=0.15)
    for r in views:
        paced_sink.pool.free_request(r)


def test_peer_killed_mid_transfer_fails_within_timeout(source, paced_sink: TransferSink) -> None:
    proc, conn, addr = start_source_process(TransportConfig(pool_bytes=64 * MB, lease_s=60.0, key=TEST_KEY), COMPAT)
    try:
        call(conn, "stage", [("k1", 64 * 1024, 40 * MB, 31)], True)
        v = paced_sink.pool.alloc_request("k1", 64 * 1024, 40 * MB)
        paced_sink.pull("k1", *addr, *ticket(conn, "k1"), v.anchor, v.residual)
        (t_anchor, ev), = wait_events(paced_sink, 1, 20)
        assert ev.stream == "anchor" and ev.ok
        before = paced_sink.stats()  # the killed P among its peers
        proc.kill()  # SIGKILL while the 40 MiB residual is being paced (~0.8 s)
        t_kill = time.monotonic()
        (t_fail, ev), = wait_events(paced_sink, 1, 10)
        assert ev.req_id == "k1" and ev.stream == "residual" and not ev.ok and ev.error
        assert t_fail - t_kill < 3.0 + 1.0  # within timeout_s (+ slack)
        assert paced_sink.stats()["pulls_live"] == 0
        end = time.monotonic() + 5  # its port refuses D's reconnection attempts: D drops it as gone
        while (paced_sink.stats()["peer_gone"], paced_sink.stats()["peers"]) != (before["peer_gone"] + 1,
                                                                                before["peers"] - 1):
            assert time.monotonic() < end, paced_sink.stats()
            time.sleep(0.01)
        assert paced_sink.stats()["dones_owed"] == 0
        paced_sink.pool.free_request("k1")
        assert paced_sink.pool.regions_live == 0
    finally:
        proc.kill()
        proc.join(10)
    # the sink still serves other peers
    _, conn1, addr1 = source
    sums = call(conn1, "stage", [("k2", 5000, 0, 41)], True)
    v2 = paced_sink.pool.alloc_request("k2", 5000, 0)
    paced_sink.pull("k2", *addr1, *ticket(conn1, "k2"), v2.anchor, None)
    (_, ev2), = wait_events(paced_sink, 1, 20)
    assert ev2.ok and crc(v2.anchor) == sums["k2"][0]
    paced_sink.pool.free_request("k2")


def _full_behind_speculative(sink: TransferSink, conn, addr, tag: str) -> dict[tuple[str, str], TransferEvent]:
    """Two speculative pulls (1 MiB anchor, 4 MiB residual each), then a full-mode one (1 MiB + 1 MiB)."""
    specs = [(f"{tag}s1", MB, 4 * MB, 51), (f"{tag}s2", MB, 4 * MB, 52), (f"{tag}f", MB, MB, 53)]
    sums = call(conn, "stage", specs, True)
    views = {r: sink.pool.alloc_request(r, a, b) for r, a, b, _ in specs}
    for r, st in views.items():
        sink.pull(r, *addr, *ticket(conn, r), st.anchor, st.residual, order="whole" if r.endswith("f") else "split")
    evs = {(e.req_id, e.stream): e for _, e in wait_events(sink, 6, 30)}
    assert all(e.ok for e in evs.values()), evs
    for r, st in views.items():
        assert (crc(st.anchor), crc(st.residual)) == tuple(sums[r])
        sink.pool.free_request(r)
    return evs


@pytest.fixture(scope="module")
def paced_sink_old_rule() -> Iterator[TransferSink]:
    s = TransferSink(TransportConfig(pool_bytes=96 * MB, timeout_s=3.0, link_gbps=0.4, key=TEST_KEY,
                                     order="anchor_first"), COMPAT)
    yield s
    s.close()


def test_full_request_behind_speculative_anchors_finishes_earlier_than_under_anchor_first(
        source, paced_sink: TransferSink, paced_sink_old_rule: TransferSink) -> None:
    """Issue 16.1 between processes, paced at 0.4 Gbit/s (12 MiB: ~0.25 s): under the old rule (every anchor
    before any residual) the full request's residual waits for both speculative residuals; by value it goes right
    after the speculative anchors, whole."""
    _, conn, addr = source
    new = _full_behind_speculative(paced_sink, conn, addr, "n")
    old = _full_behind_speculative(paced_sink_old_rule, conn, addr, "o")
    t_new, t_old = new["nf", "residual"].seconds, old["of", "residual"].seconds
    # the speculative anchors still land first under both rules
    for evs, tag in ((new, "n"), (old, "o")):
        assert max(evs[f"{tag}s{i}", "anchor"].seconds for i in (1, 2)) < evs[f"{tag}f", "residual"].seconds
    # old: 12 MiB before f is whole; new: 4 MiB (the two anchors and f), so well under half the time
    assert t_new < 0.6 * t_old, (t_new, t_old)
    assert new["nf", "residual"].seconds < min(new[f"ns{i}", "residual"].seconds for i in (1, 2))
    assert old["of", "residual"].seconds > max(old[f"os{i}", "residual"].seconds for i in (1, 2))


@pytest.mark.parametrize("how, says, counter", [("stop", "shut down", "peer_closed"),
                                                ("kill", "went away", "peer_gone")])
def test_a_p_process_that_stops_fails_d_waiting_pull_at_once(how: str, says: str, counter: str) -> None:
    """A real P process (real NIXL) stops while D waits on a request it staged but never published: closing in
    order (it tells D), or killed (SIGKILL: its port then refuses D's reconnection attempts). Either way D's pull
    fails within seconds, naming what happened, not at its 30 s deadline, and D owes that P nothing."""
    proc, conn, addr = start_source_process(TransportConfig(pool_bytes=16 * MB, lease_s=60.0, key=TEST_KEY), COMPAT)
    sink = TransferSink(TransportConfig(pool_bytes=16 * MB, timeout_s=30.0, key=TEST_KEY), COMPAT)
    try:
        call(conn, "stage", [("w1", 4096, 8192, 61)], False)  # not published: D's queries get NotReady
        v = sink.pool.alloc_request("w1", 4096, 8192)
        sink.pull("w1", *addr, *ticket(conn, "w1"), v.anchor, v.residual)
        end = time.monotonic() + 20
        while sink.stats()["handshakes"] < 1:
            assert time.monotonic() < end, "no session with P"
            time.sleep(0.01)
        assert sink.poll() == []
        if how == "stop":
            call(conn, "stop")
        else:
            proc.kill()
        evs = wait_events(sink, 2, 10)  # fails past 10 s: the old way was the pull's 30 s deadline
        assert all(not e.ok and says in e.error for _, e in evs), [e.error for _, e in evs]
        st = sink.stats()
        assert (st[counter], st["dones_owed"], st["pulls_live"]) == (1, 0, 0), st
        sink.pool.free_request("w1")
        assert sink.pool.regions_live == 0
    finally:
        sink.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
