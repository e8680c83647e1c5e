"""The proxy's admission (lynx_connector/admission.py): slot accounting under duplicates, cancels and timeouts."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from lynx_connector.admission import Overloaded, ServerSlots


def test_a_server_named_twice_is_one_server_and_waiters_are_granted() -> None:
    """The slots are counted per server: a list naming one twice used to make the least-loaded scan miss the
    free server (AssertionError in acquire, and in release, where the queued waiter was then never granted)."""

    async def main() -> None:
        s = ServerSlots("prefill", ["http://a", "http://b", "http://a"], 1, 8, 5.0)
        got = {await s.acquire(), await s.acquire()}
        assert got == {"http://a", "http://b"} and s.inflight == {"http://a": 1, "http://b": 1}
        waiter = asyncio.create_task(s.acquire())
        await asyncio.sleep(0)
        s.release("http://b")
        assert await asyncio.wait_for(waiter, 1.0) == "http://b"
        assert s.inflight == {"http://a": 1, "http://b": 1}

    asyncio.run(main())


def test_a_cancel_in_the_step_of_the_grant_gives_the_slot_back() -> None:
    """The client leaves in the same loop step as its slot is granted: the request is cancelled (it must not go
    on without a client) and the slot goes back (Python 3.11's wait_for(shield()) swallowed that cancel)."""

    async def main() -> None:
        s = ServerSlots("decode", ["a"], 1, 8, 5.0)
        await s.acquire()
        t = asyncio.create_task(s.acquire())
        await asyncio.sleep(0)  # t is queued
        s.release("a")  # granted to t ...
        t.cancel()  # ... and cancelled before t ran again
        with pytest.raises(asyncio.CancelledError):
            await t
        assert s.inflight == {"a": 0} and s.stats().queued == 0
        assert s.stats().admitted == 1  # the grant handed back is not an admission
        assert await s.acquire() == "a"

    asyncio.run(main())


def test_a_waiter_cancelled_before_a_release_is_skipped() -> None:
    """The client leaves, then a slot frees in the same loop step: the cancelled waiter is passed over (granting
    it raised InvalidStateError out of release, with the slot already counted: leaked)."""

    async def main() -> None:
        s = ServerSlots("decode", ["a"], 1, 8, 5.0)
        await s.acquire()
        t = asyncio.create_task(s.acquire())
        await asyncio.sleep(0)  # t is queued
        t.cancel()  # its future is cancelled at once ...
        s.release("a")  # ... before t ran again
        with pytest.raises(asyncio.CancelledError):
            await t
        assert s.inflight == {"a": 0} and s.stats().queued == 0
        assert await s.acquire() == "a"

    asyncio.run(main())


def test_a_queue_timeout_in_the_step_of_the_grant_gives_the_slot_back(monkeypatch) -> None:
    """The queue timeout fires in the loop step in which the slot is granted: the request is refused (Overloaded)
    and the granted slot goes back, not counted for good."""

    @contextlib.asynccontextmanager
    async def expires_now(_seconds):  # asyncio.timeout firing: its cancel of the task becomes a TimeoutError
        try:
            yield
        except asyncio.CancelledError:
            raise TimeoutError from None

    monkeypatch.setattr(asyncio, "timeout", expires_now)

    async def main() -> None:
        s = ServerSlots("decode", ["a"], 1, 8, 5.0)
        await s.acquire()
        t = asyncio.create_task(s.acquire())
        await asyncio.sleep(0)
        s.release("a")  # granted to t ...
        t.cancel()  # ... and its timeout fires before t ran again
        with pytest.raises(Overloaded, match="--queue-timeout"):
            await t
        assert s.inflight == {"a": 0} and s.stats().queued == 0
        assert s.stats().admitted == 1
        assert await s.acquire() == "a"

    asyncio.run(main())


def test_queue_full_and_queue_timeout_are_overloaded_and_leave_no_slot_counted() -> None:
    async def main() -> None:
        s = ServerSlots("prefill", ["a"], 1, 1, 0.05)
        await s.acquire()
        waiting = asyncio.create_task(s.acquire())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="--max-queued 1"):
            await s.acquire()
        with pytest.raises(Overloaded, match="--queue-timeout"):
            await waiting
        s.release("a")
        assert s.inflight == {"a": 0} and s.stats().queued == 0
        assert (s.rejected_queue_full, s.rejected_timeout) == (1, 1)

    asyncio.run(main())


def test_a_wait_given_what_is_left_of_the_queue_timeout_ends_then() -> None:
    """The proxy passes the prefill slot's wait what the decode slot's wait left of --queue-timeout (the two waits
    together are bounded by it; before, each could take all of it); nothing left: refused at once when queued,
    served when a slot is free."""
    async def main() -> None:
        s = ServerSlots("prefill", ["a"], 1, 4, 30.0)
        loop = asyncio.get_running_loop()
        await s.acquire(timeout_s=0.0)  # a free slot needs no wait
        t0 = loop.time()
        with pytest.raises(Overloaded, match="--queue-timeout 30s"):
            await s.acquire(timeout_s=0.05)
        assert loop.time() - t0 < 5.0
        with pytest.raises(Overloaded):
            await s.acquire(timeout_s=-1.0)
        s.release("a")
        assert s.inflight == {"a": 0} and s.stats().queued == 0 and s.rejected_timeout == 2

    asyncio.run(main())


def test_the_proxy_gives_the_prefill_wait_what_the_decode_wait_left() -> None:
    """lynx proxy's request handler (`_serve`): a request that waited 0.4 s for its decode slot may wait only the
    rest of --queue-timeout (1 s) for its prefill slot."""
    from types import SimpleNamespace

    from lynx_connector import proxy
    from lynx_connector.proxy_upstream import Call

    given: list[float] = []

    @contextlib.asynccontextmanager
    async def decode_slot():  # noqa: ANN202
        await asyncio.sleep(0.4)
        yield "http://d"

    async def prefill_acquire(timeout_s: float | None = None) -> str:
        given.append(timeout_s)
        raise Overloaded("no prefill slot")

    state = SimpleNamespace(session=object(), config=SimpleNamespace(queue_timeout_s=1.0),
                            decode_slots=SimpleNamespace(slot=decode_slot),
                            prefill_slots=SimpleNamespace(acquire=prefill_acquire))
    with pytest.raises(Overloaded):
        asyncio.run(proxy._serve(state, Call("r1"), None, {}, False))
    assert len(given) == 1 and 0.3 < given[0] <= 0.6, given
