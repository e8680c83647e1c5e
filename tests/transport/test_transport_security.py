"""Issue 14 (items 1, 2 and the frame cap of 5), protocol v2: every attack below succeeded against v1.

Real zmq side channel, fake NIXL. An outsider is a raw DEALER socket speaking the wire protocol by hand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from lynx_connector.config import LynxConfig
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.keys import (
    EXTRA_KEY_ENV,
    EXTRA_KEY_FILE_ENV,
    KEY_ENV,
    KEY_FILE_ENV,
    SideChannelKeyError,
    load_extra_keys,
    load_side_channel_key,
)
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

from .fakes import OTHER_KEY, TEST_KEY, FakeFabric, FakeNixlWrapper
from .test_transport_source_sink import COMPAT, collect, stage, wait_for

pytestmark = pytest.mark.timeout(60)

CFG = dict(pool_bytes=1 << 22, chunk_bytes=64 << 10, timeout_s=1.5, lease_s=30.0, retry_s=0.01)


@pytest.fixture
def src(fabric: FakeFabric) -> Iterator[TransferSource]:
    s = TransferSource(TransportConfig(**CFG, key=TEST_KEY), COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    yield s
    s.close()


@pytest.fixture
def sinks(fabric: FakeFabric) -> Iterator:
    made: list[TransferSink] = []

    def make(key: bytes | None = TEST_KEY, name: str | None = None, **kw) -> TransferSink:
        sink = TransferSink(TransportConfig(**{**CFG, **kw}, key=key), COMPAT,
                            nixl=FakeNixlWrapper(fabric, name or f"D{len(made)}"))
        made.append(sink)
        return sink

    yield make
    for s in made:
        s.close()


class Raw:
    """An outsider's DEALER socket; ``handshake(key)`` runs the v2 handshake by hand (with a key it holds)."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 3000)
        self.sock.connect("tcp://{}:{}".format(*addr))
        self.skey, self.seq = b"", 0
        self.opener: proto.Opener | None = None

    def ask(self, frame: bytes) -> bytes:
        self.sock.send(frame)
        return self.sock.recv()

    def plain(self, frame: bytes) -> proto.Message:
        return proto.decode(self.ask(frame), 1 << 21)

    def handshake(self, key: bytes) -> proto.Message:
        ch = self.plain(proto.encode(proto.Hello(v=proto.VERSION, nonce_d=b"N" * 16, compat_hash="0" * 64)))
        assert isinstance(ch, proto.Challenge)
        self.skey = proto.session_key(key, b"N" * 16, ch.nonce_p)
        self.opener = proto.Opener(self.skey, proto.P_TO_D)
        auth = proto.Auth(v=proto.VERSION, proof_d=proto.proof_d(key, b"N" * 16, ch.nonce_p), compat=COMPAT)
        return self.sealed(auth)

    def seal(self, msg: proto.Message) -> bytes:
        self.seq += 1
        return proto.seal(self.skey, proto.D_TO_P, self.seq, proto.encode(msg))

    def sealed(self, msg: proto.Message) -> proto.Message:
        reply = self.ask(self.seal(msg))
        if reply[:1] != bytes([proto.SEALED]):
            return proto.decode(reply, 1 << 21)
        assert self.opener is not None
        verdict, payload = self.opener.open(reply)
        assert verdict == "ok"
        return proto.decode(payload, 1 << 21)

    def close(self) -> None:
        self.sock.close()


def refused(msg: proto.Message) -> bool:
    return isinstance(msg, proto.Error) and (msg.code, msg.message) == ("refused", "refused")


