"""P and D "hosts" for the transport namespace tests: a `TransferSource` process in namespace P and a
`TransferSink` process in namespace D, joined by one veth link, UCX forced onto TCP over that link.

`net_pair(...)` is a context manager; on exit (also on failure) both processes are stopped or killed and the
namespaces deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from lynx_connector.lab import netns
from lynx_connector.transport.config import TransportConfig

from .sinkpeer import start_in_namespace

COMPAT = {"model": "smollm2", "layers": 30, "kv_heads": 3, "head_size": 64, "codec": "lynx", "codec_version": 1}
MB = 1 << 20
NET_KEY = secrets.token_bytes(32)  # the side-channel key of the P and D processes of these tests


def call(conn: Connection, *cmd: Any, timeout: float = 60.0) -> Any:
    conn.send(cmd)
    assert conn.poll(timeout), f"peer process did not answer {cmd[0]} within {timeout}s"
    tag, val = conn.recv()
    assert tag == "ok", val
    return val


@contextlib.contextmanager
def env(**kw: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in kw}
    os.environ.update(kw)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ucx_env(dev: str, proto_info: bool = False) -> dict[str, str]:
    """UCX on TCP over `dev` only: no cma/shared memory, no loopback."""
    out = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}
    if proto_info:
        out["UCX_PROTO_INFO"] = "y"
    return out


@dataclass
class NetPair:
    topo: netns.Topology
    p_ns: str
    d_ns: str
    link: netns.Link
    src_proc: Any = None
    src_conn: Connection | None = None
    src_addr: tuple[str, int] = ("", 0)
    sink_proc: Any = None
    sink_conn: Connection | None = None
    procs: list[Any] = field(default_factory=list)

    # the data direction is P -> D (D READs): shaping and faults go on P's egress
    @property
    def p_dev(self) -> str:
        return self.link.dev_a

    @property
    def d_dev(self) -> str:
        return self.link.dev_b

    def src(self, *cmd: Any, timeout: float = 60.0) -> Any:
        assert self.src_conn is not None
        return call(self.src_conn, *cmd, timeout=timeout)

    def sink(self, *cmd: Any, timeout: float = 60.0) -> Any:
        assert self.sink_conn is not None
        return call(self.sink_conn, *cmd, timeout=timeout)

    def start_source(self, cfg: TransportConfig, proto_info: bool = False) -> None:
        cfg = dataclasses.replace(cfg, key=NET_KEY)
        self.src_proc, self.src_conn, addr = start_in_namespace(self.p_ns, ucx_env(self.p_dev, proto_info),
                                                                "source", cfg, COMPAT)
        self.src_addr = (addr[0], int(addr[1]))
        self.procs.append(self.src_proc)

    def start_sink(self, cfg: TransportConfig, proto_info: bool = False) -> None:
        cfg = dataclasses.replace(cfg, key=NET_KEY)
        self.sink_proc, self.sink_conn, _ = start_in_namespace(self.d_ns, ucx_env(self.d_dev, proto_info),
                                                               "sink", cfg, COMPAT)
        self.procs.append(self.sink_proc)

    def pull(self, *reqs: tuple[str, int, int]) -> None:
        host, port = self.src_addr
        tickets = self.src("tickets", [r for r, _, _ in reqs])  # (transfer_id, token) of each, minted by P
        self.sink("pull", [(r, host, port, *tickets[r], a, b) for r, a, b in reqs])

    def events(self, n: int, timeout: float) -> list[tuple]:
        out: list[tuple] = []
        end = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < end:
            out.extend(self.sink("events", n - len(out), max(0.0, end - time.monotonic()), timeout=timeout + 30))
        return out

    def wait_source_idle(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            st = self.src("stats")
            if st["regions_live"] == 0 and st["requests_live"] == 0:
                return st
            assert time.monotonic() < end, f"P's staging not back to idle within {timeout}s: {st}"
            time.sleep(0.1)

    def stop_sink(self) -> None:
        """Stop the current sink process (graceful, then killed)."""
        proc, conn = self.sink_proc, self.sink_conn
        if proc is not None and proc.is_alive():
            with contextlib.suppress(Exception):
                conn.send(("stop",))
                proc.join(10)
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)

    def stop(self) -> None:
        for conn, proc in ((self.sink_conn, self.sink_proc), (self.src_conn, self.src_proc)):
            if proc is None or not proc.is_alive():
                continue
            with contextlib.suppress(Exception):
                conn.send(("stop",))
                proc.join(10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


@contextlib.contextmanager
def net_pair(mtu: int = 9000, delay_ms: float | None = None) -> Iterator[NetPair]:
    """Namespaces P and D and their link (a veth, or a delaying TAP wire when `delay_ms` is given); the caller
    starts the processes (`start_source`/`start_sink`)."""
    with netns.Topology() as topo:
        p, d = topo.add_namespace("p"), topo.add_namespace("d")
        if delay_ms is None:
            link = topo.add_link(p, d, mtu=mtu)
        else:
            link = topo.add_wire(p, d, delay_ms=delay_ms, mtu=mtu)
        pair = NetPair(topo, p, d, link)
        try:
            yield pair
        finally:
            pair.stop()
