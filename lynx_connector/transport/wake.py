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


def unpin_current_thread() -> None:
    """Let the calling (service) thread run on every CPU of the machine.

    vLLM's CPU worker binds its process to the cores of its OpenMP compute threads (often a single core on a
    small machine), and threads inherit that affinity. A transport thread pinned to the compute core waits
    behind the model's forward pass; unpinned, it answers side-channel messages and posts transfers on any
    idle core. It sleeps in ``zmq.Poller.poll`` when idle, so it costs nothing there.
    """
    import os

    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, allowed)  # pid 0 = the calling thread on Linux
    except OSError:  # restricted by a cgroup/cpuset: keep what we have
        pass