def test_outsider_without_the_key_gets_only_refused_and_no_metadata(src: TransferSource) -> None:
    """v1: a Hello returned P's NIXL metadata and pool address to anyone."""
    st = stage(src, "p1", 4096, 0)
    tid, token = src.ticket("p1")
    raw = Raw(src.address)
    try:
        for frame in (proto.encode(proto.Query(v=proto.VERSION, transfer_id=tid, token=token)),
                      proto.encode(proto.Done(v=proto.VERSION, transfer_id=tid, token=token))):
            assert refused(raw.plain(frame))
        reply = raw.handshake(OTHER_KEY)  # a guessed key: the Challenge reveals nothing, the Auth is refused
        assert refused(reply)
        for reply_bytes in (raw.ask(raw.seal(proto.Query(v=proto.VERSION, transfer_id=tid, token=token))),):
            assert refused(proto.decode(reply_bytes, 1 << 20))  # no session: still only "refused"
    finally:
        raw.close()
    stats = src.stats()
    assert stats["auth_failed"] == 1 and stats["refused"] >= 3 and stats["sessions"] == 0
    assert stats["regions_live"] == 1 and stats["served_queries"] == 0  # nothing read, nothing freed
    assert st.anchor.numel() == 4096


def test_a_hello_flood_from_outsiders_does_not_fail_a_real_d(src: TransferSource, sinks, monkeypatch) -> None:
    """P keeps a bounded number of handshakes between its Challenge and the Auth (the oldest dropped first): more
    outsiders' Hellos than that, between a real D's Hello and its Auth, drop D's handshake. D's Auth is then refused
    like a wrong key's; D tries a fresh handshake (AUTH_RETRIES) and its pull succeeds. A wrong key still fails
    (test_wrong_key_d_fails_the_handshake_naming_the_key)."""
    from lynx_connector.transport import handshake

    monkeypatch.setattr(handshake, "MAX_PENDING", 4)
    real_on_hello = handshake.SideChannelServer._on_hello
    flooded = [0]

    def on_hello(self, ident, msg, host=""):  # right after the first Hello: outsiders' Hellos evict its handshake
        real_on_hello(self, ident, msg, host)
        if not flooded[0]:
            flooded[0] = 1
            for i in range(handshake.MAX_PENDING):  # from as many hosts: the per-host share does not apply
                real_on_hello(self, b"outsider-%d" % i, proto.Hello(v=proto.VERSION, nonce_d=b"X" * 16,
                                                                      compat_hash="0" * 64), f"10.0.0.{i}")

    monkeypatch.setattr(handshake.SideChannelServer, "_on_hello", on_hello)
    st = stage(src, "p1", 4096, 0)
    sink = sinks()
    loc = sink.pool.alloc_request("d1", 4096, 0)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
    (ev,) = collect(sink, 1)
    assert ev.ok, ev.error
    assert torch.equal(loc.anchor, st.anchor)
    assert sink.stats()["handshakes_retried"] == 1 and src.stats()["refused"] == 1

def test_one_host_flooding_hellos_cannot_push_out_another_host_handshake(src: TransferSource, sinks,
                                                                        monkeypatch) -> None:
    """Outsiders on one host (127.0.0.2) keep Hellos coming from more connections than P keeps handshakes for.
    Before, every handshake of a real D (127.0.0.1) was pushed out before its Auth came, so its pull failed after
    AUTH_RETRIES, blaming the key. Each host now holds at most MAX_PENDING_PER_HOST of them: D's survives."""
    import threading

    from lynx_connector.transport import handshake

    monkeypatch.setattr(handshake, "MAX_PENDING", 16)
    monkeypatch.setattr(handshake, "MAX_PENDING_PER_HOST", 4)
    stop = threading.Event()
    hello = proto.encode(proto.Hello(v=proto.VERSION, nonce_d=b"X" * 16, compat_hash="0" * 64))

    def flood() -> None:
        ctx = zmq.Context()
        socks = []
        for _ in range(48):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect("tcp://127.0.0.2:0;{}:{}".format(*src.address))
            socks.append(sock)
        while not stop.is_set():
            for sock in socks:
                try:
                    sock.send(hello, zmq.NOBLOCK)
                    while sock.poll(0):
                        sock.recv()
                except zmq.Again:
                    pass
            time.sleep(0.001)
        for sock in socks:
            sock.close()
        ctx.term()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(0.3)  # the flood is on
        st = stage(src, "p1", 4096, 0)
        sink = sinks(timeout_s=5.0)
        loc = sink.pool.alloc_request("d1", 4096, 0)
        sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
        (ev,) = collect(sink, 1, timeout=8.0)
    finally:
        stop.set()
        flooder.join(5)
    assert ev.ok, ev.error
    assert torch.equal(loc.anchor, st.anchor)


