"""D side: `TransferSink` pulls requests' anchor and residual regions from P's staging into D's own pool.

A single service thread owns the NIXL agent, the per-peer zmq DEALER sockets and the `TransferScheduler`;
caller threads only enqueue commands (pull / release / abort) and read events. Per peer address the
authenticated handshake (protocol v4: D and P prove the deployment key, then every frame carries a MAC and a
sequence number; P sends its agent metadata, pool descriptor and compat hash) is done once and the session
cached; a pull names its request by P's transfer id and token (from kv_transfer_params); a failed READ drops the
peer from the cache so the next pull re-handshakes. Every pulled stream yields exactly one `TransferEvent`
(unless aborted); control steps (handshake, region query, NotReady retries) give up after `timeout_s`.
When a request's streams have all finished (ok or not) the sink tells P "done" so it frees its staging;
`release()` does the same explicitly and is idempotent.

Side-channel messages can be lost (zmq drops them when a connection is reset or a queue is full), so nothing
waits on one reply: an unanswered Hello or Query is sent again after `resend_s`, NotReady answers are retried
with exponential back-off (`retry_s` .. `retry_max_s`), and a peer silent for `reconnect_s` while pulls wait
on it gets a fresh connection and handshake. A pull that reaches its own deadline fails alone: one silent or
slow request never fails the other requests of the same peer. While a request's streams are queued or in
flight, D renews P's lease of it (one KeepAlive per peer every quarter of P's lease); a request P answers as
gone fails at once. Each event carries the generation of P's staging (from ``Regions``), which seeds the
checksums the caller verifies.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import zmq

from lynx_connector.logger import init_logger
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.closing import SinkClosing
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import ANCHOR, TransferEvent
from lynx_connector.transport.first_token import FirstTokenFollower
from lynx_connector.transport.handshake import RateLimitedLog
from lynx_connector.transport.link import (
    NO_MEASURE,
    Addr,
    DoneCourier,
    Measure,
    PeerLink,
    PullState,
    Staged,
    check_ticket,
    done_frame,
)
from lynx_connector.transport.nixl_wrapper import NixlLike, NixlWrapper
from lynx_connector.transport.pool import StagingPool
from lynx_connector.transport.ranking import PULL_ORDERS, SPLIT, PullOrder
from lynx_connector.transport.replies import ReplyHandlers
from lynx_connector.transport.scheduler import TransferScheduler
from lynx_connector.transport.status import StatusWriter
from lynx_connector.transport.timers import ControlTimers
from lynx_connector.transport.wake import Waker, unpin_current_thread
from lynx_connector.transport.watched import WatchedPulls

logger = init_logger(__name__)

__all__ = ["TransferSink"]


class TransferSink(ReplyHandlers, ControlTimers, FirstTokenFollower, WatchedPulls, SinkClosing):
    """D-side endpoint; one per worker process. `pool` is D's registered staging (caller allocates in it)."""

    def __init__(
        self,
        config: TransportConfig,
        compat: dict[str, Any],
        *,
        nixl: NixlLike | None = None,
        name: str | None = None,
        record_posts: bool = False,
        status_extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``status_extra`` adds the owner's counters to the status file (``config.status_path``)."""
        self.config = config
        self.compat = dict(compat)
        self.compat_hash = proto.compat_hash(self.compat)
        self.pool = StagingPool(config.pool_bytes)
        self.name = name or f"lynx-sink-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._nixl = nixl if nixl is not None else NixlWrapper(self.name, config)
        try:
            self._nixl.register(self.pool.buffer)
            self._ctx = zmq.Context()
            self._waker = Waker(self._ctx)
            self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
            self._events: list[TransferEvent] = []
            self._staged: list[Staged] = []  # watched pulls P has staged, not yet taken by `staged()`
            self._sched_events: list[TransferEvent] = []  # service-thread only
            self._ev_lock = threading.Lock()
            self._ev_cond = threading.Condition(self._ev_lock)  # `wait` wakes on every event, staged or first token
            self._active: set[str] = set()  # pulled and not yet forgotten (caller-side duplicate check)
            self._peers: dict[Addr, PeerLink] = {}
            self._pulls: dict[str, PullState] = {}
            self._poller = zmq.Poller()
            self._poller.register(self._waker.receiver, zmq.POLLIN)
            self._sched = TransferScheduler(self._nixl, config, self._on_event, record_posts=record_posts)
            self.cpu_s = 0.0
            self.mac_s = 0.0  # of the service thread: side-channel MACs (proto.mac_seconds)
            self._resent = 0  # Hello/Query messages sent again for want of an answer
            self._courier = DoneCourier(config.resend_s, config.lease_s)
            self._reconnects = 0
            self._lease_lost = 0  # pulls P answered as gone (KeepAlive) while they were being read
            self._peers_closed = 0  # P peers that said they were shutting down (Error "closing")
            self._peers_gone = 0  # ... and that went away without a word (their side-channel port refuses)
            self._closed_addrs: dict[Addr, float] = {}  # their addresses -> until when no Done connects there
            self._log = RateLimitedLog("lynx sink")  # bad or unexpected frames: one line a second per kind
            self._keepalives = 0
            self._pipelined = 0  # pulls whose transfer started while P was still publishing layers
            self._early = 0  # concurrent-flow pulls (started before P may have had the request)
            self._security = {"bad_mac": 0, "replayed": 0, "sessions_lost": 0, "handshakes": 0, "handshakes_retried": 0,
                              "unsealed_ignored": 0, "other_version": 0}
            self._max_in = max(config.max_message_bytes, proto.MAX_MD + 4096)  # a HelloOk carries P's NIXL metadata
            self._init_first_tokens()  # concurrent flow, speculative: P's first token (transport/first_token.py)
            self._stop = False
            self._closing = threading.Event()  # close() asked the service thread to wind down
            self._closed = threading.Event()  # ... and it has (pulls dropped, every Done acknowledged)
            self._winding_down = False
            self._status = StatusWriter(config.status_path,
                                        lambda: {"sink": self.stats(), **(status_extra() if status_extra else {})})
            self._thread = threading.Thread(target=self._serve, name="lynx-sink", daemon=True)
            self._thread.start()
        except BaseException:  # nothing this endpoint opened may stay open, bound or registered
            self._undo_init()
            raise

    # ---- caller API --------------------------------------------------------------------------
    def pull(
        self,
        req_id: str,
        host: str,
        port: int,
        transfer_id: str,
        token: str,
        anchor_out: torch.Tensor,
        residual_out: torch.Tensor | None,
        wait_s: float | None = None,
        order: PullOrder = SPLIT,
    ) -> None:
        """Queue a pull of P's request `transfer_id` (presenting its `token`) from the source at host:port into
        views of `self.pool`. ``wait_s`` (concurrent flow: P may not have the request yet): P's "unknown
        request" means "not yet" for this long, which is then the pull's deadline instead of ``timeout_s``.
        ``order``: how the request's output depends on its planes, which ranks its streams against other
        requests' (``transport/ranking.py``; the transfer mode's ``pull_order``)."""
        a, r = self._views(anchor_out, residual_out)
        if a[1] == 0:
            raise ValueError("anchor_out is empty")
        self._enqueue(req_id, host, port, transfer_id, token, a, r, wait_s, order, held=False)

    def _views(self, anchor_out: torch.Tensor, residual_out: torch.Tensor | None
               ) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """(address, nbytes) of the anchor view and of the residual view (None when absent or empty)."""
        a = (self.pool.base_addr + self.pool.offset_of(anchor_out), int(anchor_out.numel()))
        r = None
        if residual_out is not None and residual_out.numel() > 0:
            r = (self.pool.base_addr + self.pool.offset_of(residual_out), int(residual_out.numel()))
        return a, r

    def _enqueue(self, req_id: str, host: str, port: int, transfer_id: str, token: str, a: tuple[int, int],
                 r: tuple[int, int] | None, wait_s: float | None, order: PullOrder, held: bool,
                 layouts: dict[str, tuple[int, int]] | None = None) -> None:
        if order not in PULL_ORDERS:
            raise ValueError(f"order must be one of {', '.join(PULL_ORDERS)}, got {order!r}")
        if not isinstance(req_id, str) or not 0 < len(req_id) <= proto.MAX_ID:
            raise ValueError(f"req_id must be a non-empty str of at most {proto.MAX_ID} chars")
        check_ticket(host, port, transfer_id, token)
        if wait_s is not None and not wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s!r}")
        with self._ev_lock:
            if req_id in self._active:
                raise ValueError(f"request {req_id!r} is already being pulled")
            self._active.add(req_id)
        now = time.monotonic()
        self._cmd(("pull", PullState(req_id, (host, port), transfer_id, token, a, r, now,
                                     now + (self.config.timeout_s if wait_s is None else wait_s),
                                     early=wait_s is not None, order=order, held=held, layouts=layouts)))

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until there is news for the caller (an event, a staged pull or a first
        token not yet taken); True when there is. D's worker waits here on an engine step with nothing to compute,
        instead of returning at once into a busy loop of empty steps (which takes the CPU from P's prefill where
        they share a machine): it wakes the moment a stream lands."""
        with self._ev_cond:
            if not self._has_news():
                self._ev_cond.wait(timeout)
            return self._has_news()

    def _has_news(self) -> bool:
        return bool(self._events or self._staged or self._first_tokens)

    def poll(self) -> list[TransferEvent]:
        """Events since the last poll."""
        with self._ev_lock:
            out, self._events = self._events, []
        return out

    def left(self, req_id: str, stream: str) -> int | None:
        """Bytes of a stream not landed yet once P has published all of it, else None (read from the service
        thread's scheduler without its lock: an estimate, for D's choice to wait for a residual)."""
        return self._sched.left(req_id, stream)

    def free_staging(self, req_id: str) -> None:
        """Free D's staging of a pull that is over (after `abort` or its last event). Where the pull was dropped
        with reads in flight, their bytes may still land (NIXL's release does not wait for an RMA already
        posted): its regions are reused only after ``lease_grace_s``, never under another request's reads."""
        self.pool.free_request(req_id, self.config.lease_grace_s if self._sched.take_torn(req_id) else 0.0)

    def release(self, req_id: str) -> None:
        """Tell P to free the request's staging (idempotent; D's views stay the caller's). A pull still in flight
        is dropped as by ``abort`` (no more events; ``free_staging`` then holds regions its reads may still land in):
        P must never free and reuse staging under D's reads."""
        self._cmd(("release", req_id, None))

    def discard(self, host: str, port: int, transfer_id: str, token: str) -> None:
        """Tell P to free a transfer this D will never pull (its request ended, or found no staging room, before
        its pull started): a Done, owed until P acknowledges it like every other."""
        check_ticket(host, port, transfer_id, token)
        self._cmd(("discard", (host, port), (transfer_id, token)))

    def abort(self, req_id: str) -> None:
        """Stop pulling a request (no further events), tell P to free; returns once the sink has dropped it (reads
        in flight released: their bytes may still land, see `free_staging`)."""
        done = threading.Event()
        self._cmd(("abort", req_id, done))
        if not done.wait(self.config.timeout_s + 1.0):  # reads may be in flight: free_staging quarantines them
            logger.warning("abort(%s) not acknowledged by the sink thread; its staging is held for lease_grace_s "
                           "once freed", req_id)
            self._sched.mark_torn(req_id)

    def stats(self) -> dict[str, Any]:
        return {
            "cpu_s": self.cpu_s,
            "mac_s": self.mac_s,
            "resent": self._resent,
            "dones_owed": len(self._courier),
            "reconnects": self._reconnects,
            "lease_lost": self._lease_lost,
            "peer_closed": self._peers_closed,
            "peer_gone": self._peers_gone,
            "keepalives": self._keepalives,
            "pipelined_pulls": self._pipelined,
            "early_pulls": self._early,
            "first_tokens": self._tokens_seen,
            **self._security,
            "chunks_posted": self._sched.stats.chunks_posted,
            "bytes_done": self._sched.stats.bytes_done,
            "max_inflight_bytes": self._sched.stats.max_inflight_bytes,
            "peers": len(self._peers),
            "pulls_live": len(self._active),
            "regions_live": self.pool.regions_live,
        }

    @property
    def post_log(self) -> list[tuple[str, str, int, int]]:
        """(req_id, stream, offset, nbytes) of each posted chunk when `record_posts=True`."""
        return self._sched.stats.post_log

    # ---- service thread ----------------------------------------------------------------------
    def _cmd(self, cmd: tuple[Any, ...]) -> None:
        if self._stop or self._closing.is_set():
            raise RuntimeError("TransferSink is closed")
        self._cmds.put(cmd)
        self._waker.wake()

    def _serve(self) -> None:
        unpin_current_thread()
        t_cpu = time.thread_time()
        while not self._stop:
            try:
                self._serve_once()
            except Exception:  # never let one bad message or event kill the thread every pull depends on
                logger.exception("lynx sink: service loop error (continuing)")
                time.sleep(0.01)
            self.cpu_s = time.thread_time() - t_cpu
            self.mac_s = proto.mac_seconds()

    def _serve_once(self) -> None:
        self._run_commands()
        if self._winding_down and not len(self._courier):
            self._closed.set()
        # split anchors known to be coming (regions still being queried) go before every other stream, briefly
        self._sched.hold_until = max(
            (p.t0 + self.config.anchor_holdoff_s for p in self._pulls.values()
             if p.state != "transferring" and not p.held and p.order == SPLIT),
            default=0.0,
        )
        wait = self._sched.step()
        self._process_sched_events()
        wait = self._check_deadlines(wait)
        self._process_sched_events()  # streams the timers failed (a stalled layer-wise publish)
        self._status.maybe_write()
        due = self._status.due_in(time.monotonic())
        if due is not None:
            wait = due if wait is None else min(wait, due)
        timeout_ms = -1 if wait is None else (0 if wait <= 0 else max(1, int(wait * 1000 + 0.999)))
        if wait is not None and 0 < wait < 0.001:  # sub-ms waits: sleep precisely, not 1 ms
            time.sleep(wait)
            timeout_ms = 0
        ready = dict(self._poller.poll(timeout_ms))
        if self._waker.receiver in ready:
            self._waker.drain()
        for peer in list(self._peers.values()):
            if peer.monitor in ready and self._peers.get(peer.addr) is peer:
                self._on_monitor(peer)  # replies.py: zmq connected again, or P's port refuses connections
            if peer.sock in ready and self._peers.get(peer.addr) is peer:
                self._drain_peer(peer)
        self._process_sched_events()

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "close":  # what is queued behind it runs too (a pull then becomes a Done)
                self._close_pulls()
                continue
            if self._winding_down and kind == "pull":  # queued in the instant close() began: P is told to free
                self._owe_done(cmd[1].addr, (cmd[1].transfer_id, cmd[1].token), connect=True)
                self._forget(cmd[1].req_id)
                continue
            if kind == "pull":
                self._start_pull(cmd[1])
            elif kind == "discard":
                self._owe_done(cmd[1], cmd[2], connect=True)
            elif kind == "attach":
                self._attach(cmd[1], *cmd[2])
            else:
                pull = self._pulls.pop(cmd[1], None)
                if pull is not None:
                    self._sched.cancel(pull.req_id)  # abort, or a release of a pull still in flight
                    self._send_done(pull)
                self._forget(cmd[1])
                if cmd[2] is not None:
                    cmd[2].set()

    def _start_pull(self, pull: PullState) -> None:
        self._pulls[pull.req_id] = pull
        self._early += pull.early
        pull.pending = pull.streams()
        peer = self._peers.get(pull.addr)
        if peer is None:
            peer = self._connect(pull.addr)
            if peer is None:
                pull.done_sent = True  # nothing could be sent there: no Done is owed
                self._fail(pull, f"cannot connect to peer {pull.addr[0]}:{pull.addr[1]}")
                return
        if peer.state == "ready":
            self._query(pull)

    def _connect(self, addr: Addr) -> PeerLink | None:
        """A new link to ``addr``; None (logged) for an address zmq refuses to connect to (``check_peer_addr``
        refuses those it knows of before a pull or a discard is queued)."""
        try:
            peer = PeerLink(self._ctx, self._poller, addr, self._max_in, self.config.key, self.config.extra_keys)
        except zmq.ZMQError as exc:
            logger.error("lynx sink: cannot connect to peer %s:%s: %s", addr[0], addr[1], exc)
            self._courier.forget(addr)
            return None
        self._peers[addr] = peer
        peer.hello(self.compat_hash)
        return peer

    def _query(self, pull: PullState) -> None:
        pull.state = "query"
        pull.retry_at = None
        pull.sent_at = time.monotonic()
        self._peers[pull.addr].send(proto.Query(v=proto.VERSION, transfer_id=pull.transfer_id, token=pull.token))

    def _send_done(self, pull: PullState) -> None:
        """Tell P to free; the Done is owed (sent again) until P acknowledges it. A pull read whole tells P the
        link time its reads took (P's measured link, auto); any other says 0 (not measured)."""
        whole = not pull.failed and not pull.pending and pull.state == "transferring"
        self._owe_done(pull.addr, (pull.transfer_id, pull.token),
                       measure=(pull.link_s, pull.link_bytes) if whole else NO_MEASURE)

    def _owe_done(self, addr: Addr, ticket: tuple[str, str], connect: bool = False,
                  measure: Measure = NO_MEASURE) -> None:
        self._courier.owe(addr, ticket, time.monotonic(), measure)
        peer = self._peers.get(addr)
        if peer is None and connect and not self._said_closing(addr):
            peer = self._connect(addr)  # sent once the session is up (None: nothing owed, see _connect)
        if peer is not None:
            peer.send(done_frame(ticket, measure))

    def _forget(self, req_id: str) -> None:
        with self._ev_lock:
            self._active.discard(req_id)

    def _drain_peer(self, peer: PeerLink) -> None:
        for frame in peer.frames():
            handler = self._on_plain
            if frame[:1] == bytes([proto.SEALED]):
                verdict, frame = peer.opener.open(frame) if peer.opener is not None else ("bad_mac", b"")
                if verdict != "ok":
                    self._security[verdict] += 1
                    self._log.warn(verdict, "side channel from %s: dropped a frame (%s)", peer.name, verdict)
                    continue
                handler = self._on_reply
            try:
                msg = proto.decode(frame, self._max_in)
            except proto.VersionMismatch as exc:
                if handler == self._on_plain and peer.state != "ready":  # P's answer to our Hello, in its version
                    self._other_version(peer, exc.version)
                    return
                self._log.warn("other_version", "side channel from %s: rejected a reply: %s", peer.name, exc)
                continue
            except proto.ProtocolError as exc:
                self._log.warn("malformed", "side channel from %s: rejected a malformed reply: %s", peer.name, exc)
                continue
            handler(peer, msg)
            if self._peers.get(peer.addr) is not peer:
                return

    def _pulls_of(self, peer: PeerLink, transfer_id: str | None = None) -> list[PullState]:
        return [
            p for p in self._pulls.values()
            if p.addr == peer.addr and (transfer_id is None or p.transfer_id == transfer_id)
        ]

    # ---- completion and failure --------------------------------------------------------------
    def _on_event(self, ev: TransferEvent) -> None:
        """Scheduler callback: bookkeeping and publishing run later in `_process_sched_events`."""
        self._sched_events.append(ev)

    def _process_sched_events(self) -> None:
        while self._sched_events:
            ev = self._sched_events.pop(0)
            pull = self._pulls.get(ev.req_id)
            if pull is None:
                self._publish([ev])
                continue
            pull.pending.discard(ev.stream)
            pull.link_s += ev.link_seconds
            pull.link_bytes += ev.nbytes if ev.ok else 0
            if not ev.ok and not pull.failed:
                pull.failed = True
                err = ev.error or "transfer failed"
                if "NIXL" in err or "stalled" in err:  # the data path to this peer is broken
                    self._fail_peer(self._peers.get(pull.addr), err)
            if not pull.pending and self._pulls.get(ev.req_id) is pull:
                self._finish(pull)
            self._publish([dataclasses.replace(ev, generation=pull.generation)])  # after the bookkeeping: a terminal event means the req_id is free again

    def _publish(self, events: list[TransferEvent]) -> None:
        with self._ev_cond:
            self._events.extend(events)
            self._ev_cond.notify_all()

    def _finish(self, pull: PullState) -> None:
        self._pulls.pop(pull.req_id, None)
        if not pull.done_sent:
            self._send_done(pull)
        self._forget(pull.req_id)

    def _fail(self, pull: PullState, error: str) -> None:
        """Fail a pull: its streams in the scheduler, or (before transfer) one failed event per stream."""
        pull.failed = True
        if pull.state == "transferring":
            self._sched.fail(pull.req_id, error)  # events are processed by the service loop
            return
        logger.warning("pull %s failed: %s", pull.req_id, error)
        now = time.monotonic()
        events = [TransferEvent(pull.req_id, stream, False, error, 0, now - pull.t0)  # type: ignore[arg-type]
                  for stream in sorted(pull.pending, key=lambda s: s != ANCHOR)]
        pull.pending.clear()
        self._finish(pull)
        self._publish(events)

    def _fail_peer(self, peer: PeerLink | None, error: str, owe_done: bool = True) -> None:
        """Fail every pull from a peer and drop it from the cache (the next pull re-handshakes). ``owe_done``:
        tell P to free (best effort: P frees now if it is alive, else its lease does); not to a P that is gone."""
        if peer is None or self._peers.get(peer.addr) is not peer or peer.state == "failed":
            return
        peer.state = "failed"
        for pull in self._pulls_of(peer):
            if owe_done:
                self._send_done(pull)
            pull.done_sent = True
            if pull.pending:
                self._fail(pull, error)
        del self._peers[peer.addr]
        self._drop_peer_resources(peer, linger_ms=100 if owe_done else 0)

    def _drop_peer_resources(self, peer: PeerLink, linger_ms: int = 0) -> None:
        peer.close(linger_ms)
        peer.forget_agent(self._nixl)
