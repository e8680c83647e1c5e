"""D's side-channel connection to one P (`PeerLink`): a zmq DEALER socket, the handshake and session state
(protocol v2: Hello -> Challenge -> Auth -> HelloOk, then sealed frames) and liveness.

The sink's service thread owns every link (zmq sockets are not thread-safe). A link can be re-opened: a new
socket, hence a new zmq identity and TCP connection, for a peer that stopped answering; the NIXL agent added
for the peer is kept across that (`agent`), so transfers in flight are not affected.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Iterator

import zmq

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto

logger = init_logger(__name__)

__all__ = ["Addr", "PeerLink"]

Addr = tuple[str, int]

HEARTBEAT_IVL_MS = 1000  # zmq-level heartbeats: a dead TCP connection is noticed and re-established by zmq
HEARTBEAT_TIMEOUT_MS = 3000
MAX_FRAMES_PER_DRAIN = 256


class PeerLink:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, addr: Addr, max_message_bytes: int,
                 key: bytes | None = None) -> None:
        self.addr = addr
        self._ctx, self._poller, self._max_bytes = ctx, poller, max_message_bytes
        self._key = key if key is not None else b""  # insecure: an empty key, same protocol
        self.state = "hello"  # hello (Hello sent) -> auth (Auth sent) -> ready; failed once dropped
        self.nonce_d = secrets.token_bytes(16)  # one per connection: a re-sent Hello is the same Hello
        self.skey = b""
        self.opener: proto.Opener | None = None
        self.send_seq = 0
        self.session_id = b""  # of the current (or last) session: sent as Auth.resume after a reconnect
        self.agent = ""  # NIXL name of the peer's agent once added
        self.pool_addr = 0
        self.pool_nbytes = 0
        self.hello_at = 0.0  # when the (last) Hello was sent
        self.heard_at = 0.0  # when the peer last answered anything (0: never)
        self.opened_at = 0.0  # when the current connection was opened
        self.reconnects = 0
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
        sock.connect(f"tcp://{self.addr[0]}:{self.addr[1]}")
        self._poller.register(sock, zmq.POLLIN)
        self.opened_at = time.monotonic()
        return sock

    def silent_since(self) -> float:
        """Since when nothing was heard on the current connection."""
        return max(self.heard_at, self.opened_at)

    def _send_frame(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue: the message is re-sent by the sink's timers
            logger.warning("side channel to %s: send failed: %s", self.name, exc)

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
        """Check P's proof of the key; on success derive the session key. False: P does not hold our key."""
        if not hmac.compare_digest(msg.proof_p, proto.proof_p(self._key, self.nonce_d, msg.nonce_p)):
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
        try:
            self._poller.unregister(self.sock)
        except KeyError:
            pass
        self.sock.close(linger=linger_ms)

    def close(self, linger_ms: int = 0) -> None:
        self._close_socket(linger_ms)