def test_wrong_key_d_fails_the_handshake_naming_the_key(src: TransferSource, sinks) -> None:
    stage(src, "p1", 4096, 0)
    hellos: list[int] = []
    real_on_hello = src._on_hello
    src._on_hello = lambda *a, **k: (hellos.append(1), real_on_hello(*a, **k))[1]  # type: ignore[method-assign]
    for key in (OTHER_KEY, None):  # another deployment's key, or insecure on D only
        sink = sinks(key)
        loc = sink.pool.alloc_request("d1", 4096, 0)
        sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
        (ev,) = collect(sink, 1)
        assert not ev.ok and "LYNX_SIDE_CHANNEL_KEY_FILE" in ev.error and "LYNX_SIDE_CHANNEL_KEY" in ev.error
        assert "key" in ev.error and sink.stats()["peers"] == 0
        # final: D owes that P no Done (it re-handshook to send one at 0.5, 1.5, 3.5... s until the lease, four
        # handshakes each); P's lease frees its staging
        seen = len(hellos)
        time.sleep(1.8)
        assert len(hellos) == seen
    assert src.stats()["regions_live"] == 1 and src.stats()["sessions"] == 0


def test_dones_owed_to_a_p_that_kept_refusing_are_sent_after_a_hold(src: TransferSource, sinks, monkeypatch) -> None:
    """P dropped D's pending handshake four times (a flood of Hellos from others), then the flood ended: D cannot
    tell that from a key or layout that differ, so its pull fails, but the Done it owes stays owed and is sent
    once the hold (REFUSED_HOLD_S) ends: P frees the staging then, not at its lease."""
    from lynx_connector.transport import replies

    monkeypatch.setattr(replies, "REFUSED_HOLD_S", 1.0)
    stage(src, "p1", 4096, 0)
    refusals = [0]
    real = src._handle_sealed

    def flooded(ident, frame):
        if ident not in src._sessions and refusals[0] < 4 and src._pending.get(ident) is not None:
            refusals[0] += 1
            src._pending.pop(ident)  # pushed out by a flood of Hellos
        return real(ident, frame)

    src._handle_sealed = flooded  # type: ignore[method-assign]
    sink = sinks()
    loc = sink.pool.alloc_request("d1", 4096, 0)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
    (ev,) = collect(sink, 1)
    assert not ev.ok and "key" in ev.error and refusals[0] == 4
    time.sleep(0.6)
    assert src.stats()["regions_live"] == 1  # held: no handshake meanwhile
    wait_for(lambda: src.stats()["freed_done"] == 1, timeout=5)  # lease_s is 30 s
    assert src.stats()["regions_live"] == 0


