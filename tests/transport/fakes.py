"""`FakeNixlWrapper`: an in-process stand-in for `NixlWrapper` with controllable delay and failures.

Agents created with the same `FakeFabric` see each other's registered memory (metadata is just the agent
name); a READ copies bytes with ctypes.memmove when it completes. `delay_s` makes every transfer report
"PROC" until that much time has passed (per transfer, measured from post). Failures: `fail_peers` (every READ
from those agent names returns ERR), `fail_next` (the next N posts raise), `hang` (transfers never complete).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

#: The deployment key of the transport tests (TransportConfig.key); `OTHER_KEY` is a different deployment's.
TEST_KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@dataclass
class FakeFabric:
    agents: dict[str, FakeNixlWrapper] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Xfer:
    peer: str
    local: int
    remote: int
    nbytes: int
    due: float
    state: str = "PROC"


class FakeNixlWrapper:
    """Same surface as `lynx_connector.transport.nixl_wrapper.NixlWrapper`."""

    _ids = itertools.count()

    def __init__(self, fabric: FakeFabric, name: str | None = None, delay_s: float = 0.0) -> None:
        self.name = name or f"fake-{next(self._ids)}"
        self.fabric = fabric
        self.delay_s = delay_s
        self.fail_peers: set[str] = set()
        self.fail_next = 0
        self.hang = False
        self.regions: list[tuple[int, int]] = []
        self.remotes: set[str] = set()
        self.posted: list[tuple[str, int, int]] = []  # (peer, remote addr, nbytes)
        self.live_handles = 0
        self.notifs: dict[str, list[bytes]] = {}
        self.closed = False
        with fabric.lock:
            fabric.agents[self.name] = self

    def register(self, tensor: torch.Tensor) -> None:
        self.regions.append((int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size())))

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in self.fabric.agents:
            raise RuntimeError(f"unknown fake agent {name}")
        self.remotes.add(name)
        return name

    def remove_remote(self, peer: str) -> None:
        self.remotes.discard(peer)

    def _inside(self, agent: FakeNixlWrapper, addr: int, n: int) -> bool:
        return any(base <= addr and addr + n <= base + size for base, size in agent.regions)

    def post_read(self, peer: str, local_addr: int, remote_addr: int, nbytes: int) -> tuple[Any, str]:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected post failure")
        remote = self.fabric.agents.get(peer)
        if peer not in self.remotes or remote is None or remote.closed:
            raise RuntimeError(f"peer {peer} not connected")
        if not self._inside(self, local_addr, nbytes) or not self._inside(remote, remote_addr, nbytes):
            raise RuntimeError("descriptor outside registered memory")
        self.posted.append((peer, remote_addr, nbytes))
        x = _Xfer(peer, local_addr, remote_addr, nbytes, time.monotonic() + self.delay_s)
        self.live_handles += 1
        return x, self.check(x)

    def check(self, handle: _Xfer) -> str:
        if handle.state != "PROC":
            return handle.state
        if handle.peer in self.fail_peers:
            handle.state = "ERR"
        elif not self.hang and time.monotonic() >= handle.due:
            ctypes.memmove(handle.local, handle.remote, handle.nbytes)
            handle.state = "DONE"
        return handle.state

    def release(self, handle: _Xfer) -> None:
        self.live_handles -= 1

    def progress(self) -> dict[str, list[bytes]]:
        out, self.notifs = self.notifs, {}
        return out

    def close(self) -> None:
        self.closed = True
        with self.fabric.lock:
            self.fabric.agents.pop(self.name, None)
