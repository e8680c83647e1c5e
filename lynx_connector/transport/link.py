"""D's control-path state: the side-channel connection to one P (`PeerLink`: a zmq DEALER socket, the handshake
and session state (protocol v4: Hello -> Challenge -> Auth -> HelloOk, then sealed frames) and liveness), one
pull's state (`PullState`) and the Dones owed to peers (`DoneCourier`).

The sink's service thread owns every link (zmq sockets are not thread-safe). A link can be re-opened: a new
socket, hence a new zmq identity and TCP connection, for a peer that stopped answering; the NIXL agent added
for the peer is kept across that (`agent`), so transfers in flight are not affected.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from lynx_connector.limits import PEER_HOST
from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.events import ANCHOR, RESIDUAL
from lynx_connector.transport.handshake import RateLimitedLog

logger = init_logger(__name__)

__all__ = ["Addr", "DoneCourier", "Measure", "NO_MEASURE", "PeerLink", "PullState", "Staged", "check_peer_addr",
           "check_ticket", "done_frame"]

Addr = tuple[str, int]


def check_peer_addr(host: object, port: object) -> None:
    """Refuse (ValueError) a peer address D could not connect to, before anything is owed to it."""
    if (not isinstance(host, str) or not PEER_HOST.fullmatch(host) or isinstance(port, bool)
            or not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"bad peer address {host!r}:{port!r}")


def check_ticket(host: object, port: object, transfer_id: object, token: object) -> None:
    """Refuse (ValueError) what a pull or a discard names that could never reach P: its ticket (transfer id and
    token) and P's address."""
    for what, val in (("transfer_id", transfer_id), ("token", token)):
        if not proto.is_hex_id(val):
            raise ValueError(f"{what} must be {proto.HEX_ID_LEN} lower-case hex characters")
    check_peer_addr(host, port)
#: What a Done tells P of the link (protocol v4): (seconds of link time D's reads took, bytes they read).
Measure = tuple[float, int]
NO_MEASURE: Measure = (0.0, 0)


def done_frame(ticket: tuple[str, str], measure: Measure) -> proto.Done:
    """The Done of ``ticket`` (transfer id, token), first sent and re-sent alike, with D's measure of the link."""
    return proto.Done(v=proto.VERSION, transfer_id=ticket[0], token=ticket[1], link_s=measure[0],
                      link_bytes=measure[1])

HEARTBEAT_IVL_MS = 1000  # zmq-level heartbeats: a dead TCP connection is noticed and re-established by zmq
HEARTBEAT_TIMEOUT_MS = 3000
#: A connection attempt that fails within this many seconds was refused (nothing listens there: RST, or an ICMP
#: port-unreachable); one that fails later timed out or found no route, which says nothing of the P process.
REFUSED_WITHIN_S = 1.0
MAX_FRAMES_PER_DRAIN = 256


