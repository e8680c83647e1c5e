"""Wire protocol validation, compat hashing and the token bucket."""

from __future__ import annotations

import pytest

from lynx_connector.transport import protocol as proto
from lynx_connector.transport.pacing import VirtualLink

pytestmark = pytest.mark.timeout(30)


TID, TOK = "a" * 32, "b" * 32


def test_roundtrip_every_message() -> None:
    msgs = [
        proto.Hello(v=proto.VERSION, nonce_d=b"n" * 16, compat_hash="0" * 64),
        proto.Challenge(v=proto.VERSION, nonce_p=b"p" * 16, proof_p=b"x" * 32),
        proto.Auth(v=proto.VERSION, proof_d=b"y" * 32, compat={"model": "m", "layers": 30, "codec_version": 1.5, "fp": True,
                                                   "x": None}, resume=b"s" * 16),
        proto.HelloOk(v=proto.VERSION, agent_name="a", agent_md=b"\x00md", pool_addr=1, pool_nbytes=2, compat_hash="0" * 64,
                      session_id=b"s" * 16, lease_s=60.0),
        proto.Query(v=proto.VERSION, transfer_id=TID, token=TOK),
        proto.Regions(v=proto.VERSION, transfer_id=TID, anchor_offset=0, anchor_nbytes=4, residual_offset=-1, residual_nbytes=0,
                      generation=7),
        proto.Regions(v=proto.VERSION, transfer_id=TID, anchor_offset=0, anchor_nbytes=4, residual_offset=8,
                      residual_nbytes=4, generation=7, mode="speculative", auto_reason="slow_link_no_speculation"),
        proto.NotReady(v=proto.VERSION, transfer_id=TID),
        proto.Done(v=proto.VERSION, transfer_id=TID, token=TOK),
        proto.KeepAlive(v=proto.VERSION, tickets=[(TID, TOK)]),
        proto.Alive(v=proto.VERSION, gone=[TID]),
        proto.Ack(v=proto.VERSION, transfer_id=TID),
        proto.Error(v=proto.VERSION, code="c", message="m"),
    ]
    for m in msgs:
        assert proto.decode(proto.encode(m), 1 << 20) == m


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"\xc1", "malformed"),
        (b"\x81\xa4type\xa5query", "malformed"),  # missing fields
        (proto.encode(proto.Query(v=7, transfer_id=TID, token=TOK)), "version"),
        (b"\x83\xa4type\xa5hello\xa1v\x01\xa6compat\x80", "version 1"),  # a v1 Hello
        (b"\x84\xa4type\xa5query\xa1v\x04\xabtransfer_id\x05\xa5token\x05", "malformed"),  # wrong type
        (b"\x83\xa4type\xa4evil\xa1v\x04\xa6req_id\xa1r", "malformed"),  # unknown tag
        (b"\x84\xa4type\xa5query\xa1v\x02\xabtransfer_id\xa1a\xa5token\xa1b", "version 2"),  # a v2 peer
        (proto.encode(proto.Done(v=3, transfer_id=TID, token=TOK)), "version 3"),  # v3: its Done has no link_s
        (proto.encode(proto.Query(v=proto.VERSION, transfer_id=TID, token=TOK))[:-1] + b"\x01", "malformed"),
        (b"x" * 2000, "exceeds"),
    ],
)
def test_decode_rejects(frame: bytes, needle: str) -> None:
    with pytest.raises(proto.ProtocolError, match=needle):
        proto.decode(frame, 1000)


def test_regions_mode_names_are_bounded() -> None:
    """v3: the mode P names in Regions is a short [a-z0-9_] name; anything else is a malformed frame."""
    ok = proto.Regions(v=proto.VERSION, transfer_id=TID, anchor_offset=0, anchor_nbytes=4, residual_offset=-1,
                       residual_nbytes=0, generation=1, mode="bf16")
    assert proto.decode(proto.encode(ok), 1000).mode == "bf16"
    for bad in ("BF16", "bf-16", "x" * 33):
        frame = proto.encode(ok).replace(b"\xa4bf16", proto.msgspec.msgpack.encode(bad))
        with pytest.raises(proto.ProtocolError, match="malformed"):
            proto.decode(frame, 1000)


def test_done_link_time_is_bounded() -> None:
    """v4: Done's link_s (D's measured link time, P's link meter) is a finite number of seconds >= 0."""
    ok = proto.Done(v=proto.VERSION, transfer_id=TID, token=TOK, link_s=0.25, link_bytes=1 << 20)
    assert proto.decode(proto.encode(ok), 1000) == ok
    assert proto.decode(proto.encode(proto.Done(v=proto.VERSION, transfer_id=TID, token=TOK)), 1000).link_s == 0.0
    for bad in (-1.0, float("nan"), float("inf"), 2e6):
        frame = proto.encode(ok).replace(proto.msgspec.msgpack.encode(0.25), proto.msgspec.msgpack.encode(bad))
        with pytest.raises(proto.ProtocolError, match="malformed"):
            proto.decode(frame, 1000)


