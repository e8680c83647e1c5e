"""D-side transfer scheduler: two priority queues, chunking, a bytes-in-flight window and link pacing.

Not thread-safe by itself: the sink's service thread owns it and calls `step()`; `step()` returns how long
the thread may sleep before calling again (None = idle, nothing to do until new work arrives).

Ordering rule: `lynx_connector/transport/ranking.py` (by what unblocks output: a speculative request's anchor,
then units that each unblock output, shortest first; an age bound for every stream). Only the anchors of split
(speculative) requests go before `hold_until` (the sink sets it while a split pull's regions are still being
queried, for at most `anchor_holdoff_s`, so its anchor is not overtaken merely because P answered late); aged
streams are never held. Chunking bounds how long a newly queued anchor waits behind a stream already being
moved: at most the bytes in flight (<= window_bytes), and with cma (synchronous transfers) at most one chunk.

Pacing (``link_gbps``, `pacing.VirtualLink`): a chunk is reported complete no sooner than the emulated link would
have delivered it (its bytes' link time after the link freed), whatever the real transfer took.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lynx_connector.logger import init_logger
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.events import ANCHOR, RESIDUAL, Stream, TransferEvent
from lynx_connector.transport.nixl_wrapper import NixlLike
from lynx_connector.transport.pacing import VirtualLink
from lynx_connector.transport.ranking import EARLY, SPLIT, PullOrder, best

logger = init_logger(__name__)

__all__ = ["StreamJob", "TransferScheduler"]

POLL_INTERVAL_S = 0.0005  # re-check in-flight (PROC) transfers this often


@dataclass
class StreamJob:
    """One stream of one request: a single contiguous remote region read into a local region."""

    req_id: str
    stream: Stream
    peer: str
    local_addr: int
    remote_addr: int
    nbytes: int
    t0: float
    posted: int = 0
    done: int = 0
    inflight: int = 0
    finished: bool = False
    t_first_post: float | None = None
    #: Bytes P has made readable so far (layer-wise publish); None = all ``nbytes``. Chunks are posted only
    #: below it; the owner raises it with `TransferScheduler.extend`.
    ready: int | None = None
    #: How the request's output depends on its planes (ranking.py): "split" (speculative) or "whole".
    order: PullOrder = SPLIT
    t_queued: float = 0.0  # set by submit
    t_ready: float | None = None  # a split residual: when its anchor was fully posted
    seq: int = 0  # queueing order (set by submit)
    #: Link time this stream's chunks took (`TransferScheduler._account`): reported to P in Done (its link meter).
    link_s: float = 0.0

    @property
    def postable(self) -> int:
        """Bytes that may be posted now and are not yet."""
        return (self.nbytes if self.ready is None else min(self.ready, self.nbytes)) - self.posted


@dataclass
class _Inflight:
    job: StreamJob
    handle: Any
    nbytes: int
    t_post: float
    t_due: float = 0.0  # the emulated link delivers the chunk then (0 = unpaced)
    state: str | None = None  # NIXL's final state, once known, while the emulated link still carries the chunk


@dataclass
class SchedulerStats:
    chunks_posted: int = 0
    bytes_done: int = 0
    max_inflight_bytes: int = 0
    post_log: list[tuple[str, str, int, int]] = field(default_factory=list)


class TransferScheduler:
    """Posts chunk READs for queued `StreamJob`s through a `NixlLike`, reporting `TransferEvent`s."""

    def __init__(
        self,
        nixl: NixlLike,
        config: TransportConfig,
        on_event: Callable[[TransferEvent], None],
        clock: Callable[[], float] = time.monotonic,
        record_posts: bool = False,
        max_posts_per_step: int = 4,
    ) -> None:
        self._nixl = nixl
        self._cfg = config
        self._on_event = on_event
        self._clock = clock
        self._record = record_posts
        self._max_posts = max_posts_per_step
        self._jobs: dict[tuple[str, str], StreamJob] = {}  # (req_id, stream) -> queued or in-flight job
        self._seq = itertools.count()
        self._inflight: list[_Inflight] = []
        self.inflight_bytes = 0
        # requests dropped with reads in flight: NIXL's release does not wait for an RMA already posted, so its
        # bytes may still land in their staging (TransferSink.free_staging quarantines it)
        self._torn: set[str] = set()
        self.hold_until = 0.0  # set by the owner: split anchors it knows are coming (regions not yet known)
        self._emitted = False
        self._accounted_at = clock()
        self._counted_until = -float("inf")  # the last moment counted as link time (reads in flight)
        self.stats = SchedulerStats()
        rate = config.link_bytes_per_s
        # A speculative (split) request's residual fills the link while its anchor waits for P (layer-wise publish)
        # in slices of at most one pipeline poll of link time: D learns of the anchor's next layer at its next
        # poll, so the anchor that starts decoding waits behind at most about that much residual (a whole chunk
        # is 2.8 s of a 0.003 Gbit/s link). Unpaced, the in-flight window bounds it.
        self._slice = 0 if rate is None else max(4096, int(rate * config.pipeline_poll_s))
        self._link = None if rate is None else VirtualLink(rate, config.catch_up_s)
        self._backlogged = False  # the last step left postable work waiting for the emulated link

    # ---- queueing ----------------------------------------------------------------------------
    def submit(self, job: StreamJob) -> None:
        if job.nbytes <= 0:
            raise ValueError(f"stream job {job.req_id}/{job.stream} has no bytes")
        if (job.req_id, job.stream) in self._jobs:
            raise ValueError(f"stream job {job.req_id}/{job.stream} is already queued")
        job.t_queued, job.seq = self._clock(), next(self._seq)
        self._jobs[job.req_id, job.stream] = job

    def extend(self, req_id: str, ready: dict[str, int | None]) -> None:
        """More of a request's streams became readable on P (``ready[stream]``: bytes, None = all)."""
        for stream, n in ready.items():
            job = self._jobs.get((req_id, stream))
            if job is not None and job.ready is not None:
                job.ready = None if n is None or n >= job.nbytes else max(job.ready, n)

    def left(self, req_id: str, stream: str) -> int | None:
        """Bytes of a queued stream not landed yet, once P has published all of it; None otherwise (P still
        publishes it, or it is not queued: finished or unknown)."""
        job = self._jobs.get((req_id, stream))
        return None if job is None or job.ready is not None else job.nbytes - job.done

    def pending_requests(self) -> set[str]:
        """Requests with a stream queued or in flight."""
        ids = {j.req_id for j in self._jobs.values()}
        ids.update(f.job.req_id for f in self._inflight)
        return ids

    @property
    def idle(self) -> bool:
        return not self._inflight and not self._jobs

    def take_torn(self, req_id: str) -> bool:
        """Whether the request was dropped with reads in flight (once; any thread)."""
        if req_id in self._torn:
            self._torn.discard(req_id)
            return True
        return False

    def mark_torn(self, req_id: str) -> None:
        """Whether its reads ended is unknown (an abort the service thread never acknowledged): treat as torn."""
        self._torn.add(req_id)

    def cancel(self, req_id: str) -> None:
        """Drop a request's streams without events (abort); in-flight chunks are released."""
        self._drop(req_id, error=None)

    def fail(self, req_id: str, error: str) -> None:
        """Fail every unfinished stream of a request (one failed event each)."""
        self._drop(req_id, error=error)

    def fail_peer(self, peer: str, error: str) -> None:
        ids = {j.req_id for j in self._jobs.values() if j.peer == peer}
        ids.update(f.job.req_id for f in self._inflight if f.job.peer == peer)
        for req_id in sorted(ids):
            self.fail(req_id, error)

    def _drop(self, req_id: str, error: str | None) -> None:
        jobs = [self._jobs.pop(k) for k in [k for k in self._jobs if k[0] == req_id]]
        self._account(self._clock())
        for f in [f for f in self._inflight if f.job.req_id == req_id]:
            if f.state is None:  # NIXL has not finished it (an emulated link may hold a finished one)
                self._torn.add(req_id)
            self._inflight.remove(f)
            self.inflight_bytes -= f.nbytes
            self._release(f.handle)
            if f.job not in jobs:
                jobs.append(f.job)
        now = self._clock()
        for job in sorted(jobs, key=lambda j: j.stream != ANCHOR):
            if job.finished:
                continue
            job.finished = True
            if error is not None:
                self._emit(job, False, error, now)

    # ---- the engine --------------------------------------------------------------------------
    def step(self) -> float | None:
        """Reap completions, then post chunks; returns seconds until the next useful call (None = idle)."""
        now = self._clock()
        self._emitted = False
        self._reap(now)
        wait: float | None = None
        for _ in range(self._max_posts):
            if self._emitted:  # let the owner publish completions before posting more
                return 0.0
            job, key = best(self._jobs.values(), self._jobs, now, self._cfg.order, self._cfg.max_wait_s)
            if job is None or key is None:
                break
            if key[0] > EARLY and now < self.hold_until:
                wait = self.hold_until - now
                break
            n = min(self._cfg.chunk_bytes, job.postable)
            if self._slice and job.stream == RESIDUAL and job.order == SPLIT and job.t_ready is None:
                n = min(n, self._slice)  # its anchor waits for P: fill the idle link in slices it overtakes soon
            if self.inflight_bytes and self.inflight_bytes + n > self._cfg.window_bytes:
                break
            if self._link is not None:
                w = self._link.wait_time(now)
                if w > 0.0:
                    wait, self._backlogged = w, True
                    break
            self._post(job, n, now)
            now = self._clock()
        else:
            if best(self._jobs.values(), self._jobs, now, self._cfg.order, self._cfg.max_wait_s)[0] is not None:
                return 0.0
        if self._inflight:
            # NIXL transfers still running are polled; chunks only the emulated link still carries wake us when due
            due = min(POLL_INTERVAL_S if f.state is None else max(0.0, f.t_due - now) for f in self._inflight)
            wait = due if wait is None else min(wait, due)
        return wait

    def _post(self, job: StreamJob, n: int, now: float) -> None:
        off = job.posted
        job.posted += n
        if job.posted == job.nbytes and job.stream == ANCHOR:
            residual = self._jobs.get((job.req_id, RESIDUAL))
            if residual is not None:
                residual.t_ready = now  # a split residual joins the tier of units from now (ranking.py)
        if job.t_first_post is None:
            job.t_first_post = now
        if self._record:
            self.stats.post_log.append((job.req_id, job.stream, off, n))
        self.stats.chunks_posted += 1
        try:
            handle, state = self._nixl.post_read(job.peer, job.local_addr + off, job.remote_addr + off, n)
        except Exception as exc:
            self.fail(job.req_id, f"NIXL READ of {job.stream} from {job.peer} failed: {exc}")
            return
        was_idle = self.inflight_bytes == 0
        self._account(now)
        due = 0.0 if self._link is None else self._link.reserve(n, now, self._backlogged)
        self._backlogged = False
        if was_idle and self._link is not None:
            # a caught-up chunk started on the emulated link when it freed, before this (late) post: its link
            # time from then counts too, or the meter reads less than its bytes at the link's rate
            back = max(due - n / self._link.rate, self._counted_until)
            if min(now, due) > back:
                job.link_s += min(now, due) - back
                self._counted_until = min(now, due)
        job.inflight += n
        self.inflight_bytes += n
        self.stats.max_inflight_bytes = max(self.stats.max_inflight_bytes, self.inflight_bytes)
        entry = _Inflight(job, handle, n, now, due)
        self._inflight.append(entry)
        if state == "DONE" and entry.t_due > self._clock():
            entry.state = state  # moved (cma is synchronous), but not yet on the emulated link
        elif state != "PROC":
            done_at = self._clock()
            entry.state = state
            self._settle([entry], done_at)
            self._complete(entry, state, done_at)

    def _account(self, now: float) -> None:
        """Share the link time since the last call among the chunks in flight, by their bytes: each stream's
        ``link_s`` is the link time its reads took, and D's streams together count each busy moment once (so P's
        meter can add them up, whoever else D reads from). Called before every change of what is in flight."""
        dt = now - self._accounted_at
        if dt <= 0.0:
            return
        self._accounted_at = now
        if self.inflight_bytes > 0:
            self._counted_until = now
            for f in self._inflight:
                f.job.link_s += dt * f.nbytes / self.inflight_bytes

    def _settle(self, entries: list[_Inflight], now: float) -> None:
        """Take settled chunks out of flight (and of the link time), each at the moment it stopped taking the
        link: on the emulated link, a chunk whose read had finished by its delivery leaves then, not when D
        got round to reaping it (a late wake-up on the loaded box is no link time)."""
        def left_at(f: _Inflight) -> float:
            if self._link is not None and f.state == "DONE":
                return min(now, max(f.t_due, f.t_post))
            return now

        for f in sorted(entries, key=left_at):
            self._account(left_at(f))
            self._inflight.remove(f)
            self.inflight_bytes -= f.nbytes
        self._account(now)

    def _reap(self, now: float) -> None:
        settled: list[tuple[_Inflight, str]] = []
        for entry in list(self._inflight):
            state = entry.state
            if state is None:
                try:
                    state = self._nixl.check(entry.handle)
                except Exception as exc:
                    logger.warning("check_xfer_state failed for %s: %s", entry.job.req_id, exc)
                    state = "ERR"
            if state == "PROC":
                if now - entry.t_post > self._cfg.timeout_s:
                    self.fail(entry.job.req_id, f"{entry.job.stream} chunk from {entry.job.peer} stalled "
                              f"for more than {self._cfg.timeout_s}s")
                continue
            if state == "DONE" and now < entry.t_due:
                entry.state = state  # the emulated link has not delivered it yet
                continue
            settled.append((entry, state))
        if settled:  # the shares stay constant until the set in flight changes: account only when it does
            self._settle([entry for entry, _ in settled], now)
        # Chunks found settled in one pass completed in no order we can know (UCX does not order READ
        # completions); settle anchors first, so that when both streams of a request finish in one pass the
        # anchor's event comes first, as the priority order promises.
        for entry, state in sorted(settled, key=lambda es: es[0].job.stream != ANCHOR):
            self._complete(entry, state, now)

    def _complete(self, entry: _Inflight, state: str, now: float) -> None:
        job = entry.job  # out of flight already (_settle)
        self._release(entry.handle)
        job.inflight -= entry.nbytes
        if job.finished:
            return
        if state != "DONE":
            self.fail(job.req_id, f"NIXL READ of {job.stream} from {job.peer} returned {state}")
            return
        job.done += entry.nbytes
        self.stats.bytes_done += entry.nbytes
        if job.done == job.nbytes:
            job.finished = True
            self._jobs.pop((job.req_id, job.stream), None)
            self._emit(job, True, None, now)

    def _emit(self, job: StreamJob, ok: bool, error: str | None, now: float) -> None:
        if not ok:
            logger.warning("transfer %s/%s failed: %s", job.req_id, job.stream, error)
        self._emitted = True
        data_s = None if job.t_first_post is None else now - job.t_first_post
        self._on_event(TransferEvent(job.req_id, job.stream, ok, error, job.done, now - job.t0, data_s,
                                     link_seconds=job.link_s))

    def _release(self, handle: Any) -> None:
        try:
            self._nixl.release(handle)
        except Exception as exc:  # an errored or cancelled handle may refuse release
            logger.debug("release_xfer_handle: %s", exc)

    def close(self) -> None:
        for entry in self._inflight:
            self._release(entry.handle)
        self._inflight.clear()
        self.inflight_bytes = 0
        self._jobs.clear()
