"""P side: `TransferSource` owns the staging pool (registered with NIXL once), a NIXL agent and the zmq
ROUTER side channel whose service thread runs the authenticated handshake, answers region queries and frees
staging (protocol v4, docs/PROTOCOL.md sections 1 and 2).

Lifecycle of a request's staging: (`expect`: D's queries get NotReady while P waits for room) -> `alloc` ->
caller encodes into the views -> (`publish_partial` as layers are encoded: D reads the ready prefix while the
rest is encoded) -> `publish` (queries answered from then on; before, D gets NotReady and
retries) -> freed on D's Done (side channel, or a NIXL notification ``done:<transfer_id>:<token>``), on lease
expiry (`lease_s` after publish, renewed by each query and KeepAlive of its owner: D renews every request it
pulls, queued or in flight), or on `abort`. Regions freed by lease expiry (or aborted once a D got them) are
not reused for ``config.lease_grace_s`` (a D may still be reading them); each staging has a generation (``Regions.generation``)
that seeds its checksums, so bytes of another tenancy of the same regions fail D's check. `reject(req_id, code,
message)` gives up on a request: D's next query gets that error at once (e.g. ``staging_full``).

Every request has a transfer id and a token (16 random bytes each, hex: minted here, or by the caller and
passed to `expect`/`alloc`; `ticket` returns them); D names a request only by both. An unknown id and a wrong
token get the same answer, ``unknown_request``; the first session whose Query was answered with Regions owns
the transfer, and other sessions are answered the same way. Only peers that proved the deployment key get a
session, P's NIXL metadata and the pool descriptor; any other message from an identity without a session is
answered ``Error("refused")``, nothing else.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.answers import SourceAnswers
from lynx_connector.transport.closing import stop_service_thread
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.handshake import PendingHandshakes, RateLimitedLog, Session, SideChannelServer
from lynx_connector.transport.nixl_wrapper import NixlLike, NixlWrapper
from lynx_connector.transport.pool import StagedRequest, StagingAbandoned, StagingPool
from lynx_connector.transport.status import StatusWriter
from lynx_connector.transport.wake import Waker, unpin_current_thread

logger = init_logger(__name__)

__all__ = ["TransferSource"]

IDLE_POLL_MS = 500
GOODBYE_LINGER_MS = 200  # how long close() lets P's Error("closing") frames leave (docs/PROTOCOL.md section 9)
MAX_REJECTED = 4096  # rejections remembered (each for lease_s) so D hears why, not "unknown request"


@dataclass
class _Entry:
    staged: StagedRequest | None  # None: expected, not staged yet (NotReady)
    transfer_id: str
    token: str
    published: bool = False
    deadline: float | None = None
    owner: bytes | None = None  # the session lineage whose Query got Regions
    ready: tuple[int, int] | None = None  # published in part (layer-wise): readable prefix bytes; None = all
    writing: bool = False  # staged and the caller is still encoding into it (until `publish`)
    first_token: int = -1  # the token P sampled after the prompt (`set_first_token`), -1 = not known yet
    mode: str = ""  # the transfer mode it is staged under, and why auto chose it (named in Regions)
    auto_reason: str = ""


class TransferSource(SourceAnswers, SideChannelServer):
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
        self._key = config.key if config.key is not None else b""  # insecure: an empty key, same protocol
        self.compat = dict(compat)
        self.compat_hash = proto.compat_hash(self.compat)
        self.pool = StagingPool(config.pool_bytes)
        self.name = name or f"lynx-src-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._nixl = nixl if nixl is not None else NixlWrapper(self.name, config)
        try:
            self._nixl.register(self.pool.buffer)
            self._md = self._nixl.metadata()  # after registration
            self._lock = threading.Lock()
            self._entries: dict[str, _Entry] = {}  # req_id -> entry
            self._by_tid: dict[str, str] = {}  # transfer_id -> req_id
            self._rejected: dict[str, tuple[str, str, float, str]] = {}  # transfer_id -> (code, message, forget at, token)
            self._freed: list[str] = []
            self._pulled: deque[tuple[float, float, int]] = deque(maxlen=1024)  # take_pulled (auto's link meter)
            self._abandoned: OrderedDict[str, None] = OrderedDict()  # expected requests D gave up on (take_abandoned)
            # Freed by D (Done, lease) while the caller still encodes into them (layer-wise): their regions are freed
            # only when the caller stops writing (publish / abort), never reused under its writes.
            self._orphans: dict[str, str] = {}  # req_id -> why it was freed ("done": D read nothing more; "lease")
            self._sessions: OrderedDict[bytes, Session] = OrderedDict()  # zmq identity -> session (service thread)
            self._pending = PendingHandshakes()  # zmq identity -> handshake in progress
            self._log = RateLimitedLog()
            self._nixl_log = RateLimitedLog("lynx source")  # not counted with the side channel's
            self.counters = {"served_queries": 0, "malformed": 0, "other_version": 0, "freed_done": 0, "freed_lease": 0, "freed_abort": 0,
                             "rejected": 0, "replies_dropped": 0, "auth_failed": 0, "refused": 0, "bad_mac": 0,
                             "replayed": 0, "unknown_request": 0, "wrong_ticket": 0, "bad_notif": 0, "sessions": 0,
                             "renewed": 0, "keepalive_gone": 0, "partial_published": 0}
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.ROUTER)
            port = self._bind(config)  # a port in use, a bad host: raises (and _undo_init closes what was opened)
            self._waker = Waker(self._ctx)
            self._address = (config.host, int(port))
            self._stop = False
            self._told_closing = 0  # sessions told P is closing (the service thread's last act)
            self.cpu_s = 0.0
            self.mac_s = 0.0  # of the service thread: side-channel MACs (proto.mac_seconds)
            self._status = StatusWriter(config.status_path,
                                        lambda: {"source": self.stats(), **(status_extra() if status_extra else {})})
            self._thread = threading.Thread(target=self._serve, name="lynx-source", daemon=True)
            self._thread.start()
        except BaseException:  # nothing this endpoint opened may stay open, bound or registered
            self._undo_init()
            raise
        logger.info("lynx transfer source %s listening on %s:%s (%s)", self.name, *self._address,
                    "authenticated" if config.key is not None else "INSECURE: no side-channel key")

    def _undo_init(self) -> None:
        """The constructor failed part-way: close what it opened; the source owns its NIXL agent from the start, a
        caller's too (as close() does)."""
        if getattr(self, "_sock", None) is not None:
            self._sock.close(linger=0)
        if getattr(self, "_waker", None) is not None:
            self._waker.close()
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
        self._nixl.close()

    def _bind(self, config: TransportConfig) -> int:
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)  # bigger: the connection is dropped
        self._sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be delivered raises: counted, logged
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        # only for an IPv6 address: with IPV6 on, zmq may resolve a dual-stack name to a broken IPv6 route
        self._sock.setsockopt(zmq.IPV6, int(config.host.startswith("[")))
        try:
            if config.port == 0:
                return self._sock.bind_to_random_port(f"tcp://{config.host}")
            self._sock.bind(f"tcp://{config.host}:{config.port}")
        except zmq.ZMQError as exc:  # named here: vLLM shows it under "Engine core initialization failed"
            raise OSError(exc.errno, f"Lynx's side channel cannot listen on {config.host}:{config.port or 'any port'}"
                                     f": {exc.strerror} (the port is side_channel_port plus the tensor-parallel "
                                     "rank; side_channel_port 0 takes a free one)") from exc
        return config.port

    # ---- caller API --------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the side channel."""
        return self._address

    @staticmethod
    def _check_id(req_id: str) -> None:
        if not isinstance(req_id, str) or not 0 < len(req_id) <= proto.MAX_ID:
            raise ValueError(f"req_id must be a non-empty str of at most {proto.MAX_ID} chars")

    @staticmethod
    def _mint(transfer_id: str | None, token: str | None) -> tuple[str, str]:
        tid = secrets.token_hex(16) if transfer_id is None else transfer_id
        tok = secrets.token_hex(16) if token is None else token
        if not proto.is_hex_id(tid) or not proto.is_hex_id(tok):
            raise ValueError("transfer_id and token must be 32 lower-case hex characters (secrets.token_hex(16))")
        return tid, tok

    def _entry_for(self, req_id: str, transfer_id: str | None, token: str | None,
                   staged: StagedRequest | None) -> _Entry:
        """Create or update a request's entry (lock held); the credentials of an expected request are kept."""
        entry = self._entries.get(req_id)
        if entry is not None:
            if (transfer_id is not None and transfer_id != entry.transfer_id) or (
                    token is not None and token != entry.token):
                raise ValueError(f"request {req_id!r} is already expected with another transfer id or token")
            if staged is not None:
                entry.staged, entry.writing = staged, True
            return entry
        tid, tok = self._mint(transfer_id, token)
        if tid in self._by_tid:
            raise ValueError(f"transfer id {tid} is already in use")
        entry = self._entries[req_id] = _Entry(staged, tid, tok, writing=staged is not None)
        self._by_tid[tid] = req_id
        self._rejected.pop(tid, None)
        return entry

    def expect(self, req_id: str, transfer_id: str | None = None, token: str | None = None) -> tuple[str, str]:
        """Announce a request that will be staged (D's queries get NotReady until `publish` or `reject`);
        returns its (transfer_id, token), minted here unless given."""
        self._check_id(req_id)
        with self._lock:
            entry = self._entry_for(req_id, transfer_id, token, None)
            return entry.transfer_id, entry.token

    def alloc(self, req_id: str, anchor_nbytes: int, residual_nbytes: int, *, transfer_id: str | None = None,
              token: str | None = None, mode: str = "", auto_reason: str = "") -> StagedRequest:
        """Reserve staging for a request (raises `StagingFullError` when the pool is full, `StagingAbandoned` when
        D's Done for the expected request came meanwhile: nothing is held); the request keeps the
        credentials of `expect`, or gets ``transfer_id``/``token`` (minted when not given): see `ticket`.
        ``mode``/``auto_reason``: the transfer mode it is staged under and why auto chose it, named to D in every
        Regions answer (D sizes an auto pull of the concurrent flow by it)."""
        self._check_id(req_id)
        self._mint(transfer_id or "0" * 32, token or "0" * 32)  # validate before allocating
        for what, val in (("mode", mode), ("auto_reason", auto_reason)):
            if not proto.is_mode_name(val):
                raise ValueError(f"{what} must be at most 32 characters of [a-z0-9_], got {val!r}")
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is not None and entry.staged is not None:
                raise ValueError(f"request {req_id!r} is already staged")
        staged = self.pool.alloc_request(req_id, anchor_nbytes, residual_nbytes)
        try:
            with self._lock:
                # D's Done for the expected request came while the pool allocated (the lock was not held): it
                # gave up on it, so staging it would hold the pool for nobody until the lease
                if req_id in self._abandoned and req_id not in self._entries:
                    del self._abandoned[req_id]
                    raise StagingAbandoned(f"request {req_id!r}: its decode instance gave up on it")
                entry = self._entry_for(req_id, transfer_id, token, staged)
                entry.mode, entry.auto_reason = mode, auto_reason
        except (ValueError, StagingAbandoned):
            self.pool.free_request(req_id)
            raise
        return staged

    def ticket(self, req_id: str) -> tuple[str, str]:
        """(transfer_id, token) of an expected or staged request: what D needs to pull it."""
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None:
                raise KeyError(f"no request {req_id!r}")
            return entry.transfer_id, entry.token

    def reject(self, req_id: str, code: str, message: str) -> None:
        """Give up on a request: free what it holds; D's queries for it get ``Error(code, message)``."""
        with self._lock:
            entry = self._entries.get(req_id)  # None when D freed it while P encoded: abort frees the orphan
        self.abort(req_id)
        if entry is None:
            return
        with self._lock:
            if len(self._rejected) >= MAX_REJECTED:
                self._rejected.pop(next(iter(self._rejected)))
            self._rejected[entry.transfer_id] = (code[:64], message[:4000], time.monotonic() + self.config.lease_s,
                                                 entry.token)
            self.counters["rejected"] += 1

    def publish(self, req_id: str) -> bool:
        """Make a request's (already written) staging readable by D; starts its lease. False when D freed the
        request while it was being written (its Done, or the lease, came first): its staging is freed now."""
        with self._lock:
            orphan = self._orphans.pop(req_id, None)
            if orphan is None:
                entry = self._entries.get(req_id)
                if entry is None or entry.staged is None:
                    raise KeyError(f"no staging for request {req_id!r}")
                entry.published, entry.writing = True, False
                entry.ready = None
                entry.deadline = time.monotonic() + self.config.lease_s
        if orphan is not None:
            self._free_orphan(req_id, orphan)
            return False
        self._waker.wake()
        return True

    def publish_partial(self, req_id: str, anchor_ready: int, residual_ready: int) -> bool:
        """Make the first ``anchor_ready`` / ``residual_ready`` bytes of a request's regions readable while P
        still encodes the rest (layer-wise publish, docs/PROTOCOL.md section 6): D's queries are answered with
        Regions naming those counts; `publish` makes the whole regions readable. Starts the lease. False when D
        has freed the request meanwhile: stop encoding it and call `publish` (or `abort`) to free its staging."""
        with self._lock:
            if req_id in self._orphans:
                return False
            entry = self._entries.get(req_id)
            if entry is None or entry.staged is None:
                raise KeyError(f"no staging for request {req_id!r}")
            s = entry.staged
            if not (0 <= anchor_ready <= s.anchor_nbytes and 0 <= residual_ready <= s.residual_nbytes):
                raise ValueError(f"ready bytes {anchor_ready}/{residual_ready} outside the regions "
                                 f"({s.anchor_nbytes}/{s.residual_nbytes})")
            if entry.published and entry.ready is None:
                return True  # already whole
            self.counters["partial_published"] += 1
            entry.ready = (anchor_ready, residual_ready)
            entry.published = True
            if entry.deadline is None:
                entry.deadline = time.monotonic() + self.config.lease_s
        return True

    def set_first_token(self, transfer_id: str, token: int) -> bool:
        """The token P sampled after the prompt of transfer ``transfer_id``: every later ``Regions`` answer for it
        carries it (a speculative D of the concurrent flow releases its first token on it, docs/PROTOCOL.md
        section 6). False when the transfer is gone (D has read it all and freed it, or it was never staged)."""
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < proto.MAX_TOKEN_ID:
            raise ValueError(f"first token must be a token id in [0, 2**31), got {token!r}")
        with self._lock:
            req_id = self._by_tid.get(transfer_id)
            entry = self._entries.get(req_id) if req_id is not None else None
            if entry is None:
                return False
            entry.first_token = token
        return True

    def abort(self, req_id: str) -> bool:
        """Free a request's staging now (the caller stops writing it); False if it had none."""
        with self._lock:
            orphan = self._orphans.pop(req_id, None)
            self._abandoned.pop(req_id, None)  # given up here too: nothing will ask take_abandoned for it
        if orphan is not None:
            self._free_orphan(req_id, orphan)
            return True
        return self._free(req_id, "abort")

    def _free_orphan(self, req_id: str, why: str) -> None:
        """The regions of a request D freed while P wrote them: reused at once after D's Done (D reads nothing
        more), after the grace period when its lease ran out (a D may still be reading)."""
        self.pool.free_request(req_id, self.config.lease_grace_s if why == "lease" else 0.0)

    def take_abandoned(self, req_id: str) -> bool:
        """True (once) when D's Done for an expected request came before it was staged: D gave up on it (its own
        deadline), so staging it later would only hold the pool until the lease."""
        with self._lock:
            if req_id not in self._abandoned:
                return False
            del self._abandoned[req_id]
            return True

    def take_pulled(self) -> list[tuple[float, float, int]]:
        """(when D's Done came, the link seconds and bytes D measured) of each request D read whole since the last
        call (Done's ``link_s`` and ``link_bytes``: docs/PROTOCOL.md section 8)."""
        with self._lock:
            out = list(self._pulled)
            self._pulled.clear()
        return out

    def poll(self) -> list[str]:
        """Request ids freed since the last poll (done, lease or abort)."""
        with self._lock:
            out, self._freed = self._freed, []
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live = len(self._entries) + len(self._orphans)
        return {
            "pool_bytes": self.pool.nbytes,
            "bytes_allocated": self.pool.bytes_allocated,
            "bytes_quarantined": self.pool.quarantined_bytes,
            "regions_live": self.pool.regions_live,
            "requests_live": live,
            "cpu_s": self.cpu_s,
            "mac_s": self.mac_s,
            **self.counters,
            "sessions": len(self._sessions),
            "logs_suppressed": self._log.suppressed,
        }

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._waker.wake()
        stop_service_thread(self._thread, self._teardown, f"lynx source {self.name}")

    def _teardown(self) -> None:
        """Close the socket, NIXL agent and zmq context (the service thread has stopped)."""
        # the goodbyes of the service thread's last pass leave within GOODBYE_LINGER_MS, or not at all
        self._sock.close(linger=GOODBYE_LINGER_MS if self._told_closing else 0)
        if self._told_closing:
            logger.info("lynx source %s: told %d decode session(s) it is shutting down", self.name, self._told_closing)
        self._waker.close()
        self._nixl.close()
        self._ctx.term()

    # ---- internals ---------------------------------------------------------------------------
    def _free(self, req_id: str, why: str, measure: tuple[float, int] = (0.0, 0), transfer_id: str | None = None
              ) -> bool:
        """``measure``: (link seconds, bytes) D measured reading the request (its Done; zeros = not measured).
        ``transfer_id``: free only that transfer of the request (a Done or a lease looked it up without the lock
        held since: the caller may have aborted it and staged the request id again)."""
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None or (transfer_id is not None and entry.transfer_id != transfer_id):
                return False
            del self._entries[req_id]
            self._by_tid.pop(entry.transfer_id, None)
            self._freed.append(req_id)
            self.counters[f"freed_{why}"] += 1
            if why == "done" and entry.staged is not None and measure[0] > 0.0 and measure[1] > 0:
                self._pulled.append((time.monotonic(), *measure))
            if why == "done" and entry.staged is None:  # D gave up before P had room: P must not stage it later
                self._abandoned[req_id] = None
                if len(self._abandoned) > MAX_REJECTED:
                    self._abandoned.popitem(last=False)
            if entry.writing and why in ("done", "lease"):  # P still encodes into it: freed when P stops
                self._orphans[req_id] = why
                logger.debug("staging of %s freed by D (%s) while P writes it: freed when P is done", req_id, why)
                return True
        if entry.staged is not None:  # a D may still be reading (lease over, or aborted after Regions): not reused
            reading = why == "lease" or (why == "abort" and entry.owner is not None)  # for a while
            self.pool.free_request(req_id, self.config.lease_grace_s if reading else 0.0)
        logger.debug("freed staging of %s (%s)", req_id, why)
        return True

    def _serve(self) -> None:
        unpin_current_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.receiver, zmq.POLLIN)
        t_cpu = time.thread_time()
        while not self._stop:
            try:
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if self._waker.receiver in ready:
                    self._waker.drain()
                if self._sock in ready:
                    self._drain_socket()
                self._expire_leases()
                if self.config.target_progress_s > 0 and self._has_published():
                    self._pump_nixl()
            except Exception:  # never let one bad message or event kill the thread every D depends on (leases
                # would never expire: staging never freed)
                logger.exception("lynx source: service loop error (continuing)")
                time.sleep(0.01)
            self.cpu_s = time.thread_time() - t_cpu
            self.mac_s = proto.mac_seconds()
            self._status.maybe_write()
        try:
            self._told_closing = self._say_goodbye()
        except Exception:  # closing goes on: each D learns it when P's port refuses its connections
            logger.exception("lynx source: telling the decode instances it is closing failed")

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
            expired = [(r, e.transfer_id) for r, e in self._entries.items()
                       if e.deadline is not None and e.deadline <= now]
            for tid in [t for t, rej in self._rejected.items() if rej[2] <= now]:
                del self._rejected[tid]
        for req_id, tid in expired:
            if self._free(req_id, "lease", transfer_id=tid):
                logger.warning("lease of %s expired after %.1fs without D's done: freed", req_id, self.config.lease_s)
        self._pending.expire(now)

    def _pump_nixl(self) -> None:
        try:
            notifs = self._nixl.progress()
        except Exception as exc:  # at most one warning per LOG_EVERY_S: this runs every target_progress_s
            self._nixl_log.warn("nixl_progress", "NIXL progress failed: %s", exc)
            return
        for msgs in notifs.values():
            for msg in msgs:
                text = bytes(msg)[:600].decode("utf-8", "replace")
                if text.startswith("done:"):
                    self._notified_done(text[5:])

    def _drain_socket(self) -> None:
        for _ in range(256):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle([f.bytes for f in frames], frames[-1])

