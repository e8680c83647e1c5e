"""D's handling of P's side-channel answers (a part of `TransferSink`, service thread only): the handshake
(Challenge, HelloOk), a request's regions (Regions, NotReady, unknown request, P's refusal), the readable prefix
of a request P publishes layer by layer (pipelined transfer, docs/PROTOCOL.md section 6), Dones acknowledged and
leases P no longer holds (Alive)."""

from __future__ import annotations

import time
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.trace import trace
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.events import ANCHOR, RESIDUAL
from lynx_connector.transport.link import PeerLink, PullState, Staged
from lynx_connector.transport.scheduler import StreamJob

logger = init_logger(__name__)

__all__ = ["KEY_HINT", "ReplyHandlers"]

#: Handshakes P refuses in a row before D takes it as final (a wrong key, an incompatible peer): one refusal can
#: be P dropping a pending handshake under a flood of Hellos (handshake.py MAX_PENDING), not a verdict.
AUTH_RETRIES = 3
#: Addresses of Ps that shut down, went away or refused our handshake, remembered (D connects there only for a
#: pull, not for a Done) until a P handshakes there again or the hold runs out (`_hold_dones`).
MAX_CLOSED_ADDRS = 1024
#: P refused our handshake AUTH_RETRIES + 1 times: a key or KV layout that differ, or a flood of Hellos from others
#: that pushed ours out of P's pending handshakes. D cannot tell which, so the Dones it owes there stay owed but
#: wait this long before D handshakes again to send them (not every few seconds, four handshakes each).
REFUSED_HOLD_S = 30.0
#: Connection attempts to a P that fail at once, in a row, before D takes that P as gone.
GONE_REFUSALS = 2
KEY_HINT = ("LYNX_SIDE_CHANNEL_KEY_FILE / LYNX_SIDE_CHANNEL_KEY must hold the same key on every prefill and decode "
            "instance, and insecure_side_channel must be set on both or neither")


