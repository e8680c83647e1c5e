"""P's answers on the side channel (a part of `TransferSource`, service thread only): Query -> Regions (with the
readable prefix of a request published layer by layer) | NotReady | Error, Done -> Ack, KeepAlive -> Alive, and
the NIXL ``done:<transfer_id>:<token>`` notification. Every one names a request by its transfer id and token
(constant-time compare); an unknown id, a wrong token and a transfer another session owns get one answer."""

from __future__ import annotations

import hmac
import threading
import time
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.handshake import RateLimitedLog, Session

logger = init_logger(__name__)

__all__ = ["SourceAnswers"]


class SourceAnswers:
    """Mixin of `TransferSource`: it reads and updates the source's entries under its lock."""

    config: Any
    counters: dict[str, int]
    _lock: threading.Lock
    _entries: dict[str, Any]
    _by_tid: dict[str, str]
    _rejected: dict[str, tuple[str, str, float, str]]
    _log: RateLimitedLog
    _free: Any  # TransferSource._free(req_id, why, measure=(0.0, 0)) -> bool

    def _notified_done(self, rest: str) -> None:
        """A NIXL notification ``done:<transfer_id>:<token>``: frees only with the right token."""
        tid, _, token = rest.partition(":")
        with self._lock:
            entry = self._lookup(tid, token)
            req_id = None if entry is None else self._by_tid.get(tid)
        if req_id is None:
            self.counters["bad_notif"] += 1
            self._log.warn("bad_notif", "ignored a NIXL done notification for an unknown request or with a wrong "
                                        "token (transfer %r)", rest.partition(":")[0][:32])
            return
        self._free(req_id, "done", transfer_id=tid)

    def _lookup(self, tid: str, token: str) -> Any | None:
        """The entry of a transfer id presenting its token (constant-time compare), else None (lock held)."""
        req_id = self._by_tid.get(tid) if isinstance(tid, str) else None
        entry = self._entries.get(req_id) if req_id is not None else None
        ok = hmac.compare_digest(str(token).encode(), (entry.token if entry is not None else "x" * 32).encode())
        return entry if entry is not None and ok else None

    def _unknown(self, tid: str) -> proto.Error:
        """The one answer for an unknown transfer id, a wrong token or a transfer another session owns. Counted
        apart: an id P does not hold (``unknown_request``: normal in the concurrent flow, where D asks before P has
        the request, and after a lease) and one it holds, asked with a wrong token or by another session
        (``wrong_ticket``: someone else's ticket)."""
        with self._lock:
            held = isinstance(tid, str) and tid in self._by_tid
        self.counters["wrong_ticket" if held else "unknown_request"] += 1
        return proto.Error(v=proto.VERSION, code="unknown_request", message="no such request", transfer_id=tid)

    def _disown(self, transfer_id: str, owner: bytes) -> None:
        """The Regions that made ``owner`` the transfer's owner never reached it (its connection is gone): the
        transfer is nobody's again, so D's next session (or its Done) is not refused for it."""
        with self._lock:
            req_id = self._by_tid.get(transfer_id)
            entry = self._entries.get(req_id) if req_id is not None else None
            if entry is not None and entry.owner == owner:
                entry.owner = None

    def _answer(self, sess: Session, msg: proto.Message) -> proto.Message:
        v = proto.VERSION
        if isinstance(msg, proto.Query):
            with self._lock:
                entry = self._lookup(msg.transfer_id, msg.token)
                rejected = self._rejected.get(msg.transfer_id)
                owned_elsewhere = entry is not None and entry.owner is not None and entry.owner != sess.owner
                if entry is not None and not owned_elsewhere and entry.published and entry.staged is not None:
                    entry.owner = sess.owner
                    entry.deadline = time.monotonic() + self.config.lease_s
            if entry is None and rejected is not None and hmac.compare_digest(rejected[3].encode(), msg.token.encode()):
                return proto.Error(v=v, code=rejected[0], message=rejected[1], transfer_id=msg.transfer_id)
            if entry is None or owned_elsewhere:
                return self._unknown(msg.transfer_id)
            if not entry.published or entry.staged is None:
                return proto.NotReady(v=v, transfer_id=msg.transfer_id)
            self.counters["served_queries"] += 1
            s, ready = entry.staged, entry.ready or (-1, -1)
            return proto.Regions(
                v=v,
                transfer_id=msg.transfer_id,
                anchor_offset=s.anchor_offset,
                anchor_nbytes=s.anchor_nbytes,
                residual_offset=s.residual_offset,
                residual_nbytes=s.residual_nbytes,
                generation=s.generation,
                anchor_ready=ready[0],
                residual_ready=ready[1],
                first_token=entry.first_token,
                mode=entry.mode,
                auto_reason=entry.auto_reason,
            )
        if isinstance(msg, proto.Done):
            with self._lock:
                entry = self._lookup(msg.transfer_id, msg.token)
                req_id = self._by_tid.get(msg.transfer_id) if entry is not None else None
                if entry is not None and entry.owner is not None and entry.owner != sess.owner:
                    req_id = None
                rejected = self._rejected.get(msg.transfer_id)
                if entry is None and rejected is not None and hmac.compare_digest(rejected[3].encode(),
                                                                                   msg.token.encode()):
                    del self._rejected[msg.transfer_id]
                    return proto.Ack(v=v, transfer_id=msg.transfer_id)
            if req_id is None:
                return self._unknown(msg.transfer_id)
            self._free(req_id, "done", (msg.link_s, msg.link_bytes), transfer_id=msg.transfer_id)
            return proto.Ack(v=v, transfer_id=msg.transfer_id)
        if isinstance(msg, proto.KeepAlive):
            return self._keep_alive(sess, msg)
        return proto.Error(v=v, code="unexpected", message=f"P does not accept {type(msg).__name__}")

    def _keep_alive(self, sess: Session, msg: proto.KeepAlive) -> proto.Alive:
        """Renew the lease of each named transfer this session may pull; the others are answered as gone."""
        gone = []
        with self._lock:
            deadline = time.monotonic() + self.config.lease_s
            for tid, token in msg.tickets:
                entry = self._lookup(tid, token)
                if entry is None or (entry.owner is not None and entry.owner != sess.owner):
                    gone.append(tid)
                elif entry.published:
                    entry.deadline = deadline
            self.counters["renewed"] += len(msg.tickets) - len(gone)
            self.counters["keepalive_gone"] += len(gone)
        return proto.Alive(v=proto.VERSION, gone=gone)
