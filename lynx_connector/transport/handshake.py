"""P's side of the authenticated side channel (protocol v4, docs/PROTOCOL.md section 1): the handshake
(Hello -> Challenge -> Auth -> HelloOk), the sessions per zmq identity, sealed replies, the single ``refused``
answer for everyone else, and rate-limited warnings about bad frames.

`SideChannelServer` is the part of `TransferSource` that speaks to the socket; the source provides the
socket, the key, the counters and ``_answer`` (what a session may ask about staged requests).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto

logger = init_logger(__name__)

__all__ = ["SideChannelServer", "PendingHandshakes", "peer_host", "MAX_SESSIONS", "MAX_PENDING", "MAX_PENDING_PER_HOST"]

MAX_SESSIONS = 1024  # authenticated sessions kept (least recently used dropped first)
MAX_PENDING = 4096  # handshakes between Challenge and Auth kept (oldest dropped first; D tries again)
#: ... of which one peer host holds at most this many (its oldest dropped first): one host's flood of Hellos
#: cannot push out another host's handshake. Each D has one handshake per P at a time.
MAX_PENDING_PER_HOST = 256
PENDING_TTL_S = 30.0
LOG_CHARS = 200  # log lines about bad frames: truncated, at most one per second per kind
LOG_EVERY_S = 1.0


@dataclass
class Pending:
    nonce_d: bytes
    nonce_p: bytes
    challenge: bytes  # the encoded Challenge, sent again for a re-sent Hello
    expires: float
    host: str = ""  # the peer's address as zmq saw it ("" = not known)


class PendingHandshakes:
    """The handshakes between P's Challenge and D's Auth, by zmq identity: at most MAX_PENDING in all and
    MAX_PENDING_PER_HOST per peer host, the oldest dropped first (of that host, then of all)."""

    def __init__(self) -> None:
        self._all: OrderedDict[bytes, Pending] = OrderedDict()
        self._by_host: dict[str, OrderedDict[bytes, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, ident: object) -> bool:
        return ident in self._all

    def get(self, ident: bytes) -> Pending | None:
        return self._all.get(ident)

    def add(self, ident: bytes, pending: Pending) -> None:
        self.pop(ident)
        mine = self._by_host.get(pending.host)
        if mine is not None and len(mine) >= MAX_PENDING_PER_HOST:
            self.pop(next(iter(mine)))
        if len(self._all) >= MAX_PENDING:
            self.pop(next(iter(self._all)))
        self._all[ident] = pending
        self._by_host.setdefault(pending.host, OrderedDict())[ident] = None

    def pop(self, ident: bytes) -> Pending | None:
        pending = self._all.pop(ident, None)
        if pending is not None:
            mine = self._by_host[pending.host]
            del mine[ident]
            if not mine:
                del self._by_host[pending.host]
        return pending

    def expire(self, now: float) -> None:
        for ident in [i for i, p in self._all.items() if p.expires <= now]:
            self.pop(ident)


@dataclass
class Session:
    session_id: bytes
    owner: bytes  # stays the same across D's reconnects (Auth.resume)
    skey: bytes
    opener: proto.Opener
    send_seq: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    #: the compat hash this session's HelloOk carries (``proto.compat_hash_for``: a D of an earlier release
    #: gets the hash of the fields it sent)
    compat_hash: str = ""


class RateLimitedLog:
    """Warnings about bad frames: truncated to LOG_CHARS, at most one per LOG_EVERY_S per kind."""

    def __init__(self, prefix: str = "side channel") -> None:
        self._prefix = prefix
        self._last: dict[str, float] = {}
        self.suppressed = 0

    def warn(self, kind: str, text: str, *args: object) -> None:
        """``text % args`` (formatted only when it is logged), as one warning."""
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < LOG_EVERY_S:
            self.suppressed += 1
            return
        self._last[kind] = now
        logger.warning("%s: %s", self._prefix, (text % args if args else text)[:LOG_CHARS])


class SideChannelServer:
    """The handshake and session layer of `TransferSource` (a mixin: it works on the source's attributes)."""

    _sock: zmq.Socket
    _key: bytes
    _sessions: Any
    _pending: PendingHandshakes
    _log: RateLimitedLog
    counters: dict[str, int]

    def _send(self, ident: bytes, frame: bytes, what: str, quiet: bool = False) -> bool:
        """``quiet``: a frame nobody may be left to read (P's goodbye to a D that is gone): not counted or logged."""
        try:
            self._sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (EHOSTUNREACH) or its queue full (EAGAIN): D will ask again
            if not quiet:
                self.counters["replies_dropped"] += 1
                self._log.warn("dropped", "side-channel reply %s dropped: %s", what, exc)
            return False
        return True

    def _reply_plain(self, ident: bytes, msg: proto.Message) -> None:
        self._send(ident, proto.encode(msg), type(msg).__name__)

    def _reply_sealed(self, ident: bytes, sess: Session, msg: proto.Message, quiet: bool = False) -> bool:
        sess.send_seq += 1
        return self._send(ident, proto.seal(sess.skey, proto.P_TO_D, sess.send_seq, proto.encode(msg)),
                          type(msg).__name__, quiet)

    def _say_goodbye(self) -> int:
        """P is closing (service thread, after its last pass): an unasked, sealed ``Error("closing")`` to every
        session, so each D fails its pulls from this P at once instead of at their deadline, and forgets the
        Dones it owes (docs/PROTOCOL.md section 9). Sessions whose D is gone are skipped without a warning.
        Returns how many were handed to zmq (``close`` lingers briefly so they leave)."""
        msg = proto.Error(v=proto.VERSION, code=proto.CLOSING, message="the prefill instance is shutting down")
        return sum(self._reply_sealed(ident, sess, msg, quiet=True) for ident, sess in list(self._sessions.items()))

    def _refuse(self, ident: bytes, counter: str, kind: str, why: str) -> None:
        """The one answer for anyone without a session or a failed handshake: Error("refused"), nothing else."""
        self.counters[counter] += 1
        self._log.warn(kind, why)
        self._reply_plain(ident, proto.Error(v=proto.VERSION, code="refused", message="refused"))

    def _handle(self, frames: list[bytes], origin: zmq.Frame | None = None) -> None:
        """One message from the ROUTER; ``origin``: its last frame as zmq received it, asked for the peer's address
        only for a Hello (its handshake counts against that host's share of the pending handshakes)."""
        ident = frames[0]
        if len(frames) != 2:
            self._refuse(ident, "malformed", "frames", f"rejected a message with {len(frames) - 1} frames")
            return
        frame = frames[1]
        if len(frame) > self.config.max_message_bytes:
            self._refuse(ident, "malformed", "oversize",
                         f"rejected a {len(frame)}-byte message (limit {self.config.max_message_bytes})")
            return
        if frame[:1] == bytes([proto.SEALED]):
            self._handle_sealed(ident, frame)
            return
        try:
            msg = proto.decode(frame, self.config.max_message_bytes)
        except proto.ProtocolError as exc:
            if isinstance(exc, proto.VersionMismatch):
                # a Hello of another version: a D of another release (a rolling upgrade), no more than a handshake
                # begun; any other frame of another version counts as malformed, as the security alert expects
                self.counters["other_version" if exc.kind == "hello" else "malformed"] += 1
                self._log.warn("version", "a peer speaks another side-channel protocol: %s; P and D must run releases "
                               "of one protocol (docs/OPERATIONS.md, \"Upgrades\")", exc)
                self._reply_plain(ident, proto.Error(v=proto.VERSION, code="unsupported_version",
                                                     message=f"this prefill instance speaks protocol {proto.VERSION}"))
                return
            self._refuse(ident, "malformed", "malformed", f"rejected a malformed message: {exc}")
            return
        if not isinstance(msg, proto.Hello):
            self._refuse(ident, "refused", "no_session", f"refused a {type(msg).__name__} outside a session")
            return
        self._on_hello(ident, msg, "" if origin is None else peer_host(origin))

    def _on_hello(self, ident: bytes, msg: proto.Hello, host: str = "") -> None:
        pending = self._pending.get(ident)
        if pending is not None and pending.nonce_d == msg.nonce_d:  # a re-sent Hello: the same Challenge again
            self._send(ident, pending.challenge, "Challenge")
            return
        nonce_p = secrets.token_bytes(16)
        challenge = proto.encode(proto.Challenge(v=proto.VERSION, nonce_p=nonce_p,
                                                 proof_p=proto.proof_p(self._key, msg.nonce_d, nonce_p)))
        self._pending.add(ident, Pending(msg.nonce_d, nonce_p, challenge, time.monotonic() + PENDING_TTL_S, host))
        self._send(ident, challenge, "Challenge")

    def _handle_sealed(self, ident: bytes, frame: bytes) -> None:
        sess = self._sessions.get(ident)
        if sess is not None:
            verdict, payload = sess.opener.open(frame)
            if verdict == "ok":
                self._sessions.move_to_end(ident)
                sess.last_seen = time.monotonic()
                try:
                    msg = proto.decode(payload, self.config.max_message_bytes)
                except proto.ProtocolError as exc:
                    self.counters["malformed"] += 1
                    self._log.warn("malformed", "rejected a malformed message in a session: %s", exc)
                    self._reply_sealed(ident, sess, proto.Error(v=proto.VERSION, code="malformed",
                                                                message=str(exc)[:200]))
                    return
                if isinstance(msg, proto.Auth):  # a re-sent Auth: HelloOk again
                    self._reply_sealed(ident, sess, self._hello_ok(sess))
                    return
                reply = self._answer(sess, msg)
                if not self._reply_sealed(ident, sess, reply) and isinstance(reply, proto.Regions):
                    self._disown(reply.transfer_id, sess.owner)
                return
            if ident not in self._pending:
                self.counters[verdict] += 1
                self._log.warn(verdict, "dropped a frame with a %s", "bad MAC" if verdict == "bad_mac" else "replayed seq")
                return
        pending = self._pending.get(ident)
        if pending is None:
            self._refuse(ident, "refused", "no_session", "refused a sealed frame from a peer without a session")
            return
        self._on_auth(ident, pending, frame)

    def _on_auth(self, ident: bytes, pending: Pending, frame: bytes) -> None:
        self._pending.pop(ident)
        skey = proto.session_key(self._key, pending.nonce_d, pending.nonce_p)
        opener = proto.Opener(skey, proto.D_TO_P)
        verdict, payload = opener.open(frame)
        msg: proto.Message | None = None
        if verdict == "ok":
            try:
                msg = proto.decode(payload, self.config.max_message_bytes)
            except proto.ProtocolError:
                msg = None
        expected = proto.proof_d(self._key, pending.nonce_d, pending.nonce_p)
        if not isinstance(msg, proto.Auth) or not hmac.compare_digest(msg.proof_d, expected):
            self._refuse(ident, "auth_failed", "auth",
                         "handshake refused: the peer did not prove the deployment key (a different "
                         "LYNX_SIDE_CHANNEL_KEY(_FILE), or insecure_side_channel on one side only)")
            return
        diff = proto.compat_diff(self.compat, msg.compat, optional=proto.LATER_COMPAT_FIELDS)
        if diff:
            self._refuse(ident, "auth_failed", "incompatible", "handshake refused: incompatible peer: " + "; ".join(diff))
            return
        unsent = [k for k in proto.LATER_COMPAT_FIELDS if k in self.compat and k not in msg.compat]
        if unsent:  # a D of an earlier release: compared on the fields it knows
            self._log.warn("earlier_release", "a peer of an earlier release did not send %s: not compared (upgrade "
                           "it to check them)", ", ".join(unsent))
        owner = secrets.token_bytes(16)
        if msg.resume:  # D reconnected: its transfers stay its own
            for old_ident, old in list(self._sessions.items()):
                if hmac.compare_digest(old.session_id, msg.resume):
                    owner = old.owner
                    del self._sessions[old_ident]
                    break
        self._sessions.pop(ident, None)
        if len(self._sessions) >= MAX_SESSIONS:
            self._sessions.popitem(last=False)
        sess = Session(session_id=secrets.token_bytes(16), owner=owner, skey=skey, opener=opener,
                       compat_hash=proto.compat_hash_for(self.compat, msg.compat))
        self._sessions[ident] = sess
        self.counters["sessions"] += 1
        self._reply_sealed(ident, sess, self._hello_ok(sess))

    def _hello_ok(self, sess: Session) -> proto.HelloOk:
        return proto.HelloOk(v=proto.VERSION, agent_name=self.name, agent_md=self._md, pool_addr=self.pool.base_addr,
                             pool_nbytes=self.pool.nbytes, compat_hash=sess.compat_hash, session_id=sess.session_id,
                             lease_s=self.config.lease_s)


def peer_host(frame: zmq.Frame) -> str:
    """The address of the peer a frame came from, as zmq saw it ("" when it does not say)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, ValueError, TypeError):
        return ""
