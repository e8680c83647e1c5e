"""The proxy's admission control: at most ``max_inflight`` requests per server, a bounded queue in front.

A request takes a slot on a decode server, then one on a prefill server; it gives the prefill slot back when
P has answered and the decode slot when D's response has been sent. The least-loaded server with a free slot
is chosen (round-robin among equals). A request that finds every slot taken waits, first come first served,
in a queue of at most ``max_queued``; a full queue, or a wait longer than ``queue_timeout_s`` (the proxy counts
the waits for both slots together), is answered at once with 503 naming the limit, so an overload is a clear error, not a timeout somewhere behind the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = ["Overloaded", "ServerSlots"]


class Overloaded(Exception):
    """No slot could be had: the message names the limit."""


@dataclass
class SlotStats:
    inflight: dict[str, int]
    queued: int
    admitted: int
    rejected_queue_full: int
    rejected_timeout: int


class ServerSlots:
    """Slots of the servers of one role ("prefill" or "decode")."""

    def __init__(self, role: str, urls: list[str], max_inflight: int, max_queued: int,
                 queue_timeout_s: float) -> None:
        if max_inflight < 1 or max_queued < 0 or queue_timeout_s <= 0:
            raise ValueError("max_inflight must be >= 1, max_queued >= 0 and queue_timeout_s > 0")
        self.role = role
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.inflight = dict.fromkeys(urls, 0)
        self._order = itertools.cycle(list(self.inflight))  # each server once, however often ``urls`` names it
        self._waiters: list[asyncio.Future[str]] = []  # FIFO
        self.admitted = 0
        self.rejected_queue_full = 0
        self.rejected_timeout = 0

    def stats(self) -> SlotStats:
        return SlotStats(dict(self.inflight), len(self._waiters), self.admitted, self.rejected_queue_full,
                         self.rejected_timeout)

    def _free_server(self) -> str | None:
        low = min(self.inflight.values())
        if low >= self.max_inflight:
            return None
        for _ in range(len(self.inflight)):
            url = next(self._order)
            if self.inflight[url] == low:
                return url
        raise AssertionError("unreachable")

    async def acquire(self, timeout_s: float | None = None) -> str:
        """A server's slot; ``timeout_s``: the longest wait (``queue_timeout_s`` when None; the proxy passes
        what is left of it after the wait for the other role's slot)."""
        wait_s = self.queue_timeout_s if timeout_s is None else timeout_s
        url = self._free_server() if not self._waiters else None
        if url is None:
            if len(self._waiters) >= self.max_queued:
                self.rejected_queue_full += 1
                raise Overloaded(
                    f"all {len(self.inflight)} {self.role} servers are at their limit of {self.max_inflight} "
                    f"requests in flight and {len(self._waiters)} requests are already waiting "
                    f"(lynx proxy --max-inflight {self.max_inflight} --max-queued {self.max_queued})")
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                # Not wait_for(shield(fut)): on Python 3.11 a cancel that lands in the loop step in which fut is
                # granted is swallowed there (the request would go on after its client left)
                async with asyncio.timeout(max(wait_s, 0.0)):
                    url = await fut
            except TimeoutError:
                if fut.done() and not fut.cancelled():  # granted in the same instant: give it back
                    self._grant_next(fut.result())
                else:
                    fut.cancel()
                self.rejected_timeout += 1
                raise Overloaded(
                    f"no {self.role} server had a free slot within --queue-timeout {self.queue_timeout_s:g}s "
                    f"(the wait for a decode and a prefill slot together; {len(self.inflight)} {self.role} servers "
                    f"x --max-inflight {self.max_inflight})"
                ) from None
            except asyncio.CancelledError:  # the client went away while waiting
                if fut.done() and not fut.cancelled():
                    self._grant_next(fut.result())
                else:
                    fut.cancel()
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
            return url  # the slot was counted by whoever granted it
        self.inflight[url] += 1
        self.admitted += 1
        return url

    def release(self, url: str) -> None:
        self.inflight[url] -= 1
        self._grant_next(None)

    def _grant_next(self, returned: str | None) -> None:
        """Give a free slot to the oldest waiter (``returned``: a slot handed back by a waiter that timed out)."""
        if returned is not None:  # never admitted after all: its grant is not counted
            self.inflight[returned] -= 1
            self.admitted -= 1
        while self._waiters:
            url = self._free_server()
            if url is None:
                return
            fut = self._waiters.pop(0)
            if fut.done():
                continue
            self.inflight[url] += 1
            self.admitted += 1
            fut.set_result(url)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[str]:
        url = await self.acquire()
        try:
            yield url
        finally:
            self.release(url)
