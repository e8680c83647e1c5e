"""The clocks of D's control path (a part of `TransferSink`): each pull's own deadline, NotReady retries with
back-off, messages re-sent for want of an answer, Dones owed until P acknowledges them, KeepAlives that renew
P's lease of every request being pulled, and reconnects of a peer that left a message unanswered for
``reconnect_s``. One silent request fails alone; a peer is dropped only
when it never answered and serves no other pull.
"""

from __future__ import annotations

import time
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.link import PeerLink, PullState, done_frame

logger = init_logger(__name__)

__all__ = ["ControlTimers"]


class ControlTimers:
    """Mixin of `TransferSink`: it works on the sink's pulls, peers and courier (service thread only)."""

    config: Any
    _pulls: dict[str, PullState]
    _peers: dict[Any, PeerLink]

    def _reconnect(self, peer: PeerLink, now: float, why: str | None = None) -> None:
        """A fresh connection and full handshake for a peer that stopped answering (or lost our session); its
        NIXL agent stays added (transfers in flight go on), waiting pulls are queried again once the handshake is
        answered; the new session resumes the old one (P keeps our transfers ours)."""
        logger.warning("lynx sink: peer %s %s with %d pulls waiting: reconnecting", peer.name,
                       why or f"silent for {peer.silent_for(now):.1f}s", len(self._pulls_of(peer)))
        peer.reopen()
        self._reconnects += 1
        for pull in self._pulls_of(peer):
            if pull.state == "query":
                pull.state, pull.sent_at, pull.retry_at = "wait_peer", None, None
        peer.hello(self.compat_hash)

    def _check_deadlines(self, wait: float | None) -> float | None:
        """Timers of the control path: deadlines (each pull alone), NotReady retries, re-sent messages and
        reconnects of silent peers. Returns the sleep until the next timer (merged with ``wait``)."""
        now = time.monotonic()
        cfg = self.config
        timers: list[float] = [] if wait is None else [now + wait]
        for pull in list(self._pulls.values()):
            if self._pulls.get(pull.req_id) is not pull:
                continue
            if pull.state == "transferring":
                if pull.ready is not None:  # P publishes it layer by layer: ask for more, or give up on a stall
                    nxt = self._follow_partial(pull, now)
                    if nxt is not None:
                        timers.append(nxt)
                elif pull.follows_token:  # all readable; ask for P's first token (transport/first_token.py)
                    nxt = self._follow_token(pull, now)
                    if nxt is not None:
                        timers.append(nxt)
                continue
            if pull.state == "staged":  # P holds it; D waits for its own staging (KeepAlives renew the lease)
                if now >= pull.deadline:
                    self._fail(pull, f"transfer {pull.transfer_id[:8]}… of {pull.req_id!r} was staged by P but "
                               f"never given D's staging (attach) within {2 * cfg.timeout_s:g}s")
                else:
                    timers.append(pull.deadline)
                continue
            silent_until = self._silence_bound(pull)
            if now >= pull.deadline or (silent_until is not None and now >= silent_until):
                self._expire(pull)
                continue
            if silent_until is not None:
                timers.append(silent_until)
            if pull.retry_at is not None and now >= pull.retry_at:
                self._query(pull)
            elif pull.sent_at is not None and now - pull.sent_at >= cfg.resend_s:
                self._resent += 1
                self._query(pull)
            timers.append(pull.deadline)
            if pull.retry_at is not None:
                timers.append(pull.retry_at)
            if pull.sent_at is not None:
                timers.append(pull.sent_at + cfg.resend_s)
        for addr, ticket, measure in self._courier.due(now):  # Dones P has not acknowledged yet
            peer = self._peers.get(addr) or (None if self._said_closing(addr) else self._connect(addr))
            if peer is not None:
                peer.send(done_frame(ticket, measure))  # sent once the session is up
        nxt = self._courier.next_time()
        if nxt is not None:
            timers.append(nxt)
        for peer in list(self._peers.values()):
            if not self._pulls_of(peer) and not self._courier.owed_to(peer.addr):
                idle_since = max(peer.heard_at, peer.asked_at, peer.opened_at)
                if now - idle_since >= cfg.peer_idle_s:  # gone, or never answered: its socket is not kept
                    logger.debug("lynx sink: closing the idle connection to peer %s", peer.name)
                    del self._peers[peer.addr]
                    self._drop_peer_resources(peer)
                    continue
                timers.append(idle_since + cfg.peer_idle_s)
            nxt = self._keep_alive(peer, now)
            if nxt is not None:
                timers.append(nxt)
            waiting = [p for p in self._pulls_of(peer) if p.state != "transferring"]
            if not waiting and not self._courier.owed_to(peer.addr):
                continue
            if peer.silent_for(now) >= cfg.reconnect_s:
                self._reconnect(peer, now)
            elif peer.state in ("hello", "auth") and now - peer.hello_at >= cfg.resend_s:
                self._resent += 1
                if peer.state == "hello":
                    peer.hello(self.compat_hash)
                else:
                    peer.auth(self.compat)
            deadline = peer.silence_deadline(cfg.reconnect_s)
            if deadline is not None:
                timers.append(deadline)
            if peer.state in ("hello", "auth"):
                timers.append(peer.hello_at + cfg.resend_s)
        return None if not timers else max(0.0, min(timers) - now)

    def _keep_alive(self, peer: PeerLink, now: float) -> float | None:
        """Renew P's lease of the requests being read from ``peer`` every quarter of it (their Query renewed it
        when the transfer started); returns when the next KeepAlive is due, None when none is."""
        pulling = [p for p in self._pulls_of(peer) if p.state in ("transferring", "staged")]
        if not pulling or peer.state != "ready" or peer.lease_s <= 0:
            peer.keepalive_at = 0.0
            return None
        if peer.keepalive_at == 0.0:
            peer.keepalive_at = now + peer.lease_s / 4
        elif now >= peer.keepalive_at:
            tickets = [(p.transfer_id, p.token) for p in pulling]
            for i in range(0, len(tickets), proto.MAX_KEEPALIVE):
                peer.send(proto.KeepAlive(v=proto.VERSION, tickets=tickets[i:i + proto.MAX_KEEPALIVE]))
            self._keepalives += 1
            peer.keepalive_at = now + peer.lease_s / 4
        return peer.keepalive_at

    def _follow_partial(self, pull: PullState, now: float) -> float | None:
        """A transfer P publishes layer by layer: query again every ``pipeline_poll_s`` (an unanswered query is
        sent again after ``resend_s``); fail it when P published nothing more for ``timeout_s`` (P died or
        stalled mid-prefill). Returns the next time to look at it."""
        cfg = self.config
        if now - pull.progress_at >= cfg.timeout_s:
            self._fail(pull, f"peer {pull.addr[0]}:{pull.addr[1]} published no more of {pull.req_id!r} for "
                       f"{cfg.timeout_s}s (it was still encoding it: P stalled or died mid-prefill)")
            return None
        peer = self._peers.get(pull.addr)
        if peer is None or peer.state != "ready":  # a re-handshake: its reply wakes the loop; a query now or a
            return pull.progress_at + cfg.timeout_s  # resend that is due would spin the loop (poll timeout 0)
        if pull.sent_at is None and pull.requery_at is not None and now >= pull.requery_at:
            pull.sent_at, pull.requery_at = now, None
            peer.send(proto.Query(v=proto.VERSION, transfer_id=pull.transfer_id, token=pull.token))
        elif pull.sent_at is not None and now - pull.sent_at >= cfg.resend_s:
            self._resent += 1
            pull.sent_at = now
            peer.send(proto.Query(v=proto.VERSION, transfer_id=pull.transfer_id, token=pull.token))
        times = [pull.progress_at + cfg.timeout_s]
        if pull.requery_at is not None:
            times.append(pull.requery_at)
        if pull.sent_at is not None:
            times.append(pull.sent_at + cfg.resend_s)
        return min(times)

    def _silence_bound(self, pull: PullState) -> float | None:
        """A concurrent-flow pull waits up to ``concurrent_wait_s`` while P answers "not yet", but not for a P
        that answers nothing at all (unreachable, link cut): that fails after ``timeout_s`` of silence, as in the
        sequential flow. When that bound ends, or None for other pulls."""
        if not pull.early:
            return None
        peer = self._peers.get(pull.addr)
        return None if peer is None else max(pull.t0, peer.heard_at) + self.config.timeout_s

    def _expire(self, pull: PullState) -> None:
        """A pull's own deadline passed before its transfer started: fail it (only it). A peer that never
        answered anything since then and serves no other pull is dropped, so the next pull starts afresh."""
        err = (f"peer {pull.addr[0]}:{pull.addr[1]} did not serve transfer {pull.transfer_id[:8]}… of {pull.req_id!r} "
               f"within {self.config.timeout_s}s (last answer: {pull.last_reply})")
        self._fail(pull, err)
        peer = self._peers.get(pull.addr)
        if peer is not None and peer.heard_at <= pull.t0 and not self._pulls_of(peer):
            self._fail_peer(peer, err)
