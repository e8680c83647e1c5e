"""D's watched pulls (a part of `TransferSink`; docs/PROTOCOL.md sections 6 and 7): in the concurrent flow D asks P for
a request before P may have it, and takes its own staging only once P has staged it.

`watch` queues such a pull without D's staging; P's first Regions answer makes it "staged" (reported once by
`staged`, with the transfer mode P named), and `attach` gives it D's views and starts the transfer. With
``layouts`` (auto in the concurrent flow) D does not know the mode, hence the sizes, until P names it: the mode in
P's Regions picks them (`ReplyHandlers._take_layout`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from lynx_connector.transport.link import PullState, Staged
from lynx_connector.transport.ranking import PULL_ORDERS, SPLIT, PullOrder

__all__ = ["WatchedPulls"]


class WatchedPulls:
    """Mixin of `TransferSink`: the caller's watch/attach/staged API and the service thread's attach."""

    config: Any
    _pulls: dict[str, PullState]
    _peers: dict[Any, Any]
    _ev_lock: threading.Lock
    _staged: list[Staged]

    def watch(
        self,
        req_id: str,
        host: str,
        port: int,
        transfer_id: str,
        token: str,
        anchor_nbytes: int,
        residual_nbytes: int,
        wait_s: float | None = None,
        order: PullOrder = SPLIT,
        layouts: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Like `pull`, before D has staging for it: ask P until P has staged the request (answers its regions),
        then report the request in `staged()` and hold it, P's lease renewed, until `attach` gives it D's
        views (the transfer starts then). The concurrent flow uses it: D's staging is then held only by requests
        P holds too, so a burst larger than both pools drains in order instead of filling both with requests
        waiting on each other. Without `attach` within ``timeout_s`` of being staged the pull fails.

        ``layouts`` (auto in the concurrent flow: P chooses the mode as it prefills): per transfer mode P may
        name in its Regions, the (anchor, residual) bytes D stages for it; the mode P names picks the sizes (and
        a mode not in it fails the pull). ``anchor_nbytes``/``residual_nbytes`` are then ignored."""
        if layouts is not None:
            layouts = {str(m): (int(a), int(r)) for m, (a, r) in layouts.items()}
            if not layouts or any(a <= 0 or r < 0 for a, r in layouts.values()):
                raise ValueError(f"bad layouts {layouts!r}")
            anchor_nbytes, residual_nbytes = next(iter(layouts.values()))
        if anchor_nbytes <= 0 or residual_nbytes < 0:
            raise ValueError(f"bad plane sizes {anchor_nbytes!r}/{residual_nbytes!r}")
        r = (0, int(residual_nbytes)) if residual_nbytes else None
        self._enqueue(req_id, host, port, transfer_id, token, (0, int(anchor_nbytes)), r, wait_s, order, held=True,
                      layouts=layouts)

    def attach(self, req_id: str, anchor_out: torch.Tensor, residual_out: torch.Tensor | None,
               order: PullOrder | None = None) -> None:
        """Give a watched request that P has staged (`staged()`) its views of `self.pool` and start its
        transfer; their sizes must be those given to `watch` (or of the mode P named, with ``layouts``).
        ``order``: the pull's order from now on (the mode D serves it as is known only now, with auto). A pull
        that failed meanwhile has already had its failed events: attaching it does nothing (the caller frees its
        views as for any failed pull)."""
        if order is not None and order not in PULL_ORDERS:
            raise ValueError(f"order must be one of {', '.join(PULL_ORDERS)}, got {order!r}")
        self._cmd(("attach", req_id, (*self._views(anchor_out, residual_out), order)))

    def staged(self) -> list[Staged]:
        """Watched requests P has staged since the last call (each reported once), in the order P staged them,
        with the transfer mode P named for each."""
        with self._ev_lock:
            out, self._staged = self._staged, []
        return out

    def _attach(self, req_id: str, a: tuple[int, int], r: tuple[int, int] | None, order: PullOrder | None) -> None:
        pull = self._pulls.get(req_id)
        if pull is None or not pull.held:
            return  # failed (or aborted) meanwhile: its events are out
        want = (pull.anchor[1], None if pull.residual is None else pull.residual[1])
        if (a[1], None if r is None else r[1]) != want:
            self._fail(pull, f"attach: views of {a[1]}/{0 if r is None else r[1]} bytes for {req_id!r}, watched "
                       f"{want[0]}/{want[1] or 0}")
            return
        pull.anchor, pull.residual, pull.held = a, r, False
        if order is not None:
            pull.order = order
        pull.deadline = time.monotonic() + self.config.timeout_s
        peer = self._peers.get(pull.addr)
        if peer is not None and peer.state == "ready":
            self._query(pull)  # P's regions again (more may be ready now): the transfer starts on the answer
        else:
            pull.state = "wait_peer"  # queried once the (re)handshake is answered