def test_decode_range_checks() -> None:
    bad = proto.encode(proto.Regions(v=proto.VERSION, transfer_id=TID, anchor_offset=0, anchor_nbytes=4,
                                     residual_offset=-1, residual_nbytes=0, generation=1)).replace(b"\xff", b"\xfe")
    with pytest.raises(proto.ProtocolError):  # residual_offset -2 is out of range
        proto.decode(bad, 1000)
    for tid in ("A" * 32, "a" * 31, "g" * 32, "a" * 33):  # transfer ids and tokens: 32 lower-case hex
        frame = proto.encode(proto.Query(v=proto.VERSION, transfer_id=TID, token=TOK)).replace(TID.encode(), tid.encode())
        with pytest.raises(proto.ProtocolError):
            proto.decode(frame, 10_000)


def test_sealed_frames_mac_and_seq() -> None:
    key = proto.session_key(b"k" * 32, b"n" * 16, b"p" * 16)
    frame = proto.seal(key, proto.D_TO_P, 1, b"payload")
    op = proto.Opener(key, proto.D_TO_P)
    assert op.open(frame) == ("ok", b"payload")
    assert op.open(frame) == ("replayed", b"")  # the same seq again
    assert op.open(proto.seal(key, proto.D_TO_P, 1, b"other"))[0] == "replayed"
    flipped = bytearray(proto.seal(key, proto.D_TO_P, 2, b"payload"))
    flipped[3] ^= 1
    assert op.open(bytes(flipped))[0] == "bad_mac"
    assert op.open(proto.seal(key, proto.P_TO_D, 3, b"payload"))[0] == "bad_mac"  # reflected direction
    assert op.open(proto.seal(b"z" * 32, proto.D_TO_P, 4, b"payload"))[0] == "bad_mac"
    assert op.open(proto.seal(key, proto.D_TO_P, 9, b"late")) == ("ok", b"late")
    k = b"k" * 32
    assert proto.proof_p(k, b"1" * 16, b"2" * 16) != proto.proof_d(k, b"1" * 16, b"2" * 16)


def test_compat_hash_and_diff() -> None:
    a = {"model": "smollm2", "layers": 30, "codec": "lynx"}
    assert proto.compat_hash(a) == proto.compat_hash(dict(reversed(list(a.items()))))
    b = {**a, "layers": 32, "dtype": "bf16"}
    diff = proto.compat_diff(a, b)
    assert diff == ["dtype: ours=<missing> theirs='bf16'", "layers: ours=30 theirs=32"]
    assert proto.compat_hash(a) != proto.compat_hash(b)
    # a later field a D of an earlier release lacks is skipped; one it sends is compared; P lacking one is a diff
    later = {**a, "rope": "r1", "model_revision": "x"}
    assert proto.compat_diff(later, a, optional=proto.LATER_COMPAT_FIELDS) == []
    assert proto.compat_diff(later, {**a, "rope": "r2"}, optional=proto.LATER_COMPAT_FIELDS) == [
        "rope: ours='r1' theirs='r2'"]
    assert proto.compat_diff(a, later, optional=proto.LATER_COMPAT_FIELDS) == [
        "model_revision: ours=<missing> theirs='x'", "rope: ours=<missing> theirs='r1'"]
    assert proto.compat_diff(later, a) != []  # without the allowance, as a P of an earlier release compares
    assert proto.compat_hash_for(later, a) == proto.compat_hash(a)
    assert proto.compat_hash_for(later, later) == proto.compat_hash(later)


def test_virtual_link_math() -> None:
    link = VirtualLink(rate=1000.0, catch_up_s=0.01)
    assert link.wait_time(0.0) == 0.0
    assert link.reserve(100, 0.0) == pytest.approx(0.1)  # an idle link has no credit: 100 bytes take 0.1 s
    assert link.wait_time(0.05) == pytest.approx(0.05)  # the next chunk waits until the link is free
    assert link.reserve(100, 0.105, backlogged=True) == pytest.approx(0.2)  # woke 5 ms late: starts at 0.1
    assert link.reserve(100, 0.25, backlogged=True) == pytest.approx(0.35)  # 50 ms late: the link did idle
    assert link.reserve(100, 0.36) == pytest.approx(0.46)  # not backlogged (nothing was waiting): no catch-up
    assert link.wait_time(10.0) == 0.0
    assert link.reserve(50, 10.0) == pytest.approx(10.05)  # a long idle gap stores no bandwidth
    with pytest.raises(ValueError):
        VirtualLink(rate=0.0, catch_up_s=0.01)


@pytest.mark.parametrize("rate, catch_up_s", [(float("inf"), 0.0), (float("nan"), 0.0), (1.0, -1.0),
                                              (1.0, float("nan"))])
def test_virtual_link_rejects_an_infinite_rate_and_a_negative_catch_up(rate: float, catch_up_s: float) -> None:
    """An infinite rate (every chunk due at once: no pacing at all) and a negative catch_up_s are configuration
    errors, not a link."""
    with pytest.raises(ValueError, match="virtual link"):
        VirtualLink(rate=rate, catch_up_s=catch_up_s)


def test_virtual_link_sustained_rate() -> None:
    """Posting N bytes in chunks as soon as allowed delivers the last byte at N / rate, never sooner; a thread that
    wakes late by less than catch_up_s loses nothing."""
    link = VirtualLink(rate=1e6, catch_up_s=0.005)
    now, sent, due = 0.0, 0, 0.0
    while sent < 1_000_000:
        now += link.wait_time(now) + (0.002 if sent else 0.0)  # every wake-up 2 ms late
        due = link.reserve(10_000, now, backlogged=sent > 0)
        sent += 10_000
    assert due == pytest.approx(1.0)
