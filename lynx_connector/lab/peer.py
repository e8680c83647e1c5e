"""A standalone P-side process for benches and integration tests: a `TransferSource` driven over a Pipe.

`start_source_process(config, compat)` spawns it and returns (process, connection). Commands (tuples):
  ("stage", [(req_id, anchor_nbytes, residual_nbytes, seed), ...], publish: bool) -> ("ok", {req_id: crc})
  ("publish", [req_id, ...]) -> ("ok", None)
  ("stats",) -> ("ok", stats dict incl. process cpu_s)      ("freed",) -> ("ok", [req ids freed so far])
  ("tickets", [req_id, ...]) -> ("ok", {req_id: (transfer_id, token)})   what D's pull needs (protocol v2)
  ("pulled",) -> ("ok", [(Done's arrival, D's link seconds, bytes), ...])  `TransferSource.take_pulled` (v4)
  ("stop",) -> ("ok", None) and exit
The payload of a staged request is pseudo-random bytes from `seed` (`payload(n, seed)`), so the other side
can check byte-exactness without shipping it; a negative seed fills a constant instead (benches, no crc).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import torch

from lynx_connector.transport.config import TransportConfig

__all__ = ["payload", "crc", "start_source_process"]


def payload(nbytes: int, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random uint8 tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def crc(t: torch.Tensor | None) -> int:
    return 0 if t is None else zlib.crc32(t.numpy().tobytes())


def _main(conn: Connection, cfg: dict[str, Any], compat: dict[str, Any]) -> None:
    from lynx_connector.transport.source import TransferSource

    src = TransferSource(TransportConfig(**cfg), compat)
    freed: list[str] = []
    conn.send(("ready", src.address))
    cpu0 = time.process_time()
    try:
        while True:
            if not conn.poll(0.05):
                freed.extend(src.poll())
                continue
            cmd = conn.recv()
            freed.extend(src.poll())
            if cmd[0] == "stage":
                sums = {}
                for req_id, a, r, seed in cmd[1]:
                    st = src.alloc(req_id, a, r)
                    if seed < 0:  # benches: a cheap constant fill, no checksum
                        st.anchor.fill_(-seed & 0xFF)
                        if st.residual is not None:
                            st.residual.fill_((-seed + 1) & 0xFF)
                        sums[req_id] = (0, 0)
                    else:
                        st.anchor.copy_(payload(a, seed))
                        if st.residual is not None:
                            st.residual.copy_(payload(r, seed + 1))
                        sums[req_id] = (crc(st.anchor), crc(st.residual))
                    if cmd[2]:
                        src.publish(req_id)
                conn.send(("ok", sums))
            elif cmd[0] == "publish":
                for req_id in cmd[1]:
                    src.publish(req_id)
                conn.send(("ok", None))
            elif cmd[0] == "stats":
                conn.send(("ok", {**src.stats(), "process_cpu_s": time.process_time() - cpu0}))
            elif cmd[0] == "tickets":
                conn.send(("ok", {r: src.ticket(r) for r in cmd[1]}))
            elif cmd[0] == "pulled":
                conn.send(("ok", src.take_pulled()))
            elif cmd[0] == "freed":
                conn.send(("ok", list(freed)))
            elif cmd[0] == "stop":
                break
            else:
                conn.send(("error", f"unknown command {cmd[0]!r}"))
    finally:
        src.close()
        conn.send(("ok", None))


def start_source_process(
    config: TransportConfig, compat: dict[str, Any], start_timeout_s: float = 60.0
) -> tuple[mp.process.BaseProcess, Connection, tuple[str, int]]:
    """Spawn a source process; returns (process, pipe, side-channel address)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_main, args=(child, asdict(config), compat), daemon=True)
    proc.start()
    if not parent.poll(start_timeout_s):
        proc.kill()
        raise TimeoutError("source process did not start")
    tag, addr = parent.recv()
    assert tag == "ready"
    return proc, parent, (addr[0], int(addr[1]))