def test_stranger_knowing_the_id_but_not_the_token(src: TransferSource, sinks) -> None:
    """v1: the request id was the only credential (Query an existence oracle, anyone's Done freed it)."""
    stage(src, "p1", 4096, 4096)
    tid, token = src.ticket("p1")
    raw = Raw(src.address)
    try:
        assert isinstance(raw.handshake(TEST_KEY), proto.HelloOk)  # even an authenticated peer
        wrong = raw.sealed(proto.Query(v=proto.VERSION, transfer_id=tid, token="0" * 32))
        missing = raw.sealed(proto.Query(v=proto.VERSION, transfer_id="f" * 32, token="0" * 32))
        assert isinstance(wrong, proto.Error) and wrong.code == "unknown_request"
        assert (wrong.code, wrong.message) == (missing.code, missing.message)  # the same answer
        done = raw.sealed(proto.Done(v=proto.VERSION, transfer_id=tid, token="0" * 32))
        assert isinstance(done, proto.Error) and done.code == "unknown_request"
        # counted apart (the answers are the same): a held id with a wrong token is someone else's ticket; an id
        # P does not hold is also what a concurrent-flow D asks before P has the request
        assert (src.counters["wrong_ticket"], src.counters["unknown_request"]) == (2, 1)
    finally:
        raw.close()
    assert src.stats()["regions_live"] == 2 and src.stats()["freed_done"] == 0  # staging not freed
    # NIXL notifications: the v1 form and a wrong token free nothing; the right one does
    pnixl: FakeNixlWrapper = src._nixl  # type: ignore[assignment]
    pnixl.notifs = {"D9": [f"done:{tid}".encode(), f"done:{tid}:{'0' * 32}".encode(), b"done:p1"]}
    wait_for(lambda: src.stats()["bad_notif"] == 3)
    assert src.stats()["regions_live"] == 2
    sink = sinks()
    loc = sink.pool.alloc_request("d1", 4096, 4096)
    sink.pull("d1", *src.address, tid, token, loc.anchor, loc.residual)
    assert all(e.ok for e in collect(sink, 2))  # the owner is served as ever
    wait_for(lambda: src.stats()["regions_live"] == 0)
    stage(src, "p2", 4096, 0)
    tid2, token2 = src.ticket("p2")
    pnixl.notifs = {"D9": [f"done:{tid2}:{token2}".encode()]}
    wait_for(lambda: src.stats()["regions_live"] == 0)


def test_second_session_cannot_steal_an_owned_transfer(src: TransferSource, sinks) -> None:
    """Done is bound to the peer that pulled: another authenticated session holding the token is refused."""
    st = stage(src, "p1", 4096, 65536)
    tid, token = src.ticket("p1")
    owner = sinks()
    dnixl: FakeNixlWrapper = owner._nixl  # type: ignore[assignment]
    dnixl.hang = True  # the owner's READ is in flight
    loc = owner.pool.alloc_request("d1", 4096, 65536)
    owner.pull("d1", *src.address, tid, token, loc.anchor, loc.residual)
    wait_for(lambda: src.stats()["served_queries"] == 1)
    thief = Raw(src.address)
    try:
        assert isinstance(thief.handshake(TEST_KEY), proto.HelloOk)
        for msg in (proto.Query(v=proto.VERSION, transfer_id=tid, token=token), proto.Done(v=proto.VERSION, transfer_id=tid, token=token)):
            reply = thief.sealed(msg)
            assert isinstance(reply, proto.Error) and reply.code == "unknown_request"
    finally:
        thief.close()
    assert src.stats()["regions_live"] == 2
    dnixl.hang = False
    assert all(e.ok for e in collect(owner, 2))
    assert torch.equal(loc.residual, st.residual)
    wait_for(lambda: src.stats()["regions_live"] == 0)  # the owner's Done frees it


def test_tampered_and_replayed_frames_are_dropped(src: TransferSource) -> None:
    stage(src, "p1", 4096, 0)
    tid, token = src.ticket("p1")
    raw = Raw(src.address)
    try:
        assert isinstance(raw.handshake(TEST_KEY), proto.HelloOk)
        query = raw.seal(proto.Query(v=proto.VERSION, transfer_id=tid, token=token))
        raw.sock.send(query)
        verdict, _ = raw.opener.open(raw.sock.recv())
        assert verdict == "ok"
        raw.sock.setsockopt(zmq.RCVTIMEO, 300)
        tampered = bytearray(raw.seal(proto.Done(v=proto.VERSION, transfer_id=tid, token=token)))
        tampered[5] ^= 0x40
        for frame in (query, bytes(tampered)):  # a replay of the Query, a flipped bit in a Done
            raw.sock.send(frame)
            with pytest.raises(zmq.Again):
                raw.sock.recv()
    finally:
        raw.close()
    stats = src.stats()
    assert stats["replayed"] == 1 and stats["bad_mac"] == 1 and stats["regions_live"] == 1