class PeerLink:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, addr: Addr, max_message_bytes: int,
                 key: bytes | None = None, extra_keys: tuple[bytes, ...] = ()) -> None:
        self.addr = addr
        self._ctx, self._poller, self._max_bytes = ctx, poller, max_message_bytes
        self._send_log = RateLimitedLog()
        # insecure: an empty key, same protocol; a rotation's extra key is accepted from P, then spoken with it
        self._keys = (key if key is not None else b"", *extra_keys)
        self._key = self._keys[0]
        self.extra_key = False  # this session's key is the rotation's extra key (P proved it, not ours)
        self.state = "hello"  # hello (Hello sent) -> auth (Auth sent) -> ready; failed once dropped
        self.nonce_d = secrets.token_bytes(16)  # one per connection: a re-sent Hello is the same Hello
        self.skey = b""
        self.opener: proto.Opener | None = None
        self.send_seq = 0
        self.session_id = b""  # of the current (or last) session: sent as Auth.resume after a reconnect
        self.agent = ""  # NIXL name of the peer's agent once added
        self.pool_addr = 0
        self.pool_nbytes = 0
        self.lease_s = 0.0  # P's lease (HelloOk): D renews what it pulls every quarter of it
        self.keepalive_at = 0.0  # when the next KeepAlive is due (0: none sent on this session yet)
        self.hello_at = 0.0  # when the (last) Hello was sent
        self.heard_at = 0.0  # when the peer last answered anything (0: never)
        self.opened_at = 0.0  # when the current connection was opened
        self.asked_at = 0.0  # when the first message still awaiting an answer was sent
        self.reconnects = 0
        self.auth_refusals = 0  # handshakes P refused in a row (replies.py: tried again up to AUTH_RETRIES times)
        self.connects = 0  # TCP connections zmq has established on the current socket
        #: connection attempts refused in a row on the current socket, since its last connection (a port nothing
        #: listens on refuses within REFUSED_WITHIN_S; a partition leaves the attempt pending, then times out)
        self.refusals = 0
        self._attempting = 0.0  # when the attempt under way started (0: none)
        self.monitor: zmq.Socket | None = None
        self.sock = self._open()

    @property
    def name(self) -> str:
        return f"{self.addr[0]}:{self.addr[1]}"

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._max_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.IPV6, int(self.addr[0].startswith("[")))  # an IPv6 P; a name stays IPv4 as before
        # zmq re-establishes a dropped TCP connection by itself, silently: the monitor tells D, which must then
        # handshake again before trusting any answer (P may have restarted on the same address); it also tells D
        # when zmq's attempts to connect fail at once (nothing listens on P's port: that P process is gone)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CLOSED)
        try:
            sock.connect(f"tcp://{self.addr[0]}:{self.addr[1]}")
        except zmq.ZMQError:  # an address check_peer_addr let through: nothing may stay open or registered
            self.monitor.close(linger=0)
            self.monitor = None
            sock.close(linger=0)
            raise
        self._poller.register(self.monitor, zmq.POLLIN)
        self._poller.register(sock, zmq.POLLIN)
        self.opened_at = time.monotonic()
        self.connects = 0
        self.refusals, self._attempting = 0, 0.0
        return sock

    def reconnected(self) -> bool:
        """Drain the monitor; True when zmq connected again after the first connection of this socket."""
        again = False
        while self.monitor is not None:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connects += 1
                self.refusals, self._attempting = 0, 0.0
                again = again or self.connects > 1
            elif event["event"] == zmq.EVENT_CONNECT_DELAYED:  # a connection attempt is under way
                self._attempting = time.monotonic()
            elif event["event"] == zmq.EVENT_CLOSED and self._attempting:  # ... and it failed: refused if at once
                # (zmq reports a timed-out or unreachable attempt the same way, but only after seconds)
                refused = time.monotonic() - self._attempting <= REFUSED_WITHIN_S
                self.refusals = self.refusals + 1 if refused else 0
                self._attempting = 0.0
        return again

    def silent_for(self, now: float) -> float:
        """How long the peer has left a message unanswered on the current connection (0 when it owes nothing):
        an idle pause between requests is not silence."""
        if self.heard_at >= self.asked_at:
            return 0.0
        return now - max(self.asked_at, self.opened_at)

    def silence_deadline(self, reconnect_s: float) -> float | None:
        """When the current silence, if it goes on, becomes a reason to reconnect."""
        if self.heard_at >= self.asked_at:
            return None
        return max(self.asked_at, self.opened_at) + reconnect_s

    def _send_frame(self, frame: bytes) -> None:
        """Send one frame (every frame D sends is answered by P)."""
        now = time.monotonic()
        if self.heard_at >= self.asked_at:  # the first question since P last spoke starts the silence clock
            self.asked_at = now
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue: the message is re-sent by the sink's timers (the log: once
            # per LOG_EVERY_S per link, a partitioned P with many pulls waiting would flood it)
            self._send_log.warn("send", "to %s: send failed: %s", self.name, exc)

    def send(self, msg: proto.Message) -> None:
        """Send a message inside the session (sealed); before the handshake reached Auth, nothing is sent."""
        if self.opener is None:
            return
        self.send_seq += 1
        self._send_frame(proto.seal(self.skey, proto.D_TO_P, self.send_seq, proto.encode(msg)))

    def hello(self, compat_hash: str) -> None:
        """Send (or send again: the same nonce) the Hello of the current connection."""
        self.hello_at = time.monotonic()
        self._send_frame(proto.encode(proto.Hello(v=proto.VERSION, nonce_d=self.nonce_d, compat_hash=compat_hash)))

    def on_challenge(self, msg: proto.Challenge) -> bool:
        """Check P's proof of a key we accept (ours, or a rotation's extra key); on success derive the session key
        from that key. False: P holds none of them."""
        for i, key in enumerate(self._keys):
            if hmac.compare_digest(msg.proof_p, proto.proof_p(key, self.nonce_d, msg.nonce_p)):
                self._key, self.extra_key = key, i > 0
                break
        else:
            return False
        self.skey = proto.session_key(self._key, self.nonce_d, msg.nonce_p)
        self.opener = proto.Opener(self.skey, proto.P_TO_D)
        self._proof_d = proto.proof_d(self._key, self.nonce_d, msg.nonce_p)
        self.state = "auth"
        return True

    def auth(self, compat: dict) -> None:
        """Send (or send again) Auth, sealed with the session key."""
        self.hello_at = time.monotonic()
        self.send(proto.Auth(v=proto.VERSION, proof_d=self._proof_d, compat=compat, resume=self.session_id))

    def reopen(self) -> None:
        """A fresh socket (identity, TCP connection) for the same address; the full handshake starts again."""
        self._close_socket(0)
        self.sock = self._open()
        self.state = "hello"
        self.nonce_d = secrets.token_bytes(16)
        self.skey, self.opener, self.send_seq = b"", None, 0
        self.reconnects += 1

    def frames(self) -> Iterator[bytes]:
        """The frames waiting on the socket (at most a bounded batch)."""
        for _ in range(MAX_FRAMES_PER_DRAIN):
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.heard_at = time.monotonic()
            yield frame

    def _close_socket(self, linger_ms: int) -> None:
        for s in (self.sock, self.monitor):
            if s is None:
                continue
            try:
                self._poller.unregister(s)
            except KeyError:
                pass
        self.sock.disable_monitor()
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
        self.sock.close(linger=linger_ms)

    def close(self, linger_ms: int = 0) -> None:
        self._close_socket(linger_ms)

    def forget_agent(self, nixl) -> None:
        """Remove the peer's NIXL agent from D's (a restarted P, or a peer dropped)."""
        if self.agent:
            try:
                nixl.remove_remote(self.agent)
            except Exception as exc:
                logger.debug("remove_remote_agent(%s): %s", self.agent, exc)
            self.agent = ""


