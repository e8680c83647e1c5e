"""D's control-path state: the side-channel connection to one P (`PeerLink`: a zmq DEALER socket, the
handshake state and liveness), one pull's state (`PullState`) and the Dones owed to peers (`DoneCourier`).

The sink's service thread owns every link (zmq sockets are not thread-safe). A link can be re-opened: a new
socket, hence a new zmq identity and TCP connection, for a peer that stopped answering; the NIXL agent added
for the peer is kept across that (`agent`), so transfers in flight are not affected.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto

logger = init_logger(__name__)

__all__ = ["Addr", "DoneCourier", "PeerLink", "PullState"]

Addr = tuple[str, int]

HEARTBEAT_IVL_MS = 1000  # zmq-level heartbeats: a dead TCP connection is noticed and re-established by zmq
HEARTBEAT_TIMEOUT_MS = 3000
MAX_FRAMES_PER_DRAIN = 256


class PeerLink:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, addr: Addr, max_message_bytes: int) -> None:
        self.addr = addr
        self._ctx, self._poller, self._max_bytes = ctx, poller, max_message_bytes
        self.state = "hello"  # hello -> ready; failed once dropped
        self.agent = ""  # NIXL name of the peer's agent once added
        self.pool_addr = 0
        self.pool_nbytes = 0
        self.hello_at = 0.0  # when the (last) Hello was sent
        self.heard_at = 0.0  # when the peer last answered anything (0: never)
        self.opened_at = 0.0  # when the current connection was opened
        self.asked_at = 0.0  # when the first message still awaiting an answer was sent
        self.reconnects = 0
        self.connects = 0  # TCP connections zmq has established on the current socket
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
        # zmq re-establishes a dropped TCP connection by itself, silently: the monitor tells D, which must then
        # handshake again before trusting any answer (P may have restarted on the same address)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._poller.register(self.monitor, zmq.POLLIN)
        sock.connect(f"tcp://{self.addr[0]}:{self.addr[1]}")
        self._poller.register(sock, zmq.POLLIN)
        self.opened_at = time.monotonic()
        self.connects = 0
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
                again = again or self.connects > 1
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

    def send(self, msg: proto.Message) -> None:
        """Send one message (every message D sends is answered by P)."""
        now = time.monotonic()
        if self.heard_at >= self.asked_at:  # the first question since P last spoke starts the silence clock
            self.asked_at = now
        try:
            self.sock.send(proto.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue: the message is re-sent by the sink's timers
            logger.warning("side channel to %s: send failed: %s", self.name, exc)

    def hello(self, compat: dict) -> None:
        self.hello_at = time.monotonic()
        self.send(proto.Hello(v=proto.VERSION, compat=compat))

    def reopen(self) -> None:
        """A fresh socket (identity, TCP connection) for the same address; the handshake starts again."""
        self._close_socket(0)
        self.sock = self._open()
        self.state = "hello"
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
    remote_req_id: str
    anchor: tuple[int, int]  # (local addr, nbytes)
    residual: tuple[int, int] | None
    t0: float
    deadline: float
    state: str = "wait_peer"  # wait_peer -> query -> transferring
    retry_at: float | None = None  # query again at (after a NotReady answer)
    sent_at: float | None = None  # a query is out and unanswered since
    backoff: float = 0.0
    unknown_since: float | None = None  # P has answered "unknown request" since
    last_reply: str = "no answer"
    pending: set[str] = field(default_factory=set)
    failed: bool = False
    done_sent: bool = False


class DoneCourier:
    """The Dones D owes its peers: each is sent again, with back-off, until P acknowledges it or P's lease would
    have freed the staging anyway. A Done sent while P was silent, or lost on a reset connection, would else
    leave P's staging held until the lease ran out."""

    MAX_INTERVAL_S = 5.0

    def __init__(self, resend_s: float, give_up_s: float) -> None:
        self._resend_s, self._give_up_s = resend_s, give_up_s
        self._owed: dict[tuple[Addr, str], list[float]] = {}  # -> [next send, interval, give up at]

    def __len__(self) -> int:
        return len(self._owed)

    def owe(self, addr: Addr, req_id: str, now: float) -> None:
        self._owed[(addr, req_id)] = [now + self._resend_s, self._resend_s, now + self._give_up_s]

    def ack(self, addr: Addr, req_id: str) -> None:
        self._owed.pop((addr, req_id), None)

    def owed_to(self, addr: Addr) -> bool:
        return any(a == addr for a, _ in self._owed)

    def due(self, now: float) -> list[tuple[Addr, str]]:
        """The Dones to send again now (the ones past their give-up time are forgotten)."""
        out = []
        for key, st in list(self._owed.items()):
            if now >= st[2]:
                del self._owed[key]
            elif now >= st[0]:
                st[1] = min(2 * st[1], self.MAX_INTERVAL_S)
                st[0] = now + st[1]
                out.append(key)
        return out

    def next_time(self) -> float | None:
        return min((st[0] for st in self._owed.values()), default=None)