def test_oversized_frames_capped_and_bad_frame_logs_rate_limited(src: TransferSource, caplog) -> None:
    assert src.config.max_message_bytes == 64 << 10
    raw = Raw(src.address)
    caplog.set_level(logging.WARNING)
    try:
        for _ in range(5):
            assert refused(raw.plain(b"\x92" + b"x" * (100 << 10)))
        raw.sock.send(b"\x92" + b"x" * (200 << 10))  # over zmq's MAXMSGSIZE: the connection is dropped
    finally:
        raw.close()
    lines = [r.getMessage() for r in caplog.records if "side channel" in r.getMessage()]
    assert src.stats()["malformed"] == 5 and 1 <= len(lines) <= 2 and all(len(x) <= 220 for x in lines)
    assert src.stats()["logs_suppressed"] >= 3


def test_reconnect_runs_the_handshake_again_and_keeps_ownership(src: TransferSource, sinks) -> None:
    """Issue 13's reconnect stays: a fresh socket runs the full handshake and resumes the session, so the
    transfers this D owns stay its own."""
    stage(src, "p1", 4096, 0)
    sink = sinks(resend_s=0.2, reconnect_s=0.5)
    loc = sink.pool.alloc_request("d1", 4096, 0)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, None)
    assert all(e.ok for e in collect(sink, 1))
    # D's Done for p1 reaches P first: one arriving after P forgot the session is refused, and the new session
    # cannot prove it owns p1 (P kept no record of the old one), so p1 would wait for its lease
    wait_for(lambda: src.stats()["regions_live"] == 0)
    src._sessions.clear()  # P forgets every session (as if it dropped ours)
    stage(src, "p2", 4096, 0)
    loc2 = sink.pool.alloc_request("d2", 4096, 0)
    sink.pull("d2", *src.address, *src.ticket("p2"), loc2.anchor, None)
    assert all(e.ok for e in collect(sink, 1, timeout=5.0))
    assert sink.stats()["sessions_lost"] == 1 and sink.stats()["handshakes"] == 2
    wait_for(lambda: src.stats()["regions_live"] == 0)


def test_insecure_mode_works_and_warns(fabric: FakeFabric, caplog) -> None:
    caplog.set_level(logging.WARNING)
    assert load_side_channel_key(insecure=True, environ={}) is None
    assert any("insecure_side_channel" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert LynxConfig.from_extra_config({"insecure_side_channel": "true"}).insecure_side_channel is True
    cfg = TransportConfig(**CFG, key=None)
    s = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    d = TransferSink(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "D"))
    try:
        st = stage(s, "p1", 4096, 0)
        loc = d.pool.alloc_request("d1", 4096, 0)
        d.pull("d1", *s.address, *s.ticket("p1"), loc.anchor, None)
        (ev,) = collect(d, 1)
        assert ev.ok and torch.equal(loc.anchor, st.anchor)
    finally:
        d.close()
        s.close()


