"""P side: `TransferSource` owns the staging pool (registered with NIXL once), a NIXL agent and the zmq
ROUTER side channel whose service thread answers handshakes and region queries and frees staging.

Lifecycle of a request's staging: (`expect`: D's queries get NotReady while P waits for room) -> `alloc` ->
caller encodes into the views -> `publish` (queries answered from then on; before, D gets NotReady and
retries) -> freed on D's Done (side channel, or a NIXL notification ``done:<req_id>``), on lease expiry
(`lease_s` after publish, renewed by each query), or on `abort`. `reject(req_id, code, message)` gives up on
a request: D's next query gets that error at once (e.g. ``staging_full``), not a silent wait.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.nixl_wrapper import NixlLike, NixlWrapper
from lynx_connector.transport.pool import StagedRequest, StagingPool
from lynx_connector.transport.status import StatusWriter
from lynx_connector.transport.wake import Waker, unpin_current_thread

logger = init_logger(__name__)

__all__ = ["TransferSource"]

IDLE_POLL_MS = 500
MAX_REJECTED = 4096  # rejections remembered (each for lease_s) so D hears why, not "unknown request"


@dataclass
class _Entry:
    staged: StagedRequest | None  # None: expected, not staged yet (NotReady)
    published: bool = False
    deadline: float | None = None


class TransferSource:
    """P-side endpoint; one per worker process."""

    def __init__(
        self,
        config: TransportConfig,
        compat: dict[str, Any],
        *,
        nixl: NixlLike | None = None,
        name: str | None = None,
        status_extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``status_extra`` adds the owner's counters to the status file (``config.status_path``)."""
        self.config = config
        self.compat = dict(compat)
        self.compat_hash = proto.compat_hash(self.compat)
        self.pool = StagingPool(config.pool_bytes)
        self.name = name or f"lynx-src-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._nixl = nixl if nixl is not None else NixlWrapper(self.name, config)
        self._nixl.register(self.pool.buffer)
        self._md = self._nixl.metadata()  # after registration
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._rejected: dict[str, tuple[str, str, float]] = {}  # req_id -> (code, message, forget at)
        self._freed: list[str] = []
        self.counters = {"served_queries": 0, "malformed": 0, "freed_done": 0, "freed_lease": 0, "freed_abort": 0,
                         "rejected": 0, "replies_dropped": 0}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be delivered raises: counted, logged
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if config.port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{config.host}")
        else:
            self._sock.bind(f"tcp://{config.host}:{config.port}")
            port = config.port
        self._address = (config.host, int(port))
        self._waker = Waker(self._ctx)
        self._stop = False
        self.cpu_s = 0.0
        self._status = StatusWriter(config.status_path,
                                    lambda: {"source": self.stats(), **(status_extra() if status_extra else {})})
        self._thread = threading.Thread(target=self._serve, name="lynx-source", daemon=True)
        self._thread.start()
        logger.info("lynx transfer source %s listening on %s:%s", self.name, *self._address)

    # ---- caller API --------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the side channel."""
        return self._address

    @staticmethod
    def _check_id(req_id: str) -> None:
        if not isinstance(req_id, str) or not 0 < len(req_id) <= proto.MAX_ID:
            raise ValueError(f"req_id must be a non-empty str of at most {proto.MAX_ID} chars")

    def expect(self, req_id: str) -> None:
        """Announce a request that will be staged (D's queries get NotReady until `publish` or `reject`)."""
        self._check_id(req_id)
        with self._lock:
            self._entries.setdefault(req_id, _Entry(None))
            self._rejected.pop(req_id, None)

    def alloc(self, req_id: str, anchor_nbytes: int, residual_nbytes: int) -> StagedRequest:
        """Reserve staging for a request (raises `StagingFullError` when the pool is full)."""
        self._check_id(req_id)
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is not None and entry.staged is not None:
                raise ValueError(f"request {req_id!r} is already staged")
        staged = self.pool.alloc_request(req_id, anchor_nbytes, residual_nbytes)
        with self._lock:
            self._entries[req_id] = _Entry(staged)
            self._rejected.pop(req_id, None)
        return staged

    def reject(self, req_id: str, code: str, message: str) -> None:
        """Give up on a request: free what it holds; D's queries for it get ``Error(code, message)``."""
        self._free(req_id, "abort")
        with self._lock:
            if len(self._rejected) >= MAX_REJECTED:
                self._rejected.pop(next(iter(self._rejected)))
            self._rejected[req_id] = (code[:64], message[:4000], time.monotonic() + self.config.lease_s)
            self.counters["rejected"] += 1

    def publish(self, req_id: str) -> None:
        """Make a request's (already written) staging readable by D; starts its lease."""
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None or entry.staged is None:
                raise KeyError(f"no staging for request {req_id!r}")
            entry.published = True
            entry.deadline = time.monotonic() + self.config.lease_s
        self._waker.wake()

    def abort(self, req_id: str) -> bool:
        """Free a request's staging now; False if it had none."""
        return self._free(req_id, "abort")

    def poll(self) -> list[str]:
        """Request ids freed since the last poll (done, lease or abort)."""
        with self._lock:
            out, self._freed = self._freed, []
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live = len(self._entries)
        return {
            "bytes_allocated": self.pool.bytes_allocated,
            "regions_live": self.pool.regions_live,
            "requests_live": live,
            "cpu_s": self.cpu_s,
            **self.counters,
        }

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self._sock.close(linger=0)
        self._waker.close()
        self._nixl.close()
        self._ctx.term()

    # ---- internals ---------------------------------------------------------------------------
    def _free(self, req_id: str, why: str) -> bool:
        with self._lock:
            entry = self._entries.pop(req_id, None)
            if entry is None:
                return False
            self._freed.append(req_id)
            self.counters[f"freed_{why}"] += 1
        if entry.staged is not None:
            self.pool.free_request(req_id)
        logger.debug("freed staging of %s (%s)", req_id, why)
        return True

    def _serve(self) -> None:
        unpin_current_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.receiver, zmq.POLLIN)
        t_cpu = time.thread_time()
        while not self._stop:
            ready = dict(poller.poll(self._poll_timeout_ms()))
            if self._waker.receiver in ready:
                self._waker.drain()
            if self._sock in ready:
                self._drain_socket()
            self._expire_leases()
            if self.config.target_progress_s > 0 and self._has_published():
                self._pump_nixl()
            self.cpu_s = time.thread_time() - t_cpu
            self._status.maybe_write()

    def _has_published(self) -> bool:
        with self._lock:
            return any(e.published for e in self._entries.values())

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            deadlines = [e.deadline for e in self._entries.values() if e.deadline is not None]
        timeout = IDLE_POLL_MS / 1000.0
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - time.monotonic()))
            if self.config.target_progress_s > 0:
                timeout = min(timeout, self.config.target_progress_s)
        return max(1, int(timeout * 1000 + 0.999))

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, e in self._entries.items() if e.deadline is not None and e.deadline <= now]
            for req_id in [r for r, (_, _, t) in self._rejected.items() if t <= now]:
                del self._rejected[req_id]
        for req_id in expired:
            logger.warning("lease of %s expired after %.1fs without D's done: freeing", req_id, self.config.lease_s)
            self._free(req_id, "lease")

    def _pump_nixl(self) -> None:
        try:
            notifs = self._nixl.progress()
        except Exception as exc:
            logger.warning("NIXL progress failed: %s", exc)
            return
        for msgs in notifs.values():
            for msg in msgs:
                text = bytes(msg)[:600].decode("utf-8", "replace")
                if text.startswith("done:"):
                    self._free(text[5:], "done")

    def _drain_socket(self) -> None:
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(frames)

    def _reply(self, ident: bytes, msg: proto.Message) -> None:
        try:
            self._sock.send_multipart([ident, proto.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (EHOSTUNREACH) or its queue full (EAGAIN): D will ask again
            self.counters["replies_dropped"] += 1
            logger.warning("side-channel reply %s dropped: %s", type(msg).__name__, exc)

    def _handle(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if len(frames) != 2:
            self.counters["malformed"] += 1
            logger.warning("side channel: rejected a message with %d frames", len(frames) - 1)
            self._reply(ident, proto.Error(v=proto.VERSION, code="malformed", message="expected one frame"))
            return
        try:
            msg = proto.decode(frames[1], self.config.max_message_bytes)
        except proto.ProtocolError as exc:
            self.counters["malformed"] += 1
            logger.warning("side channel: rejected a malformed message: %s", exc)
            self._reply(ident, proto.Error(v=proto.VERSION, code="malformed", message=str(exc)[:4000]))
            return
        self._reply(ident, self._answer(msg))

    def _answer(self, msg: proto.Message) -> proto.Message:
        v = proto.VERSION
        if isinstance(msg, proto.Hello):
            diff = proto.compat_diff(self.compat, msg.compat)
            if diff:
                logger.warning("side channel: incompatible peer: %s", "; ".join(diff))
                text = "incompatible KV layout/codec, differing fields: " + "; ".join(diff)
                return proto.Error(v=v, code="incompatible", message=text[:4000])
            return proto.HelloOk(
                v=v,
                agent_name=self.name,
                agent_md=self._md,
                pool_addr=self.pool.base_addr,
                pool_nbytes=self.pool.nbytes,
                compat_hash=self.compat_hash,
            )
        if isinstance(msg, proto.Query):
            with self._lock:
                entry = self._entries.get(msg.req_id)
                if entry is not None and entry.published:
                    entry.deadline = time.monotonic() + self.config.lease_s
                rejected = self._rejected.get(msg.req_id)
            if rejected is not None:
                return proto.Error(v=v, code=rejected[0], message=rejected[1], req_id=msg.req_id)
            if entry is None:
                return proto.Error(v=v, code="unknown_request", message="no staging for request", req_id=msg.req_id)
            if not entry.published or entry.staged is None:
                return proto.NotReady(v=v, req_id=msg.req_id)
            self.counters["served_queries"] += 1
            s = entry.staged
            return proto.Regions(
                v=v,
                req_id=msg.req_id,
                anchor_offset=s.anchor_offset,
                anchor_nbytes=s.anchor_nbytes,
                residual_offset=s.residual_offset,
                residual_nbytes=s.residual_nbytes,
            )
        if isinstance(msg, proto.Done):
            with self._lock:
                self._rejected.pop(msg.req_id, None)
            self._free(msg.req_id, "done")
            return proto.Ack(v=v, req_id=msg.req_id)
        return proto.Error(v=v, code="unexpected", message=f"P does not accept {type(msg).__name__}")