class ReplyHandlers:
    """Mixin of `TransferSink`: it works on the sink's pulls, peers, scheduler and counters."""

    config: Any
    compat: dict[str, Any]
    compat_hash: str
    _pulls: dict[str, PullState]
    _peers: dict[Any, PeerLink]
    _ev_lock: Any
    _ev_cond: Any
    _courier: Any
    _staged: list[Staged]
    _peers_closed: int
    _peers_gone: int
    _log: Any
    _closed_addrs: dict[Any, float]

    def _on_plain(self, peer: PeerLink, msg: proto.Message) -> None:
        """Frames outside a session: P's Challenge, or its Error to a peer without a (valid) session."""
        where = f"{peer.addr[0]}:{peer.addr[1]}"
        if isinstance(msg, proto.Challenge):
            if peer.state != "hello":
                return  # the answer to a re-sent Hello: the first one was taken
            if not peer.on_challenge(msg):
                self._handshake_failed(peer, f"side-channel handshake with {where} failed: the prefill instance "
                                       f"did not prove this deployment's key ({KEY_HINT})")
                return
            peer.auth(self.compat)
            return
        if not isinstance(msg, proto.Error):
            self._log.warn("unexpected", "side channel from %s: unexpected %s outside a session", where,
                           type(msg).__name__)
            return
        if peer.state == "ready" and msg.code == "refused":
            # P no longer knows our session (restarted, or dropped it): a fresh connection and full handshake
            self._security["sessions_lost"] += 1
            self._reconnect(peer, time.monotonic(), why="lost our session")
            return
        if peer.state == "ready":  # P answers a session only sealed, or "refused" when it lost it: this one is
            # not P's (an on-path injection would otherwise fail every pull of the session and free P's staging)
            self._security["unsealed_ignored"] += 1
            self._log.warn("unsealed", "side channel from %s: ignored an unsealed %r error inside the session", where,
                           msg.code[:64])
            return
        if msg.code == "refused" and peer.state == "auth" and peer.auth_refusals < AUTH_RETRIES:
            # P may have dropped our handshake before our Auth came (it keeps MAX_PENDING of them: a flood of
            # Hellos from others evicts the oldest): a fresh connection and handshake. A wrong key is refused again.
            peer.auth_refusals += 1
            self._security["handshakes_retried"] += 1
            self._reconnect(peer, time.monotonic(), why="refused our handshake (trying again, in case P dropped it)")
            return
        if msg.code == "refused":
            what = ("refused our proof of the deployment key or found the model, KV layout or codec incompatible "
                    f"(P's log says which; {KEY_HINT})" if peer.state == "auth" else
                    f"refused the handshake ({KEY_HINT}; P's log says why)")
            self._fail_peer(peer, f"side-channel handshake with {where} failed: the prefill instance {what}")
            self._hold_dones(peer.addr, REFUSED_HOLD_S, drop=False)
            return
        self._handshake_failed(peer, f"peer {where} rejected the side channel ({msg.code}): {msg.message[:200]}")

    def _on_reply(self, peer: PeerLink, msg: proto.Message) -> None:
        if isinstance(msg, proto.HelloOk):
            if peer.state == "auth":
                self._on_hello(peer, msg)
            else:  # the answer to a handshake sent again (re-sent or reconnected) after the first was answered
                logger.debug("side channel from %s: HelloOk after the handshake, ignored", peer.name)
        elif isinstance(msg, proto.Error) and not msg.transfer_id and msg.code == proto.CLOSING:
            self._on_closing(peer)
        elif isinstance(msg, proto.Error) and not msg.transfer_id:
            self._fail_peer(peer, f"peer {peer.addr[0]}:{peer.addr[1]} error ({msg.code}): {msg.message[:200]}")
        elif isinstance(msg, (proto.Regions, proto.NotReady, proto.Error)):
            for pull in self._pulls_of(peer, msg.transfer_id):
                if pull.state == "query":
                    self._on_query_reply(pull, peer, msg)
                elif pull.state == "transferring" and pull.ready is not None:
                    self._on_progress(pull, peer, msg)
                elif pull.state == "transferring" and pull.follows_token:
                    self._on_token_reply(pull, msg)  # transport/first_token.py
                self._note_first_token(pull, msg)
        elif isinstance(msg, proto.Ack):
            self._courier.ack(peer.addr, msg.transfer_id)
        elif isinstance(msg, proto.Alive):
            gone = set(msg.gone)
            for pull in [p for p in self._pulls_of(peer)
                         if p.transfer_id in gone and p.state in ("transferring", "staged")]:
                self._lease_lost += 1
                self._fail(pull, f"peer {peer.name} no longer holds transfer {pull.transfer_id[:8]}… of "
                           f"{pull.req_id!r} while it is being pulled (its lease ran out or it was freed)")
        else:
            self._log.warn("unexpected", "side channel from %s:%s: unexpected %s", *peer.addr, type(msg).__name__)

    def _on_monitor(self, peer: PeerLink) -> None:
        """zmq's events on the connection to ``peer``: connected again by itself (whoever answers there now, P
        restarted on the same address?, gets a full handshake before any answer is trusted), or its attempts to
        connect were refused GONE_REFUSALS times in a row (each failed within REFUSED_WITHIN_S: `PeerLink`):
        nothing listens on that P's port, so the P process that issued the tickets D pulls is gone (killed, or
        stopped without closing in order; a P listens from before it issues its first ticket until it closes),
        and so is its staging. An attempt that hangs (a partition, a crashed host) is no refusal: those pulls wait
        as before. What P said before it went (its goodbye) is read first."""
        if peer.reconnected():
            self._reconnect(peer, time.monotonic(), why="connection re-established by zmq")
        elif peer.refusals >= GONE_REFUSALS:
            self._drain_peer(peer)  # a goodbye queued beside the refusals: P shut down, it did not vanish
            if self._peers.get(peer.addr) is peer:
                self._peers_gone += 1
                self._end_peer(peer, "went away (its side-channel port refuses connections)")

    def _on_closing(self, peer: PeerLink) -> None:
        """P is shutting down (its sealed ``Error("closing")``, docs/PROTOCOL.md section 9)."""
        if self._peers.get(peer.addr) is peer:
            self._peers_closed += 1
            self._end_peer(peer, "shut down")

    def _end_peer(self, peer: PeerLink, what: str) -> None:
        """A P that shut down or went away: its staging went with it, so every pull still reading from it fails
        now, not at its deadline, and no Done is owed for its transfers (none could be acknowledged). Pulls read
        whole are kept. Until a P handshakes at that address again, D connects there only for a new pull."""
        failing = sum(1 for p in self._pulls_of(peer) if p.pending)
        (logger.info if failing else logger.debug)(
            "lynx sink: prefill instance %s %s: %d pull(s) from it fail now", peer.name, what, failing)
        self._fail_peer(peer, f"prefill instance {peer.name} {what} while this request was pulled from it",
                        owe_done=False)
        self._hold_dones(peer.addr, peer.lease_s or self.config.lease_s, drop=True)

    def _handshake_failed(self, peer: PeerLink, error: str) -> None:
        """A handshake that failed for good (P did not prove our key, or speaks another protocol or KV layout): its
        pulls fail with ``error``, and D owes that P no Done (each would re-handshake, failing again, every few
        seconds until the lease): P's lease frees what it staged; a new pull handshakes afresh."""
        self._fail_peer(peer, error, owe_done=False)
        self._hold_dones(peer.addr, peer.lease_s or self.config.lease_s, drop=True)

    def _other_version(self, peer: PeerLink, version: int) -> None:
        """P answered our handshake in another protocol version (a rolling upgrade across a protocol change): its
        pulls fail now, naming both versions, instead of re-sending Hellos until ``timeout_s``."""
        self._security["other_version"] += 1
        self._handshake_failed(peer, f"side-channel handshake with {peer.addr[0]}:{peer.addr[1]} failed: the prefill "
                               f"instance speaks side-channel protocol {version}, this decode instance "
                               f"{proto.VERSION}: P and D must run releases of one protocol (docs/OPERATIONS.md, "
                               "\"Upgrades\")")

    def _hold_dones(self, addr: Any, seconds: float, drop: bool) -> None:
        """No Done goes to ``addr`` (a P that closed, went away or refused our handshake) for ``seconds`` or until a
        P handshakes there again (`_said_closing`): ``drop``: those owed now are dropped too (never sendable);
        else they wait, and are sent when the hold ends."""
        if drop:
            self._courier.forget(addr)
        if len(self._closed_addrs) >= MAX_CLOSED_ADDRS:
            self._closed_addrs.pop(next(iter(self._closed_addrs)))
        self._closed_addrs[addr] = time.monotonic() + seconds

    def _said_closing(self, addr: Any) -> bool:
        """The P at ``addr`` shut down, went away or refused our handshake, no P there has handshaken since, and
        the hold (`_hold_dones`) has not run out: a Done owed there (a discard, perhaps of a P restarted at that
        address) waits for the next handshake there (`DoneCourier.resume`) or the hold's end instead of
        connecting to a port nobody may listen on, or one that refuses us."""
        until = self._closed_addrs.get(addr)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._closed_addrs[addr]
        return False

    def _on_hello(self, peer: PeerLink, msg: proto.HelloOk) -> None:
        if msg.compat_hash != self.compat_hash:
            self._handshake_failed(peer, f"peer {peer.addr[0]}:{peer.addr[1]} compat hash {msg.compat_hash[:12]} != "
                                   f"ours {self.compat_hash[:12]}")
            return
        same = bool(peer.agent) and peer.agent == msg.agent_name and peer.pool_addr == msg.pool_addr
        if peer.agent and not same:  # re-handshake with a restarted P: its old staging is gone
            self._sched.fail_peer(peer.agent, f"peer {peer.addr[0]}:{peer.addr[1]} restarted")
            peer.forget_agent(self._nixl)
        if not same:
            try:
                peer.agent = self._nixl.add_remote(msg.agent_md)
            except Exception as exc:
                self._fail_peer(peer, f"peer {peer.addr[0]}:{peer.addr[1]}: bad NIXL metadata: {exc}")
                return
        peer.state, peer.pool_addr, peer.pool_nbytes = "ready", msg.pool_addr, msg.pool_nbytes
        self._closed_addrs.pop(peer.addr, None)  # a P runs there again: Dones to it are owed as usual
        peer.auth_refusals = 0
        peer.session_id, peer.lease_s, peer.keepalive_at = msg.session_id, msg.lease_s, 0.0
        if 0 < msg.lease_s < self.config.timeout_s:  # a pull waiting for D's staging does not renew it
            self._log.warn("short_lease", "peer %s:%s leases staging for %gs, less than this D's "
                           "timeout_s %gs: a request waiting that long for D's staging (sequential flow) finds it "
                           "freed; raise P's lease_s", *peer.addr, msg.lease_s, self.config.timeout_s)
        self._security["handshakes"] += 1
        logger.info("lynx sink: handshake with %s:%s done (agent %s%s%s)", *peer.addr, peer.agent,
                    ", reconnected" if peer.reconnects else "",
                    ", under the extra key of a rotation" if peer.extra_key else "")
        self._courier.resume(peer.addr, time.monotonic())  # Dones refused while the session was down
        for pull in self._pulls_of(peer):
            if pull.state not in ("transferring", "staged"):  # a staged pull's lease: KeepAlives (gone = fail)
                self._query(pull)

    def _on_query_reply(self, pull: PullState, peer: PeerLink, msg: proto.Message) -> None:
        pull.sent_at = None
        if isinstance(msg, proto.NotReady) or (isinstance(msg, proto.Error) and msg.code == "unknown_request"):
            pull.last_reply = "not ready" if isinstance(msg, proto.NotReady) else "unknown request"
            cfg, now = self.config, time.monotonic()
            if pull.early:  # concurrent flow: P may not have the request yet; ask often, until the deadline
                pull.backoff = min(cfg.pipeline_poll_s, max(cfg.retry_s, 2 * pull.backoff))
                pull.retry_at = now + pull.backoff
                return
            if isinstance(msg, proto.NotReady):
                pull.unknown_since = None
            elif pull.unknown_since is None:
                pull.unknown_since = now
            elif now - pull.unknown_since >= cfg.unknown_grace_s:  # P publishes before it answers: final
                self._fail(pull, f"peer {peer.addr[0]}:{peer.addr[1]} does not have transfer {pull.transfer_id[:8]}… of {pull.req_id!r} "
                           f"(for {cfg.unknown_grace_s:g}s: its lease ran out, P restarted, or it was never staged)")
                return
            pull.backoff = min(cfg.retry_max_s, max(cfg.retry_s, 2 * pull.backoff))
            pull.retry_at = now + pull.backoff
            return
        if isinstance(msg, proto.Error):
            self._fail(pull, f"peer {peer.addr[0]}:{peer.addr[1]} refused {pull.req_id!r} "
                       f"({msg.code}): {msg.message}")
            return
        assert isinstance(msg, proto.Regions)
        if pull.layouts is not None and not self._take_layout(pull, peer, msg):
            return
        # No local residual view = this pull wants the anchor only (e.g. decoding on the anchor alone): the
        # remote residual is then not read, whatever its size; otherwise both sizes must match exactly.
        want_r = msg.residual_nbytes if pull.residual is None else pull.residual[1]
        if msg.anchor_nbytes != pull.anchor[1] or msg.residual_nbytes != want_r:
            self._fail(pull, f"size mismatch for {pull.req_id!r}: remote anchor/residual "
                       f"{msg.anchor_nbytes}/{msg.residual_nbytes} bytes, local views {pull.anchor[1]}/{want_r}")
            return
        for off, n in ((msg.anchor_offset, msg.anchor_nbytes), (msg.residual_offset, msg.residual_nbytes)):
            if n and not (0 <= off and off + n <= peer.pool_nbytes):
                self._fail(pull, f"region [{off}, {off + n}) outside the peer's {peer.pool_nbytes}-byte pool")
                return
        if pull.held:  # watched: P holds it now; D's staging comes with `attach`, P's lease renewed meanwhile
            pull.state, pull.generation = "staged", msg.generation
            pull.deadline = time.monotonic() + 2 * self.config.timeout_s  # the caller's own wait ends first
            with self._ev_cond:
                self._staged.append(Staged(pull.req_id, msg.mode, msg.auto_reason))
                self._ev_cond.notify_all()
            return
        pull.state, pull.generation = "transferring", msg.generation
        ready = self._ready(pull, msg)
        if ready is not None:  # layer-wise publish: read what is ready, ask again for the rest
            self._pipelined += 1
            pull.ready, pull.progress_at = ready, time.monotonic()
            pull.requery_at = pull.progress_at + self.config.pipeline_poll_s
        self._sched.submit(StreamJob(pull.req_id, ANCHOR, peer.agent, pull.anchor[0],
                                     peer.pool_addr + msg.anchor_offset, pull.anchor[1], pull.t0,
                                     ready=None if ready is None else ready[0], order=pull.order))
        if pull.residual is not None:
            self._sched.submit(StreamJob(pull.req_id, RESIDUAL, peer.agent, pull.residual[0],
                                         peer.pool_addr + msg.residual_offset, pull.residual[1], pull.t0,
                                         ready=None if ready is None else ready[1], order=pull.order))

    def _take_layout(self, pull: PullState, peer: PeerLink, msg: proto.Regions) -> bool:
        """A watched pull that let P choose the mode (auto, concurrent flow): the sizes of the mode P names in its
        first Regions become the pull's. False (the pull failed) when P names a mode the pull does not accept."""
        assert pull.layouts is not None
        sizes = pull.layouts.get(msg.mode)
        if sizes is None:
            self._fail(pull, f"peer {peer.name} staged {pull.req_id!r} as mode {msg.mode or '(none)'!r}, not one of "
                       f"the modes this pull accepts ({', '.join(pull.layouts)})")
            return False
        pull.anchor, pull.residual = (0, sizes[0]), ((0, sizes[1]) if sizes[1] else None)
        pull.pending = pull.streams()
        pull.layouts = None  # decided: later answers are checked against these sizes
        return True

    @staticmethod
    def _ready(pull: PullState, msg: proto.Regions) -> tuple[int, int] | None:
        """The readable (anchor, residual) bytes a Regions answer names for this pull; None when all it reads."""
        a = pull.anchor[1] if msg.anchor_ready < 0 else min(msg.anchor_ready, pull.anchor[1])
        want_r = 0 if pull.residual is None else pull.residual[1]
        r = want_r if msg.residual_ready < 0 else min(msg.residual_ready, want_r)
        return None if (a, r) == (pull.anchor[1], want_r) else (a, r)

    def _on_progress(self, pull: PullState, peer: PeerLink, msg: proto.Message) -> None:
        """P's answer to a query for more of a request it publishes layer by layer (the transfer has started)."""
        pull.sent_at = None
        now = time.monotonic()
        if not isinstance(msg, proto.Regions):
            if isinstance(msg, proto.Error):
                self._fail(pull, f"peer {peer.name} gave up on {pull.req_id!r} while publishing it "
                           f"({msg.code}): {msg.message[:200]}")
            else:
                pull.requery_at = now + self.config.pipeline_poll_s
            return
        if msg.generation != pull.generation:
            self._fail(pull, f"peer {peer.name} answered for another staging of {pull.req_id!r} (generation "
                       f"{msg.generation}, pulling {pull.generation})")
            return
        ready = self._ready(pull, msg)
        old = pull.ready
        assert old is not None
        if ready is None or ready[0] > old[0] or ready[1] > old[1]:
            pull.progress_at = now
        if ready is None:
            trace("D", pull.transfer_id, "all_published_seen")
        self._sched.extend(pull.req_id, {ANCHOR: None if ready is None else ready[0],
                                         RESIDUAL: None if ready is None else ready[1]})
        pull.ready = ready
        pull.requery_at = None if ready is None else now + self.config.pipeline_poll_s