def test_missing_short_or_malformed_key_is_a_clear_start_up_error(tmp_path) -> None:
    for env in ({}, {KEY_ENV: "ab" * 16 + "zz"}, {KEY_ENV: "ab" * 31}, {KEY_FILE_ENV: str(tmp_path / "nope")}):
        with pytest.raises(SideChannelKeyError) as err:
            load_side_channel_key(environ=env)
        assert KEY_ENV in str(err.value) and KEY_FILE_ENV in str(err.value)
        assert "insecure_side_channel" in str(err.value)
    env_key, file_key = bytes(range(32)), bytes(range(100, 132))
    assert load_side_channel_key(environ={KEY_ENV: env_key.hex()}) == env_key
    (tmp_path / "key").write_text(file_key.hex() + "\n")
    (tmp_path / "raw").write_bytes(bytes(range(200, 240)))
    env = {KEY_FILE_ENV: str(tmp_path / "key"), KEY_ENV: env_key.hex()}  # the file wins
    assert load_side_channel_key(environ=env) == file_key
    assert load_side_channel_key(environ={KEY_FILE_ENV: str(tmp_path / "raw")}) == bytes(range(200, 240))
    (tmp_path / "short").write_bytes(b"0123")
    with pytest.raises(SideChannelKeyError, match="at least 32"):
        load_side_channel_key(environ={KEY_FILE_ENV: str(tmp_path / "short")})
    with pytest.raises(ValueError, match="key"):
        TransportConfig(key=b"short")



@pytest.mark.parametrize("placeholder", ["00" * 32, "ab" * 32, "0123" * 16, " " * 40, "\n" * 40, "x" * 32])
def test_a_placeholder_key_is_refused(tmp_path, placeholder) -> None:
    """A key file of blanks, or a key of zeros or one repeated pattern, was accepted as the deployment key: anyone
    could sign params and pass the handshake with it. The error names where the key came from, never the key."""
    (tmp_path / "key").write_bytes(placeholder.encode())
    with pytest.raises(SideChannelKeyError, match="distinct values: a placeholder") as err:
        load_side_channel_key(environ={KEY_FILE_ENV: str(tmp_path / "key")})
    assert str(tmp_path / "key") in str(err.value)
    if placeholder.strip() and all(c in "0123456789abcdef" for c in placeholder):
        with pytest.raises(SideChannelKeyError, match=f"{KEY_ENV}: key's 32 bytes take only"):
            load_side_channel_key(environ={KEY_ENV: placeholder})


def test_a_key_file_of_hex_text_is_read_as_the_variable_reads_it(tmp_path) -> None:
    """``xxd -p`` wraps hex at 60 digits a line, and a key is often written with ``0x``: the file gives the same key
    as the same text in LYNX_SIDE_CHANNEL_KEY (it was taken as 66 raw bytes: P and D then disagreed on the key)."""
    key = bytes(range(32))
    wrapped = key.hex()[:60] + "\n" + key.hex()[60:] + "\n"
    for text in (wrapped, "0x" + key.hex(), "  " + key.hex().upper() + "\r\n", " ".join(f"{b:02x}" for b in key)):
        (tmp_path / "key").write_text(text)
        assert load_side_channel_key(environ={KEY_FILE_ENV: str(tmp_path / "key")}) == key, text
        assert load_side_channel_key(environ={KEY_ENV: text}) == key, text
    (tmp_path / "key").write_text(key.hex()[:-1] + "\n")
    with pytest.raises(SideChannelKeyError, match="odd number"):
        load_side_channel_key(environ={KEY_FILE_ENV: str(tmp_path / "key")})
    passphrase = "Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFy\n"  # not hex: the file's bytes are the key
    (tmp_path / "key").write_text(passphrase)
    assert load_side_channel_key(environ={KEY_FILE_ENV: str(tmp_path / "key")}) == passphrase.encode()


def test_a_failing_nixl_progress_is_one_warning_not_one_per_pump(src: TransferSource, caplog, monkeypatch) -> None:
    """P pumps NIXL every target_progress_s (5 ms) while a request is published: a progress() that keeps failing
    logged a warning at every pump (about 190 a second)."""
    def broken() -> dict:
        raise RuntimeError("agent gone")

    monkeypatch.setattr(src._nixl, "progress", broken)
    caplog.set_level(logging.WARNING)
    st = src.alloc("p1", 4096, 0)
    src.publish("p1")
    time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if "NIXL progress failed" in r.getMessage()]
    assert len(lines) == 1 and "agent gone" in lines[0], len(lines)
    assert src._nixl_log.suppressed > 10 and src.stats()["logs_suppressed"] == 0  # not the side channel's
    del st