@dataclass
class PullState:
    req_id: str
    addr: Addr
    transfer_id: str
    token: str
    anchor: tuple[int, int]  # (local addr, nbytes)
    residual: tuple[int, int] | None
    t0: float
    deadline: float
    state: str = "wait_peer"  # wait_peer -> query [-> staged (held) -> query] -> transferring
    retry_at: float | None = None  # query again at (after a NotReady answer)
    sent_at: float | None = None  # a query is out and unanswered since
    backoff: float = 0.0
    generation: int = 0  # of P's staging (Regions): seeds the checksums D verifies
    unknown_since: float | None = None  # P has answered "unknown request" since
    last_reply: str = "no answer"
    pending: set[str] = field(default_factory=set)
    failed: bool = False
    done_sent: bool = False
    link_s: float = 0.0  # the link time and bytes of its streams read so far (TransferEvent): told P in Done
    link_bytes: int = 0
    order: str = "split"  # how the request's output depends on its planes (transport/ranking.py)
    #: Concurrent flow: the proxy sent the request to P and D at once, so "unknown request" means "not yet"
    #: until the pull's deadline (which then covers P's queue and prefill).
    early: bool = False
    #: Pipelined transfer: bytes of (anchor, residual) P has made readable, while P still publishes layers
    #: (None: the whole regions are readable); when to ask again; when they last grew.
    ready: tuple[int, int] | None = None
    requery_at: float | None = None
    progress_at: float = 0.0
    #: Watched (`TransferSink.watch`): D has no staging for it yet; once P answers its regions the pull is
    #: "staged" and waits for `attach` (its anchor/residual addresses are 0 until then).
    held: bool = False
    #: Concurrent flow, speculative order: P's first token (``Regions.first_token``; -1 = not known yet), and
    #: whether D stopped asking for it (a bad value, or P no longer answers for the transfer).
    first_token: int = -1
    token_given_up: bool = False
    #: Watched pulls only (auto in the concurrent flow): the (anchor, residual) bytes D would stage for each
    #: transfer mode P may have chosen; P's first Regions names the mode (``Regions.mode``) and so the sizes.
    #: None: the sizes given to `watch` apply, whatever P names.
    layouts: dict[str, tuple[int, int]] | None = None

    def streams(self) -> set[str]:
        """The streams this pull reads: the anchor, and the residual when it has a residual view."""
        return {ANCHOR} if self.residual is None else {ANCHOR, RESIDUAL}

    @property
    def follows_token(self) -> bool:
        """D keeps asking P for its first token (transport/first_token.py) while this holds and the pull lives."""
        return self.early and self.order == "split" and self.first_token < 0 and not self.token_given_up


