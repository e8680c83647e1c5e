"""P's first token on the side channel (concurrent flow, docs/PROTOCOL.md section 6), real zmq side channel, fake
NIXL: P names it in every Regions answer once its worker knows it (``TransferSource.set_first_token``); a
speculative (``split``) pull of the concurrent flow keeps asking until it knows it, also once every byte is
readable, and reports it once (``TransferSink.first_tokens``); other pulls never ask; a value that is not a token
id is ignored and the pull is unaffected."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from lynx_connector.transport import protocol as proto
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.ranking import SPLIT, WHOLE
from lynx_connector.transport.sink import TransferSink
from lynx_connector.transport.source import TransferSource

from .fakes import TEST_KEY, FakeFabric, FakeNixlWrapper
from .test_transport_source_sink import COMPAT, collect, wait_for

pytestmark = pytest.mark.timeout(60)

A, R = 60_000, 120_000
TID, TOKEN = "ab" * 16, "cd" * 16  # minted by the proxy (concurrent flow)


@pytest.fixture
def trio(fabric: FakeFabric):
    cfg = TransportConfig(pool_bytes=1 << 22, chunk_bytes=16 << 10, timeout_s=3.0, lease_s=30.0, retry_s=0.005,
                          pipeline_poll_s=0.005, key=TEST_KEY)
    src = TransferSource(cfg, COMPAT, nixl=FakeNixlWrapper(fabric, "P"))
    d_nixl = FakeNixlWrapper(fabric, "D")
    sink = TransferSink(cfg, COMPAT, nixl=d_nixl)
    yield src, sink, d_nixl
    sink.close()
    src.close()


def _stage(src: TransferSource, residual: int = R) -> torch.Tensor:
    st = src.alloc("p", A, residual, transfer_id=TID, token=TOKEN)
    st.anchor.copy_(torch.randint(0, 256, (A,), dtype=torch.uint8))
    src.publish("p")
    return st


def _tokens(sink: TransferSink, timeout: float = 3.0) -> list[tuple[str, int]]:
    got: list[tuple[str, int]] = []
    wait_for(lambda: len(got.extend(sink.first_tokens()) or got) > 0, timeout)
    return got


def test_split_pull_learns_the_first_token_after_every_byte_is_readable(trio) -> None:
    src, sink, d_nixl = trio
    loc = sink.pool.alloc_request("d", A, R)
    d_nixl.hang = True  # D's READs stay in flight: the pull lives on after P published every layer
    sink.pull("d", *src.address, TID, TOKEN, loc.anchor, loc.residual, wait_s=5.0, order=SPLIT)
    st = _stage(src)  # whole: Regions names every byte readable, and no first token yet
    wait_for(lambda: src.stats()["served_queries"] >= 3)  # D keeps asking, every pipeline_poll_s
    assert sink.first_tokens() == []
    assert src.set_first_token(TID, 4242) is True
    assert _tokens(sink) == [("d", 4242)]
    n = src.stats()["served_queries"]
    time.sleep(0.1)
    assert src.stats()["served_queries"] == n and sink.first_tokens() == []  # reported once, asked no more
    d_nixl.hang = False
    evs = collect(sink, 2)
    assert all(e.ok for e in evs) and torch.equal(loc.anchor, st.anchor)
    assert sink.stats()["first_tokens"] == 1
    wait_for(lambda: src.stats()["requests_live"] == 0)  # D's Done freed P: the token did not hold the staging
    assert src.set_first_token(TID, 7) is False  # gone
    sink.pool.free_request("d")


def test_token_known_while_p_still_publishes_layers(trio) -> None:
    src, sink, _ = trio
    st = src.alloc("p", A, R, transfer_id=TID, token=TOKEN)
    src.publish_partial("p", A // 2, R // 2)
    src.set_first_token(TID, 17)  # (P's token comes a step after the prompt: in practice after the last layer)
    loc = sink.pool.alloc_request("d", A, R)
    sink.pull("d", *src.address, TID, TOKEN, loc.anchor, loc.residual, wait_s=5.0, order=SPLIT)
    assert _tokens(sink) == [("d", 17)]
    src.publish("p")
    evs = collect(sink, 2)
    assert all(e.ok for e in evs) and torch.equal(loc.residual, st.residual)
    sink.pool.free_request("d")


@pytest.mark.parametrize("flow", ["whole-order", "sequential"])
def test_other_pulls_never_ask_for_it(trio, flow) -> None:
    src, sink, d_nixl = trio
    _stage(src)
    loc = sink.pool.alloc_request("d", A, R)
    d_nixl.hang = True
    kw = {"wait_s": 5.0, "order": WHOLE} if flow == "whole-order" else {"order": SPLIT}
    sink.pull("d", *src.address, TID, TOKEN, loc.anchor, loc.residual, **kw)
    wait_for(lambda: src.stats()["served_queries"] >= 1)
    src.set_first_token(TID, 5)
    time.sleep(0.15)
    assert src.stats()["served_queries"] == 1 and sink.first_tokens() == []
    d_nixl.hang = False
    assert all(e.ok for e in collect(sink, 2))
    sink.pool.free_request("d")


def test_a_value_that_is_not_a_token_id_is_ignored(trio) -> None:
    src, sink, _ = trio
    with pytest.raises(ValueError, match="token id"):
        src.set_first_token(TID, -1)
    st = src.alloc("p", A, 0, transfer_id=TID, token=TOKEN)
    src.publish_partial("p", A // 2, 0)
    src._entries["p"].first_token = 1 << 40  # a P bug: the Regions frame is valid, the value is no token id
    loc = sink.pool.alloc_request("d", A, 0)
    sink.pull("d", *src.address, TID, TOKEN, loc.anchor, None, wait_s=5.0, order=SPLIT)
    wait_for(lambda: src.stats()["served_queries"] >= 2)
    src.publish("p")
    evs = collect(sink, 1)
    assert evs[0].ok and torch.equal(loc.anchor, st.anchor)  # the pull itself is unaffected
    assert sink.first_tokens() == [] and sink.stats()["first_tokens"] == 0
    sink.pool.free_request("d")


def test_regions_first_token_on_the_wire() -> None:
    msg = proto.Regions(v=proto.VERSION, transfer_id=TID, anchor_offset=0, anchor_nbytes=8, residual_offset=8,
                        residual_nbytes=8, generation=1)
    assert proto.decode(proto.encode(msg), 4096).first_token == -1  # not known yet (the default)
    with_tok = msgspec.structs.replace(msg, first_token=31999)
    assert proto.decode(proto.encode(with_tok), 4096).first_token == 31999
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(msg), "first_token": -2})
    with pytest.raises(proto.ProtocolError, match="malformed"):
        proto.decode(bad, 4096)
