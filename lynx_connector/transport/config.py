"""Transport configuration (`TransportConfig`), validated on construction.

Defaults are the settings measured on the 2-core CPU box (see `lynx_connector/transport/__init__.py` for the
reasoning): NIXL progress thread off (it spins a core when idle), one UCX worker, 1 MiB chunks, a 4 MiB window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lynx_connector.limits import MAX_SECONDS
from lynx_connector.transport import protocol as proto
from lynx_connector.transport.ranking import ORDERS

__all__ = ["TransportConfig", "drain_seconds"]


def drain_seconds(pool_bytes: int, link_gbps: float | None) -> float | None:
    """Seconds a staging pool of ``pool_bytes`` takes to drain at ``link_gbps`` (None when unpaced)."""
    return None if link_gbps is None else pool_bytes / (link_gbps * 1e9 / 8.0)


def lease_problem(lease_s: float | None, pool_bytes: int, link_gbps: float | None) -> str | None:
    """Why P's lease (``lease_s``; None: not chosen yet) cannot go with a staging pool of ``pool_bytes`` paced at
    ``link_gbps``, or None: a full pool must drain within the longest lease, and within the lease P runs with
    (else P could free staging D is still reading). The config checks it at start-up; the transport again."""
    drain_s = drain_seconds(pool_bytes, link_gbps)
    if drain_s is None:
        return None
    if drain_s > MAX_SECONDS:
        return (f"a full staging pool ({pool_bytes >> 20} MiB, staging_mb) takes {drain_s:.3g} s to drain at "
                f"link_gbps={link_gbps:g}, more than any lease may be ({MAX_SECONDS:g} s): lower staging_mb or "
                f"raise link_gbps")
    if lease_s is not None and lease_s < drain_s:
        return (f"lease_s ({lease_s:g} s) is shorter than the {drain_s:.1f} s a full staging pool "
                f"({pool_bytes >> 20} MiB, staging_mb) takes to drain at link_gbps={link_gbps:g}: P could free "
                f"staging that D is still reading. Raise lease_s to at least {math.ceil(drain_s)} or lower staging_mb")
    return None


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"TransportConfig.{name} must be a positive int, got {value!r}")


def _positive_float(name: str, value: object, maximum: float = math.inf) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"TransportConfig.{name} must be a positive finite number, got {value!r}")
    if value > maximum:
        raise ValueError(f"TransportConfig.{name} must be <= {maximum:g}, got {value!r}")


@dataclass
class TransportConfig:
    """Settings of one `TransferSource` (P) or `TransferSink` (D).

    link_gbps: pace the pull to this many gigabits/s (an emulated link on D, `pacing.VirtualLink`), None = unpaced.
    chunk_bytes: a stream is posted in chunks of at most this size, so an anchor waits at most one chunk.
    window_bytes: bound on bytes posted but not completed (>= chunk_bytes).
    lease_s: P frees a published request's staging if D has not said "done" within this (renewed by each query
        and by D's KeepAlive, sent every quarter of P's lease for each request D pulls). With a link rate, a full
        pool must drain within it: ``lease_s >= pool_bytes / link rate`` (checked here).
    grace_s: a region freed because its lease ran out (D may still be reading it) is not reused for this long;
        None = the time the whole pool takes at the link rate, at least ``timeout_s``.
    timeout_s: D fails a request whose peer is silent this long (handshake, query or a stalled chunk).
    host, port: side-channel bind address of a source (port 0 = random free port).
    pool_bytes: size of the staging pool registered with NIXL.
    backend, num_workers, backend_params: NIXL backend and its init params (`num_workers` -> UCX param).
    progress_thread: NIXL's own progress thread (spins a core when idle: off by default).
    target_progress_s: without a progress thread, P pumps NIXL this often while requests are live (0 = never).
    retry_s: D re-queries a not-yet-published request after this long.
    anchor_holdoff_s: streams other than split anchors wait (at most this long after a pull) while a split
        (speculative) request's regions are still being queried, so its anchor goes first (0 = off).
    order: how D ranks queued streams across requests (`ranking.py`): "srpt" (speculative anchors, then units
        that unblock output, fewest bytes left first), "arrival" (those units in the order they became ready)
        or "anchor_first" (the rule before issue 16: every anchor before any residual).
    max_wait_s: age bound of the ranking: a stream queued this long goes first, oldest first (not with
        "anchor_first").
    catch_up_s: with ``link_gbps``, a chunk that waited for the emulated link and was posted up to this late
        (the posting thread woke late) starts when the link freed, so the thread's lateness does not idle the
        link (on the loaded 2-core box 5 ms lost up to half the rate at 25 Gb/s; 20 ms holds >= 95%).
    max_message_bytes: inbound side-channel messages larger than this are rejected unread (64 KiB: P's inbound
        messages are small; D accepts at least a HelloOk with P's NIXL metadata, ``protocol.MAX_MD``).
    key: the deployment key (>= 32 bytes, `lynx_connector.transport.keys.load_side_channel_key`) that
        authenticates the side channel; None = insecure (local tests only; both ends must agree).
    extra_keys: keys D also accepts from a P in the handshake, never used to prove itself (a key rotation:
        `lynx_connector.transport.keys.load_extra_keys`).
    rcvhwm: zmq receive high-water mark of P's side channel (messages queued before zmq drops).
    resend_s: D sends a Hello or Query again when it got no answer this long (both are idempotent; zmq drops
        messages when a connection is reset or a queue is full, and nothing else would ever ask again).
    retry_max_s: cap of D's exponential back-off between queries of a request P does not have ready yet
        (starts at ``retry_s``, doubles per answer), so waiting pulls cannot flood the side channel.
    reconnect_s: a peer that answered nothing this long while D waits on it gets a fresh connection and a new
        handshake; the waiting pulls are asked again and none of them fails for it (each has its own deadline).
    unknown_grace_s: D gives up on a request P keeps calling unknown for this long (P publishes a request
        before it answers for it, so "unknown" is final once any message reordering is over), not at timeout_s.
    status_path: write the endpoint's live counters to this JSON file about once a second (None = off).
    peer_idle_s: D closes its connection to a peer it has had nothing to pull from or tell (no pull, no Done owed)
        for this long: a prefill pod that went away, or one that never answered, holds no socket for good.
    pipeline_poll_s: pipelined transfer (docs/PROTOCOL.md section 6): D asks P again this often for the rest of
        a request P has published in part (layer by layer), and at most this long apart for a request P does not
        know yet in the concurrent flow (the proxy sent it to P and D at once).
    """

    link_gbps: float | None = None
    chunk_bytes: int = 1 << 20
    window_bytes: int = 4 << 20
    lease_s: float = 60.0
    grace_s: float | None = None
    timeout_s: float = 10.0
    host: str = "127.0.0.1"
    port: int = 0
    pool_bytes: int = 256 << 20
    backend: str = "UCX"
    num_workers: int = 1
    backend_params: dict[str, str] = field(default_factory=dict)
    progress_thread: bool = False
    target_progress_s: float = 0.005
    retry_s: float = 0.005
    anchor_holdoff_s: float = 0.02
    order: str = "srpt"
    max_wait_s: float = 5.0
    catch_up_s: float = 0.02
    max_message_bytes: int = 64 << 10
    resend_s: float = 0.5
    retry_max_s: float = 0.1
    reconnect_s: float = 2.0
    unknown_grace_s: float = 2.0
    peer_idle_s: float = 300.0
    status_path: str | None = None
    pipeline_poll_s: float = 0.01
    key: bytes | None = field(default=None, repr=False)
    extra_keys: tuple[bytes, ...] = field(default=(), repr=False)
    rcvhwm: int = 1000

    def __post_init__(self) -> None:
        if self.link_gbps is not None:
            _positive_float("link_gbps", self.link_gbps)
        for name in ("chunk_bytes", "window_bytes", "pool_bytes", "num_workers", "max_message_bytes", "rcvhwm"):
            _positive_int(name, getattr(self, name))
        if self.max_message_bytes < proto.MIN_MESSAGE_BYTES:  # P refused D's KeepAlives: leases ran out under reads
            raise ValueError(f"TransportConfig.max_message_bytes ({self.max_message_bytes}) must be >= "
                             f"{proto.MIN_MESSAGE_BYTES}: a KeepAlive of {proto.MAX_KEEPALIVE} transfers must fit")
        if self.window_bytes < self.chunk_bytes:
            raise ValueError(
                f"TransportConfig.window_bytes ({self.window_bytes}) must be >= chunk_bytes ({self.chunk_bytes})"
            )
        if self.order not in ORDERS:
            raise ValueError(f"TransportConfig.order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        for name in ("lease_s", "timeout_s", "retry_s", "catch_up_s", "resend_s", "retry_max_s", "reconnect_s",
                     "unknown_grace_s", "pipeline_poll_s", "max_wait_s", "peer_idle_s"):
            _positive_float(name, getattr(self, name), MAX_SECONDS)  # seconds: bounded like the wire's lease_s
        for name in ("target_progress_s", "anchor_holdoff_s"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val) or val < 0:
                raise ValueError(f"TransportConfig.{name} must be a finite number >= 0, got {val!r}")
        if self.grace_s is not None:
            _positive_float("grace_s", self.grace_s, MAX_SECONDS)
        problem = lease_problem(self.lease_s, self.pool_bytes, self.link_gbps)
        if problem:
            raise ValueError(problem)
        tp = self.target_progress_s
        if not isinstance(tp, (int, float)) or isinstance(tp, bool) or not math.isfinite(tp) or tp < 0:
            raise ValueError(f"TransportConfig.target_progress_s must be >= 0, got {tp!r}")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"TransportConfig.port must be an int in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"TransportConfig.host must be a non-empty string, got {self.host!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"TransportConfig.backend must be a non-empty string, got {self.backend!r}")
        if self.key is not None and (not isinstance(self.key, bytes) or len(self.key) < 32):
            raise ValueError("TransportConfig.key must be None (insecure) or bytes of length >= 32")
        if not isinstance(self.extra_keys, tuple) or not all(isinstance(k, bytes) and len(k) >= 32
                                                             for k in self.extra_keys):
            raise ValueError("TransportConfig.extra_keys must be a tuple of bytes of length >= 32 each")
        if not isinstance(self.progress_thread, bool):
            raise ValueError(f"TransportConfig.progress_thread must be a bool, got {self.progress_thread!r}")
        if not isinstance(self.backend_params, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.backend_params.items()
        ):
            raise ValueError("TransportConfig.backend_params must be a dict[str, str]")

    @property
    def link_bytes_per_s(self) -> float | None:
        """The paced rate in bytes/s, or None when unpaced."""
        return None if self.link_gbps is None else self.link_gbps * 1e9 / 8.0

    @property
    def pool_drain_s(self) -> float | None:
        """Seconds a full staging pool takes at the link rate (None when unpaced)."""
        return drain_seconds(self.pool_bytes, self.link_gbps)

    @property
    def lease_grace_s(self) -> float:
        """How long a region freed by lease expiry stays unused (see ``grace_s``)."""
        if self.grace_s is not None:
            return self.grace_s
        return max(self.timeout_s, self.pool_drain_s or 0.0)

    def nixl_backend_params(self) -> dict[str, str]:
        """Init params handed to `create_backend` (explicit `backend_params` win over `num_workers`)."""
        params = {"num_workers": str(self.num_workers)} if self.num_workers != 1 else {}
        params.update(self.backend_params)
        return params