class Staged(NamedTuple):
    """A watched pull P has staged (`TransferSink.staged`): the transfer mode P named and why auto chose it."""

    req_id: str
    mode: str = ""
    auto_reason: str = ""


class DoneCourier:
    """The Dones D owes its peers: each is sent again, with back-off, until P acknowledges it or P's lease would
    have freed the staging anyway. A Done sent while P was silent, or lost on a reset connection, would else
    leave P's staging held until the lease ran out."""

    MAX_INTERVAL_S = 5.0

    def __init__(self, resend_s: float, give_up_s: float) -> None:
        self._resend_s, self._give_up_s = resend_s, give_up_s
        self._owed: dict[tuple[Addr, str], list[float]] = {}  # (peer, transfer id) -> [next send, interval, give up at]
        self._tokens: dict[tuple[Addr, str], tuple[str, Measure]] = {}  # -> (token, measured link)

    def __len__(self) -> int:
        return len(self._owed)

    def owe(self, addr: Addr, ticket: tuple[str, str], now: float, measure: Measure = NO_MEASURE) -> None:
        """``ticket``: (transfer id, token) of the Done; ``measure`` its (link seconds, bytes): sent again with it."""
        key = (addr, ticket[0])
        self._owed[key] = [now + self._resend_s, self._resend_s, now + self._give_up_s]
        self._tokens[key] = (ticket[1], measure)

    def ack(self, addr: Addr, transfer_id: str) -> None:
        self._owed.pop((addr, transfer_id), None)
        self._tokens.pop((addr, transfer_id), None)

    def resume(self, addr: Addr, now: float) -> None:
        """A session with ``addr`` is (again) up: the Dones owed to it are due at once, with their back-off reset
        (those sent while the session was down were refused unread)."""
        for key, st in self._owed.items():
            if key[0] == addr:
                st[0], st[1] = now, self._resend_s

    def owed_to(self, addr: Addr) -> bool:
        return any(a == addr for a, _ in self._owed)

    def hurry(self, now: float) -> None:
        """The Dones owed whose back-off put their next send past one resend interval are due at once (D is
        closing: no time to wait it out); those sent lately are resent on their own schedule, if unanswered."""
        for st in self._owed.values():
            if st[0] > now + self._resend_s:
                st[0], st[1] = now, self._resend_s

    def forget(self, addr: Addr) -> None:
        """Drop every Done owed to ``addr`` (an address D cannot even connect to: none could ever be sent)."""
        for key in [k for k in self._owed if k[0] == addr]:
            del self._owed[key]
            self._tokens.pop(key, None)

    def due(self, now: float) -> list[tuple[Addr, tuple[str, str], Measure]]:
        """The Dones to send again now, as (peer, (transfer id, token), measure); those past their give-up time
        are forgotten."""
        out = []
        for key, st in list(self._owed.items()):
            if now >= st[2]:
                del self._owed[key]
                self._tokens.pop(key, None)
            elif now >= st[0]:
                st[1] = min(2 * st[1], self.MAX_INTERVAL_S)
                st[0] = now + st[1]
                token, measure = self._tokens[key]
                out.append((key[0], (key[1], token), measure))
        return out

    def next_time(self) -> float | None:
        return min((st[0] for st in self._owed.values()), default=None)