def test_an_unsealed_error_inside_a_session_is_ignored(src: TransferSource, sinks, monkeypatch) -> None:
    """P answers a session only with sealed frames (or a plain "refused" when it lost the session). Before, any
    other plain Error reaching D in a session (an on-path injection: no key needed) failed every pull of the
    peer, reads in flight included, and D's Dones freed P's staging. Now it is ignored and counted."""
    real = src._reply_sealed
    injected = [0]

    def reply(ident, sess, msg, **kw):  # P's real answer, then a forged plain Error on the same connection
        ok = real(ident, sess, msg, **kw)
        if isinstance(msg, proto.Regions) and not injected[0]:
            injected[0] = 1
            src._reply_plain(ident, proto.Error(v=proto.VERSION, code="boom", message="forged"))
        return ok

    monkeypatch.setattr(src, "_reply_sealed", reply)
    st = stage(src, "p1", 200_000, 100_000)
    sink = sinks(link_gbps=0.02)  # reads in flight when the forged Error arrives
    loc = sink.pool.alloc_request("d1", 200_000, 100_000)
    sink.pull("d1", *src.address, *src.ticket("p1"), loc.anchor, loc.residual)
    evs = collect(sink, 2, timeout=10.0)
    assert all(e.ok for e in evs), [e.error for e in evs]
    assert torch.equal(loc.anchor, st.anchor) and torch.equal(loc.residual, st.residual)
    assert injected[0] == 1 and sink.stats()["unsealed_ignored"] == 1


def test_max_message_bytes_must_hold_a_full_keepalive() -> None:
    """P with a small max_message_bytes refused D's KeepAlives (a plain "refused" D took for a lost session, or a
    dropped connection): D reconnected every quarter lease and pulls outlasting the lease failed. The bound is
    a config error now, and a sealed KeepAlive of MAX_KEEPALIVE tickets fits it."""
    with pytest.raises(ValueError, match="max_message_bytes .*4096.*KeepAlive"):
        TransportConfig(max_message_bytes=4096)
    TransportConfig(max_message_bytes=proto.MIN_MESSAGE_BYTES)
    tickets = [("a" * 32, "b" * 32)] * proto.MAX_KEEPALIVE
    frame = proto.seal(b"k" * 32, proto.D_TO_P, 2**63 - 1,
                       proto.encode(proto.KeepAlive(v=proto.VERSION, tickets=tickets)))
    assert len(frame) <= proto.MIN_MESSAGE_BYTES


def test_pending_handshakes_drop_the_oldest_of_the_host_then_of_all(monkeypatch) -> None:
    from lynx_connector.transport import handshake

    monkeypatch.setattr(handshake, "MAX_PENDING", 4)
    monkeypatch.setattr(handshake, "MAX_PENDING_PER_HOST", 2)
    table = handshake.PendingHandshakes()

    def add(ident: bytes, host: str, expires: float = 100.0) -> None:
        table.add(ident, handshake.Pending(b"n" * 16, b"p" * 16, b"c", expires, host))

    add(b"a1", "A")
    add(b"b1", "B", expires=5.0)
    add(b"a2", "A")
    add(b"a3", "A")  # A's share is full: A's oldest (a1) goes, not B's
    assert [i for i in (b"a1", b"b1", b"a2", b"a3") if i in table] == [b"b1", b"a2", b"a3"]
    add(b"c1", "C")
    add(b"d1", "D")  # the table is full: the oldest of all (b1) goes
    assert b"b1" not in table and len(table) == 4
    add(b"a3", "A")  # the same identity again replaces its own entry
    assert len(table) == 4 and table.get(b"a3") is not None
    table.expire(200.0)
    assert len(table) == 0 and table._by_host == {}
    add(b"x", "A")
    assert table.pop(b"x") is not None and table.pop(b"x") is None and table._by_host == {}


