"""P's save queue (lynx_connector/saving.py): a full staging pool makes requests wait in order, bounded, and the
KV blocks of a request are released only once it is resolved here AND finished in vLLM."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lynx_connector.metadata import SaveSpec
from lynx_connector.saving import SaveQueue
from lynx_connector.transport import TransferSource, TransportConfig
from tests.transport.fakes import FakeFabric, FakeNixlWrapper

POOL = 1 << 16


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def source() -> Iterator[TransferSource]:
    src = TransferSource(TransportConfig(pool_bytes=POOL), {"m": 1}, nixl=FakeNixlWrapper(FakeFabric(), "P"))
    yield src
    src.close()


def spec(req_id: str, n: int = 10) -> SaveSpec:
    return SaveSpec(req_id=req_id, block_ids=[0], num_tokens=n, mode="full")


def make(source: TransferSource, sizes: dict[str, int]):
    staged: list[str] = []
    rejected: list[str] = []

    def stage(s: SaveSpec) -> None:
        source.alloc(s.req_id, sizes[s.req_id], 0)  # raises StagingFullError when there is no room
        source.publish(s.req_id)
        staged.append(s.req_id)

    clock = Clock()
    return SaveQueue(source, stage, wait_s=5.0, on_reject=rejected.append, clock=clock), staged, rejected, clock


def test_waits_in_order_for_room_then_stages(source) -> None:
    q, staged, rejected, clock = make(source, {"a": 40000, "b": 30000, "c": 1000})
    for r in ("a", "b", "c"):
        q.submit(spec(r))
    # b does not fit next to a; c would, but waits behind b (arrival order: no starvation of large requests)
    assert staged == ["a"] and q.waiting == 2
    assert q.finished_sending({"a", "b", "c"}) == {"a"}  # b, c still hold their KV blocks on P
    source.abort("a")  # D's Done frees a's staging
    clock.t = 1.0
    q.retry()
    assert staged == ["a", "b", "c"] and q.waiting == 0 and not rejected
    assert q.finished_sending(set()) == {"b", "c"}  # finished earlier, reported once resolved
    assert q.finished_sending({"a", "b", "c"}) == set()  # exactly once


def test_gives_up_after_wait_s_and_tells_d_why(source) -> None:
    q, staged, rejected, clock = make(source, {"a": 60000, "b": 30000})
    q.submit(spec("a"))
    q.submit(spec("b"))
    tid = source.ticket("b")[0]  # D knows b by its transfer id (and token)
    clock.t = 4.9
    q.retry()
    assert q.waiting == 1 and not rejected
    clock.t = 5.1
    q.retry()
    assert q.waiting == 0 and rejected == ["stage"] and staged == ["a"]
    code, message, _, _ = source._rejected[tid]
    assert code == "staging_full" and "staging_mb=0" in message and "--max-inflight" in message
    assert q.finished_sending({"b"}) == {"b"}


def test_blocks_of_a_running_request_are_never_released(source) -> None:
    q, _, _, _ = make(source, {"a": 1000})
    q.submit(spec("a"))
    assert q.finished_sending(set()) == set()  # staged, but vLLM has not said the request finished
    assert q.finished_sending({"zzz"}) == set()  # a request this queue never saw is never reported
    assert q.finished_sending({"a"}) == {"a"}


def test_abort_while_waiting_releases(source) -> None:
    q, staged, _, _ = make(source, {"a": 60000, "b": 30000})
    q.submit(spec("a"))
    q.submit(spec("b"))
    q.abort("b")
    assert q.waiting == 0 and staged == ["a"]
    assert q.finished_sending({"a", "b"}) == {"a", "b"}
    assert source.stats()["requests_live"] == 1  # only a's staging


def test_a_request_d_gave_up_on_while_it_waited_is_not_staged_later(source) -> None:
    """D's deadline passed while P waited for room, and D's Done (here its NIXL notification) freed the expected
    request: when room comes, P must not stage it (nobody would pull it: it would hold the pool until the lease,
    and a full pool then stalls every request behind it)."""
    q, staged, rejected, clock = make(source, {"a": 60000, "b": 30000})
    q.submit(spec("a"))
    q.submit(spec("b"))
    assert staged == ["a"] and q.waiting == 1
    tid, tok = source.ticket("b")
    source._notified_done(f"{tid}:{tok}")  # D gave up on b
    source.abort("a")  # room again
    clock.t = 1.0
    q.retry()
    assert staged == ["a"] and q.waiting == 0 and not rejected
    assert q.finished_sending({"a", "b"}) == {"a", "b"}  # b's KV blocks are released on P too
    assert source.stats()["regions_live"] == 0 and source.stats()["requests_live"] == 0


def test_a_ticket_already_in_use_fails_that_request_only(source) -> None:
    """Two requests with the same proxy-minted ticket (signed params replayed): the second is not staged and its
    blocks are released, the first is untouched; the worker's step goes on (before: ValueError out of the step)."""
    q, staged, rejected, _ = make(source, {"a": 1000, "b": 1000})
    ticket = {"transfer_id": "ab" * 16, "token": "cd" * 16}
    q.submit(SaveSpec(req_id="a", block_ids=[0], num_tokens=10, mode="full", **ticket))
    q.submit(SaveSpec(req_id="b", block_ids=[0], num_tokens=10, mode="full", **ticket))
    assert staged == ["a"] and rejected == ["stage"] and q.waiting == 0
    assert q.finished_sending({"a", "b"}) == {"a", "b"}
    assert source.ticket("a") == (ticket["transfer_id"], ticket["token"])
    source.abort("a")
