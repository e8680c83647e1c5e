"""Wire protocol validation, compat hashing and the token bucket."""

from __future__ import annotations

import pytest

from lynx_connector.transport import protocol as proto
from lynx_connector.transport.pacing import TokenBucket

pytestmark = pytest.mark.timeout(30)


def test_roundtrip_every_message() -> None:
    msgs = [
        proto.Hello(v=1, compat={"model": "m", "layers": 30, "codec_version": 1.5, "fp": True, "x": None}),
        proto.HelloOk(v=1, agent_name="a", agent_md=b"\x00md", pool_addr=1, pool_nbytes=2, compat_hash="0" * 64),
        proto.Query(v=1, req_id="r"),
        proto.Regions(v=1, req_id="r", anchor_offset=0, anchor_nbytes=4, residual_offset=-1, residual_nbytes=0),
        proto.NotReady(v=1, req_id="r"),
        proto.Done(v=1, req_id="r"),
        proto.Ack(v=1, req_id="r"),
        proto.Error(v=1, code="c", message="m"),
    ]
    for m in msgs:
        assert proto.decode(proto.encode(m), 1 << 20) == m


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"\xc1", "malformed"),
        (b"\x81\xa4type\xa5query", "malformed"),  # missing fields
        (proto.encode(proto.Query(v=7, req_id="r")), "version"),
        (b"\x83\xa4type\xa5query\xa1v\x01\xa6req_id\x05", "malformed"),  # wrong type
        (b"\x83\xa4type\xa4evil\xa1v\x01\xa6req_id\xa1r", "malformed"),  # unknown tag
        (b"\x84\xa4type\xa5query\xa1v\x01\xa6req_id\xa1r\xa1z\x01", "malformed"),  # unknown field
        (b"x" * 2000, "exceeds"),
    ],
)
def test_decode_rejects(frame: bytes, needle: str) -> None:
    with pytest.raises(proto.ProtocolError, match=needle):
        proto.decode(frame, 1000)


def test_decode_range_checks() -> None:
    bad = proto.encode(proto.Regions(v=1, req_id="r", anchor_offset=0, anchor_nbytes=4,
                                     residual_offset=-1, residual_nbytes=0)).replace(b"\xff", b"\xfe")
    with pytest.raises(proto.ProtocolError):  # residual_offset -2 is out of range
        proto.decode(bad, 1000)
    with pytest.raises(proto.ProtocolError):
        proto.decode(proto.encode(proto.Query(v=1, req_id="r" * 600)), 10_000)


def test_compat_hash_and_diff() -> None:
    a = {"model": "smollm2", "layers": 30, "codec": "lynx"}
    assert proto.compat_hash(a) == proto.compat_hash(dict(reversed(list(a.items()))))
    b = {**a, "layers": 32, "dtype": "bf16"}
    diff = proto.compat_diff(a, b)
    assert diff == ["dtype: ours=<missing> theirs='bf16'", "layers: ours=30 theirs=32"]
    assert proto.compat_hash(a) != proto.compat_hash(b)


def test_token_bucket_math() -> None:
    tb = TokenBucket(rate=1000.0, capacity=500.0, initial=100.0, now=0.0)
    assert tb.consume(100, 0.0)
    assert tb.wait_time(100, 0.0) == pytest.approx(0.1)
    assert not tb.consume(100, 0.05)
    assert tb.consume(100, 0.1)
    assert tb.wait_time(500, 10.0) == 0.0  # refilled, capped at capacity
    tb.consume(500, 10.0)
    assert tb.wait_time(2000, 10.0) == pytest.approx(0.5)  # larger than capacity: needs a full bucket


def test_token_bucket_sustained_rate() -> None:
    """Posting N bytes in chunks as soon as allowed takes (N - initial) / rate."""
    tb = TokenBucket(rate=1e6, capacity=5e4, initial=1e4, now=0.0)
    now, sent = 0.0, 0
    while sent < 1_000_000:
        w = tb.wait_time(10_000, now)
        now += w
        assert tb.consume(10_000, now)
        sent += 10_000
    assert now == pytest.approx((1_000_000 - 10_000) / 1e6)