def test_key_rotation_d_accepts_a_p_proving_its_extra_key(fabric: FakeFabric, sinks) -> None:
    """Rotating the deployment key (docs/OPERATIONS.md): a D that also accepts the other key (extra_keys) pulls
    from a P that proves either, speaking with each P the key that P proved, at the same time; a D without it is
    refused by the P of the other key."""
    old_p = TransferSource(TransportConfig(**CFG, key=TEST_KEY), COMPAT, nixl=FakeNixlWrapper(fabric, "Pold"))
    new_p = TransferSource(TransportConfig(**CFG, key=OTHER_KEY), COMPAT, nixl=FakeNixlWrapper(fabric, "Pnew"))
    try:
        rotating = sinks(OTHER_KEY, extra_keys=(TEST_KEY,))
        for i, p in enumerate((old_p, new_p, old_p)):  # both at once, and back: each peer keeps its own key
            st = stage(p, f"r{i}", 4096, 4096)
            loc = rotating.pool.alloc_request(f"d{i}", 4096, 4096)
            rotating.pull(f"d{i}", *p.address, *p.ticket(f"r{i}"), loc.anchor, loc.residual)
            evs = collect(rotating, 2)
            assert all(e.ok for e in evs), evs
            assert torch.equal(loc.anchor, st.anchor) and torch.equal(loc.residual, st.residual)
            rotating.pool.free_request(f"d{i}")
        assert rotating.stats()["peers"] == 2
        assert {link.addr: link.extra_key for link in rotating._peers.values()} == {old_p.address: True,
                                                                                   new_p.address: False}
        for d_key, p in ((OTHER_KEY, old_p), (TEST_KEY, new_p)):  # D without the extra key: refused as before
            plain = sinks(d_key)
            stage(p, f"x{id(plain)}", 4096, 0)
            loc = plain.pool.alloc_request("x", 4096, 0)
            plain.pull("x", *p.address, *p.ticket(f"x{id(plain)}"), loc.anchor, None)
            (ev,) = collect(plain, 1)
            assert not ev.ok and "LYNX_SIDE_CHANNEL_KEY" in ev.error
    finally:
        old_p.close()
        new_p.close()
    with pytest.raises(ValueError, match="extra_keys"):
        TransportConfig(key=TEST_KEY, extra_keys=(b"short",))


def test_extra_key_is_read_like_the_key_and_off_in_insecure_mode(tmp_path) -> None:
    assert load_extra_keys(environ={}) == ()
    ab, cd = bytes(range(32)), bytes(range(64, 96))
    assert load_extra_keys(environ={EXTRA_KEY_ENV: ab.hex()}) == (ab,)
    (tmp_path / "next").write_text("0x" + cd.hex() + "\n")
    env = {EXTRA_KEY_FILE_ENV: str(tmp_path / "next"), EXTRA_KEY_ENV: ab.hex()}  # the file wins
    assert load_extra_keys(environ=env) == (cd,)
    assert load_extra_keys(insecure=True, environ=env) == ()
    for bad in ({EXTRA_KEY_ENV: ab.hex()[:-2]}, {EXTRA_KEY_ENV: "zz" * 32}, {EXTRA_KEY_FILE_ENV: str(tmp_path / "nope")}):
        with pytest.raises(SideChannelKeyError, match="LYNX_SIDE_CHANNEL_EXTRA_KEY"):
            load_extra_keys(environ=bad)
    # the deployment key is still required: an extra key alone is no key
    with pytest.raises(SideChannelKeyError, match="no side-channel key"):
        load_side_channel_key(environ={EXTRA_KEY_ENV: ab.hex()})
