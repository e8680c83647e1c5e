"""Peer processes for the namespace tests. `start_in_namespace(ns, env, role, cfg, compat)` spawns a process that
first moves itself into network namespace `ns` (`netns.enter_process`: its own /sys, so UCX sees the veth),
sets `env` (UCX_TLS, ...), then runs either the P side (`lynx_connector.lab.peer`'s command loop, a
`TransferSource`) or the D side below (a `TransferSink` driven over a Pipe).

Commands (tuples) -> replies ("ok", value) / ("error", message):
  ("pull", [(req_id, host, port, anchor_nbytes, residual_nbytes), ...])  allocate views in the pool, pull
  ("events", n, timeout_s)  -> [(t_monotonic, req_id, stream, ok, error, nbytes, seconds), ...] (>= n or timeout)
  ("crc", req_id)           -> (anchor crc, residual crc)
  ("free", req_id)          -> frees the request's views      ("free_all",) -> frees every view left
  ("stats",)                -> sink.stats() plus the pool's regions_live / bytes_allocated
  ("stop",)
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from lynx_connector.transport.config import TransportConfig


def _main(conn: Connection, cfg: dict[str, Any], compat: dict[str, Any]) -> None:
    from lynx_connector.lab.peer import crc
    from lynx_connector.transport.sink import TransferSink

    sink = TransferSink(TransportConfig(**cfg), compat)
    views: dict[str, Any] = {}
    backlog: list[tuple] = []
    conn.send(("ready", None))
    try:
        while True:
            cmd = conn.recv()
            try:
                if cmd[0] == "pull":
                    for req_id, host, port, transfer_id, token, a, r in cmd[1]:
                        st = sink.pool.alloc_request(req_id, a, r)
                        views[req_id] = st
                        sink.pull(req_id, host, port, transfer_id, token, st.anchor, st.residual)
                    conn.send(("ok", None))
                elif cmd[0] == "events":
                    end = time.monotonic() + cmd[2]
                    while True:
                        backlog.extend((time.monotonic(), e.req_id, e.stream, e.ok, e.error, e.nbytes, e.seconds)
                                       for e in sink.poll())
                        if len(backlog) >= cmd[1] or time.monotonic() >= end:
                            break
                        time.sleep(0.002)
                    out, backlog = backlog, []
                    conn.send(("ok", out))
                elif cmd[0] == "crc":
                    st = views[cmd[1]]
                    conn.send(("ok", (crc(st.anchor), crc(st.residual))))
                elif cmd[0] == "free":
                    views.pop(cmd[1], None)
                    conn.send(("ok", sink.pool.free_request(cmd[1])))
                elif cmd[0] == "free_all":  # a test's cleanup: whatever views it left behind
                    for req_id in list(views):
                        views.pop(req_id)
                        sink.pool.free_request(req_id)
                    conn.send(("ok", None))
                elif cmd[0] == "stats":
                    conn.send(("ok", {**sink.stats(), "pool_regions_live": sink.pool.regions_live,
                                      "pool_bytes_allocated": sink.pool.bytes_allocated}))
                elif cmd[0] == "stop":
                    break
                else:
                    conn.send(("error", f"unknown command {cmd[0]!r}"))
            except Exception as exc:  # report, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        sink.close()
        conn.send(("ok", None))


def _namespaced(ns: str, env: dict[str, str], role: str, conn: Connection, cfg: dict[str, Any],
                compat: dict[str, Any]) -> None:
    import os

    from lynx_connector.lab import netns

    netns.enter_process(ns)
    os.environ.update(env)
    if role == "source":
        from lynx_connector.lab import peer

        peer._main(conn, cfg, compat)
    else:
        _main(conn, cfg, compat)


def start_in_namespace(ns: str, env: dict[str, str], role: str, config: TransportConfig, compat: dict[str, Any],
                       start_timeout_s: float = 90.0) -> tuple[mp.process.BaseProcess, Connection, Any]:
    """(process, pipe, ready value: the side-channel address for a source, None for a sink)."""
    assert role in ("source", "sink")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_namespaced, args=(ns, env, role, child, asdict(config), compat), daemon=True)
    proc.start()
    if not parent.poll(start_timeout_s):
        proc.kill()
        proc.join(5)
        raise TimeoutError(f"{role} process in {ns} did not start")
    tag, val = parent.recv()
    assert tag == "ready", (tag, val)
    return proc, parent, val
