"""D's part of the worker half (a mixin of `LynxConnectorWorker`): pull a request's planes into D's staging and
write them into its blocks.

D pulls the anchor stream (high priority) and the residual stream (low priority) into D's staging, then writes
into the request's blocks: mode ``anchor`` (and the single-stream baselines) writes when the anchor lands;
``full`` merges anchor+residual when both have landed; ``speculative`` writes the anchor when it lands,
reports the request ready, and merges the residual in place later (signalled through worker metadata:
``residual_merged``, or ``residual_failed`` when the residual cannot arrive any more; a residual that fails in
the very step its anchor is reported turns into an ordinary ``failed_recving``). A pull that finds no room in
D's staging waits in arrival order until its deadline. A pull of the concurrent flow (P may not have the request
yet) takes D's staging only once P has staged it (`TransferSink.watch` / `attach`): it joins that queue then.
With ``auto`` in that flow P chooses the mode as it prefills: the mode P names then sets the request's sizes and
how D serves it (a Lynx choice as D can: speculative or full), reported to the scheduler half (``auto_modes``).
Integrity (issue 14.4): D verifies every layer of a plane as soon as the plane lands (its checksum, seeded with
P's transfer id and the staging's generation, and the anchor's metadata finite) before anything of it is
decoded: a mismatch fails only that request, by the same path as a failed stream.
Every path ends in ``_finish_recv``: staging freed on both sides, exactly once, whatever happened. An aborted
request is reported in ``finished_recving`` (again, for a speculative one) so that vLLM frees its blocks only
now; a cancelled one (preempted while speculating: its blocks are already freed) is dropped silently.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from lynx_connector.codec import (
    IntegrityError,
    KVLayout,
    NonFiniteKVError,
    StagedLayout,
    check_metadata,
    decode_anchor,
    merge_residual,
    staging_id,
)
from lynx_connector.compat import staged_dtype
from lynx_connector.logger import init_logger
from lynx_connector.metadata import LynxConnectorMetadata, LynxWorkerMeta, RecvSpec
from lynx_connector.modes import get_mode
from lynx_connector.stats import LynxStats
from lynx_connector.testing import FaultHooks
from lynx_connector.trace import trace
from lynx_connector.transport import StagingFullError, TransferEvent, TransferSink

logger = init_logger(__name__)

#: Speculative pulls' ends remembered for a late recv_aborted, at most (each is forgotten once the scheduler half
#: names the request in spec_settled, recv_aborted or recv_cancelled).
MAX_ENDED = 1 << 16

__all__ = ["ReceiveHalf"]


@dataclass
class _Recv:
    spec: RecvSpec
    staged: Any  # the sink's staging handle: .anchor / .residual uint8 views (None: watched, not staged yet)
    t_start: float
    anchor_landed: bool = False
    residual_landed: bool = False
    reported: bool = False  # finished_recving already sent to the scheduler
    anchor_step: int = -1  # worker step in which the anchor was written (speculative mode)
    grace_until: float | None = None  # speculative: the anchor waits for a residual due before this (monotonic)


class ReceiveHalf:
    """Mixin of `LynxConnectorWorker`: D's pulls. It uses the worker's ``sink``, ``layers``, ``layout``,
    ``stats``, ``_faults``, ``_step``, ``_codec`` and ``_plane_nbytes``; ``_init_receive`` sets up its state."""

    config: Any
    sink: TransferSink | None
    layers: list[tuple[str, torch.Tensor]]
    layout: KVLayout | None
    tp_rank: int
    tp_size: int
    stats: LynxStats
    _faults: FaultHooks
    _step: int

    def _init_receive(self) -> None:
        self._recvs: dict[str, _Recv] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # pulls waiting for room in D's staging pool, in arrival order: req_id -> (spec, hooks, deadline)
        self._recv_waiting: OrderedDict[str, tuple[RecvSpec, dict[str, Any], float]] = OrderedDict()
        self._merged: set[str] = set()
        self._residual_failed: set[str] = set()
        self._auto_modes: dict[str, tuple[str, str, str]] = {}  # auto, concurrent flow: served as, P's reason, choice
        # speculative pulls that ended (residual merged or failed) after their anchor was reported:
        # vLLM may finish such a request (P's first token stops it) before the scheduler half has seen the end
        # (or, tensor parallel, before every worker's end): it then keeps the blocks for a finished_recving that
        # only recv_aborted can ask for (start_load)
        self._ended_on_anchor: OrderedDict[str, None] = OrderedDict()

    def start_load(self, meta: LynxConnectorMetadata) -> None:
        for req_id in meta.recv_aborted:
            rec = self._recvs.get(req_id)
            if rec is not None:
                self._finish_recv(rec, error="the request ended (finished or aborted) while its KV was in flight",
                                  outcome="aborted")
            elif (waiting := self._recv_waiting.pop(req_id, None)) is not None:
                self._finished_recving.add(req_id)  # never pulled: vLLM frees its blocks now
                self._discard(waiting[0])
            elif req_id in self._ended_on_anchor:
                del self._ended_on_anchor[req_id]
                self._finished_recving.add(req_id)  # its end crossed its finish: vLLM frees its blocks now
        for req_id in meta.recv_cancelled:
            rec = self._recvs.get(req_id)
            if rec is not None:
                self._finish_recv(rec, error="cancelled while speculating (preempted, or its residual failed on "
                                        "another worker)", outcome="cancelled")
            self._recv_waiting.pop(req_id, None)
            self._ended_on_anchor.pop(req_id, None)
        for req_id in meta.spec_settled:
            self._ended_on_anchor.pop(req_id, None)
        while len(self._ended_on_anchor) > MAX_ENDED:  # a bound only: every entry is settled, aborted or cancelled
            self._ended_on_anchor.popitem(last=False)
        hooks = meta.test_hooks
        for spec in meta.reqs_to_recv:
            self._start_recv(spec, hooks.get(spec.req_id, {}))

    def _start_recv(self, spec: RecvSpec, hooks: dict[str, Any]) -> None:
        if self.sink is None:
            logger.error("LynxConnector: request %s needs a remote prefill but this worker is not a consumer",
                         spec.req_id)
            if spec.num_tokens:
                self._failed_recving.add(spec.req_id)
                self._finished_recving.add(spec.req_id)
            return
        if spec.num_tokens == 0:  # nothing to pull (a full local prefix hit, or it ended unscheduled): P frees now
            return self._discard(spec)
        a, r = self._pull_layout(spec).nbytes
        need = a + r
        if not self.sink.pool.fits(a, r):  # can never fit: fail now rather than after waiting for room
            logger.error("LynxConnector: request %s needs %d bytes of staging, more than D's whole pool "
                         "(staging_mb=%d)", spec.req_id, need, self.sink.pool.nbytes >> 20)
            self._fail_unstarted(spec)
            return
        if spec.concurrent:  # P may not have it yet: D's staging is taken only once P has staged it (`_watch`)
            return self._watch(spec, hooks)
        if self._recv_waiting or not self._begin_pull(spec, hooks):  # FIFO behind requests already waiting
            self._recv_waiting[spec.req_id] = (spec, hooks, time.monotonic() + self.config.timeout_s)
            logger.info("LynxConnector: D's staging full, request %s waits for room (%d waiting)", spec.req_id,
                        len(self._recv_waiting))

    def _watch(self, spec: RecvSpec, hooks: dict[str, Any]) -> None:
        """Concurrent flow: ask P for the request without D's staging (`TransferSink.watch`); once P reports it
        staged (`_take_staged`) it queues for D's staging like any other pull. Staging held by requests P has not
        even started would else fill D's pool during a burst while P's pool fills with requests waiting for D."""
        assert self.sink is not None
        rec = _Recv(spec=spec, staged=None, t_start=time.perf_counter())
        self._recvs[spec.req_id] = rec
        self._faults.track(spec.req_id, hooks)
        a, r = self._pull_layout(spec).nbytes
        # auto: P names the mode it chose in its Regions; each mode D accepts from it has its own sizes
        layouts = {m: self._pull_layout(replace(spec, mode=m)).nbytes for m in self.config.auto_modes} \
            if spec.auto else None
        try:
            self.sink.watch(spec.req_id, spec.remote_host, spec.port_for_rank(self.tp_rank, self.tp_size),
                            spec.transfer_id, spec.token, a, r, wait_s=self.config.concurrent_wait_s,
                            order=get_mode(spec.mode).pull_order, layouts=layouts)
        except ValueError as exc:
            self._finish_recv(rec, error=f"cannot pull: {exc}")

    def _take_staged(self) -> None:
        """Watched requests P has staged join the queue for D's staging (in the order P staged them)."""
        assert self.sink is not None
        deadline = time.monotonic() + self.config.timeout_s
        for req_id, p_mode, reason in self.sink.staged():
            rec = self._recvs.get(req_id)
            if rec is not None and rec.staged is None and req_id not in self._recv_waiting:
                if rec.spec.auto:  # P's choice: a Lynx one is served as D picked (speculative or full)
                    served = rec.spec.mode if get_mode(p_mode).two_stream else p_mode
                    rec.spec = replace(rec.spec, mode=served, auto=False)
                    self._auto_modes[req_id] = (served, reason, p_mode)
                    trace("D", rec.spec.transfer_id or req_id, "auto", mode=served)
                self._recv_waiting[req_id] = (rec.spec, {}, deadline)

    def _retry_waiting_recvs(self) -> None:
        """Start the pulls that waited for D's staging while they fit, oldest first; fail those past timeout_s."""
        assert self.sink is not None
        now = time.monotonic()
        while self._recv_waiting:
            req_id, (spec, hooks, deadline) = next(iter(self._recv_waiting.items()))
            if self._begin_pull(spec, hooks):
                del self._recv_waiting[req_id]
                continue
            if now < deadline:
                return
            del self._recv_waiting[req_id]
            msg = (f"found no room in D's staging pool (staging_mb={self.sink.pool.nbytes >> 20}) within "
                   f"{self.config.timeout_s:.1f}s")
            if (rec := self._recvs.get(req_id)) is not None:  # watched: the sink holds P's lease of it
                self.stats.record_failure("stage")
                self._finish_recv(rec, error=msg, outcome="unstaged")
                continue
            logger.error("LynxConnector: request %s %s", req_id, msg)
            self._fail_unstarted(spec)

    def _discard(self, spec: RecvSpec) -> None:
        """P's staging of a load that will never be pulled is freed now (a Done), not at its lease."""
        with contextlib.suppress(ValueError):  # params D could not have pulled with either: nothing to free
            self.sink.discard(spec.remote_host, spec.port_for_rank(self.tp_rank, self.tp_size), spec.transfer_id,
                              spec.token)

    def _fail_unstarted(self, spec: RecvSpec) -> None:
        """A load that never got staging: reported failed at once (kv_load_failure_policy applies)."""
        self._failed_recving.add(spec.req_id)
        self._finished_recving.add(spec.req_id)
        self.stats.record_failure("stage")
        self._discard(spec)

    def _pull_layout(self, spec: RecvSpec) -> StagedLayout:
        """D's staging layout of a request (the residual empty when its mode never pulls it)."""
        sl = self._plane_nbytes(spec.mode, spec.num_tokens, staged_dtype(spec.kv_dtype))
        if not get_mode(spec.mode).pulls_residual:
            sl = sl.without_residual()  # decoding on the anchor alone: P frees the residual with the rest
        return sl

    def _begin_pull(self, spec: RecvSpec, hooks: dict[str, Any]) -> bool:
        """Allocate D's staging for a request and start its pull; False when the pool has no room right now."""
        assert self.sink is not None
        a, r = self._pull_layout(spec).nbytes  # all layers and their trailers; residual 0 when not pulled
        try:
            staged = self.sink.pool.alloc_request(spec.req_id, a, r)
        except StagingFullError:
            return False  # room comes back as other pulls finish (it fits the pool: checked on arrival)
        if (held := self._recvs.get(spec.req_id)) is not None:  # watched, staged by P: its transfer starts now
            held.staged = staged
            self.sink.attach(spec.req_id, staged.anchor, staged.residual if r else None,
                             order=get_mode(spec.mode).pull_order)
            return True
        rec = _Recv(spec=spec, staged=staged, t_start=time.perf_counter())
        self._recvs[spec.req_id] = rec
        trace("D", spec.transfer_id or spec.req_id, "pull")
        self._faults.track(spec.req_id, hooks)
        try:
            port = spec.port_for_rank(self.tp_rank, self.tp_size)
            self.sink.pull(spec.req_id, spec.remote_host, port, spec.transfer_id, spec.token,
                           staged.anchor, staged.residual if r else None,
                           wait_s=self.config.concurrent_wait_s if spec.concurrent else None,
                           order=get_mode(spec.mode).pull_order)
        except ValueError as exc:
            self._finish_recv(rec, error=f"cannot pull: {exc}")
        return True

    def _verify(self, rec: _Recv, stream: str, generation: int) -> str | None:
        """Check a plane that has just landed in D's staging, every layer, before any of it is decoded: its
        checksums and (anchor) its metadata finite. The error naming the layer and plane, or None."""
        assert self.layout is not None
        spec = rec.spec
        sl = self._pull_layout(spec)
        plane = sl.anchor if stream == "anchor" else sl.residual
        buf = rec.staged.anchor if stream == "anchor" else rec.staged.residual
        flip = self._faults.flip_bit(spec.req_id, stream)  # test hook flip_bit: a corrupted READ
        if flip is not None and plane.plane_nbytes:
            layer, byte, bit = flip
            plane.plane(buf, layer % plane.num_layers)[byte % plane.plane_nbytes] ^= 1 << bit
        names = [n for n, _ in self.layers]
        t0 = time.perf_counter()
        try:
            plane.verify_all(buf, staging_id(spec.transfer_id, generation), names)
            self.stats.record_security("d", "checksum", time.perf_counter() - t0)
            if stream == "anchor":
                codec = self._codec(spec.mode)
                for i, name in enumerate(names):
                    check_metadata(codec, plane.plane(buf, i), self.layout, spec.num_tokens,
                                   layer_name=f"layer {i} ({name})", staged_dtype=staged_dtype(spec.kv_dtype))
        except (IntegrityError, NonFiniteKVError) as exc:
            return f"integrity check failed: {exc}"
        except Exception as exc:  # malformed planes must fail this request, not the engine
            logger.exception("LynxConnector: checking request %s's %s failed", spec.req_id, stream)
            return f"integrity check failed: {exc}"
        return None

    def _write_blocks(self, rec: _Recv, full: bool) -> None:
        assert self.layout is not None
        spec = rec.spec
        codec = self._codec(spec.mode)
        sl = self._pull_layout(spec)
        anchor, residual = rec.staged.anchor, rec.staged.residual
        staged = staged_dtype(spec.kv_dtype)  # P's cache dtype: D converts on write (compat.py)
        if full:
            self._faults.corrupt(spec.req_id, residual)  # after the checksum (test hook corrupt_residual)
        for i, (_, kv) in enumerate(self.layers):
            pa = sl.anchor.plane(anchor, i)
            if full:
                merge_residual(codec, pa, sl.residual.plane(residual, i), kv, spec.block_ids, self.layout,
                               spec.num_tokens, skip_blocks=spec.skip_blocks, staged_dtype=staged)
            else:
                decode_anchor(codec, pa, kv, spec.block_ids, self.layout, spec.num_tokens,
                              skip_blocks=spec.skip_blocks, staged_dtype=staged)

    def _poll_recvs(self) -> None:
        """D: apply the streams that landed since the last step to the KV cache (once per step)."""
        if self.sink is None:
            return
        for req_id in self._faults.due_merges(self._step):  # test hook delay_residual_steps
            rec = self._recvs.get(req_id)
            if rec is not None:
                self._apply(rec, full=True)
        self._take_staged()
        self._end_graces()
        events = self.sink.poll()
        landing = {e.req_id for e in events if e.ok and e.stream == "residual"}
        for ev in events:
            rec = self._recvs.get(ev.req_id)
            if rec is None:
                continue
            if not ev.ok:
                self._finish_recv(rec, error=f"{ev.stream} stream failed: {ev.error}")
                continue
            now = time.perf_counter() - rec.t_start
            mode = get_mode(rec.spec.mode)
            trace("D", rec.spec.transfer_id or ev.req_id, f"{ev.stream}_landed", step=self._step)
            if ev.stream == "anchor":
                rec.anchor_landed = True
                self.stats.record_stream("anchor", ev.nbytes, now)
                bad = self._verify(rec, "anchor", ev.generation)
                if bad is not None:
                    self._finish_recv(rec, error=bad)
                    continue
                if mode.decodes_on_anchor:
                    if mode.late_residual and self._residual_due(rec, ev, ev.req_id in landing):
                        rec.grace_until = time.monotonic() + self.config.residual_grace_s
                        trace("D", rec.spec.transfer_id or ev.req_id, "anchor_waits_for_residual", step=self._step)
                    else:
                        self._apply(rec, full=False)
            else:
                rec.residual_landed = True
                self.stats.record_stream("residual", ev.nbytes, now)
                fault = self._faults.residual_error(ev.req_id) or self._verify(rec, "residual", ev.generation)
                if fault is not None:
                    self._finish_recv(rec, error=fault)
                    continue
            if self._recvs.get(ev.req_id) is not rec:  # writing its anchor failed (or finished it): done with
                continue
            if rec.anchor_landed and rec.residual_landed and mode.pulls_residual:
                if mode.late_residual and self._faults.defer_merge(ev.req_id, rec.anchor_step, self._step):
                    continue  # test hook: merged in a later step (due_merges)
                self._apply(rec, full=True)
        if self._recv_waiting:  # staging freed by the pulls that finished above
            self._retry_waiting_recvs()

    def _residual_due(self, rec: _Recv, anchor: TransferEvent, landed: bool) -> bool:
        """Speculative: whether the rest of the request's residual (all published by P) is due within
        ``residual_grace_s`` at the link's rate (``link_gbps``, else the rate its anchor achieved). Then a step on
        the anchor would buy nothing: the merge and a verification step would follow it at once. ``landed``: its
        event came in this same poll."""
        assert self.sink is not None
        grace = self.config.residual_grace_s
        if grace <= 0 or self._faults.residual_late(rec.spec.req_id):
            return False
        if landed:
            return True
        left = self.sink.left(rec.spec.req_id, "residual")
        if left is None:
            return False
        rate = self.sink.config.link_bytes_per_s
        if rate is None and anchor.data_seconds:
            rate = anchor.nbytes / anchor.data_seconds
        return rate is not None and left <= rate * grace

    def _end_graces(self) -> None:
        """Anchors whose residual did not land within its grace: start on the anchor after all."""
        now = time.monotonic()
        for rec in list(self._recvs.values()):
            if rec.grace_until is not None and now >= rec.grace_until and not rec.residual_landed:
                rec.grace_until = None
                self._apply(rec, full=False)

    def _apply(self, rec: _Recv, full: bool) -> None:
        try:
            self._write_blocks(rec, full)
        except Exception as exc:  # malformed planes must fail this request, not the engine
            logger.exception("LynxConnector: writing request %s into the KV cache failed", rec.spec.req_id)
            self._finish_recv(rec, error=f"decode failed: {exc}")
            return
        mode = get_mode(rec.spec.mode)
        trace("D", rec.spec.transfer_id or rec.spec.req_id, "written_full" if full else "written_anchor",
              step=self._step)
        if full and mode.late_residual:
            self._merged.add(rec.spec.req_id)
        if not full:
            rec.anchor_step = self._step
        done = full or not mode.pulls_residual
        if not rec.reported:
            rec.reported = True
            self._finished_recving.add(rec.spec.req_id)
        if done:
            self._finish_recv(rec, error=None)

    def _finish_recv(self, rec: _Recv, error: str | None, outcome: str = "failed") -> None:
        """Single exit for a pull: frees D's staging, tells P to free its own, reports once.

        ``outcome`` matters only with an error: "failed" (the failure policy applies), "aborted" (the request
        is finished: report it so vLLM frees its blocks now), "cancelled" (preempted: no report at all) or
        "unstaged" (a watched request that never got D's staging: failed, counted by the caller as "stage")."""
        assert self.sink is not None
        req_id = rec.spec.req_id
        self._recvs.pop(req_id, None)
        self._recv_waiting.pop(req_id, None)
        self._faults.forget(req_id)
        if error is not None:
            if outcome == "unstaged":
                logger.error("LynxConnector: request %s %s", req_id, error)
                outcome = "failed"
            elif outcome == "failed":
                logger.error("LynxConnector: KV load for request %s failed: %s", req_id, error)
                self.stats.record_failure("integrity" if error.startswith("integrity check failed") else "load")
            else:
                logger.info("LynxConnector: KV load for request %s stopped: %s", req_id, error)
            self.sink.abort(req_id)
            if outcome == "aborted":
                self._finished_recving.add(req_id)  # (again, if the anchor was reported): vLLM frees the blocks
                rec.reported = True
            elif outcome == "cancelled":
                rec.reported = True  # preempted: its blocks are gone, nothing to report
            elif not rec.reported or req_id in self._finished_recving:
                # Not reported yet, or the anchor was reported in this same step (not yet seen by the
                # scheduler): a plain load failure, vLLM's kv_load_failure_policy applies.
                self._failed_recving.add(req_id)
            elif get_mode(rec.spec.mode).late_residual:
                self._residual_failed.add(req_id)  # running on its anchor: the Lynx scheduler applies the policy
                self._ended_on_anchor[req_id] = None
        else:
            self.stats.record_request(time.perf_counter() - rec.t_start)
            if rec.reported and req_id not in self._finished_recving:
                self._ended_on_anchor[req_id] = None  # merged after the anchor's report
        if not rec.reported:
            rec.reported = True
            self._finished_recving.add(req_id)
        self.sink.release(req_id)
        self.sink.free_staging(req_id)

    def wait_idle(self, meta: LynxConnectorMetadata) -> None:
        """On a step with nothing to compute while pulls are in flight: wait up to ``idle_wait_s`` for one to land
        (returns the moment one does), so that vLLM's loop of empty steps does not spin meanwhile."""
        if (meta.idle and self.sink is not None and self.config.idle_wait_s > 0
                and (self._recvs or self._recv_waiting) and not (meta.reqs_to_recv or meta.recv_aborted)):
            self.sink.wait(self.config.idle_wait_s)

    def take_results(self) -> tuple[set[str], set[str]]:
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return done, failed

    def take_worker_meta(self) -> LynxWorkerMeta | None:
        tokens = dict(self.sink.first_tokens()) if self.sink is not None else {}  # concurrent flow: P's first tokens
        if not self._merged and not self._residual_failed and not tokens and not self._auto_modes:
            return None
        merged, failed, auto = self._merged, self._residual_failed, self._auto_modes
        self._merged, self._residual_failed, self._auto_modes = set(), set(), {}
        return LynxWorkerMeta(residual_merged=merged, residual_failed=failed, first_tokens=tokens, auto_modes=auto)
