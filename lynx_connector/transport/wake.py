"""A zmq inproc pair that lets caller threads wake a service thread blocked in `zmq.Poller.poll`."""

from __future__ import annotations

import itertools
import threading

import zmq

__all__ = ["Waker"]

_ids = itertools.count()


class Waker:
    """`wake()` from any thread; the service thread polls `.receiver` and calls `drain()`."""

    def __init__(self, ctx: zmq.Context) -> None:
        addr = f"inproc://lynx-wake-{id(self)}-{next(_ids)}"
        self.receiver = ctx.socket(zmq.PAIR)
        self.receiver.bind(addr)
        self._sender = ctx.socket(zmq.PAIR)
        self._sender.connect(addr)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            try:
                self._sender.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # already full of wake-ups: the thread will wake anyway
                pass

    def drain(self) -> None:
        while True:
            try:
                self.receiver.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        with self._lock:
            self._sender.close(linger=0)
        self.receiver.close(linger=0)
