"""Worker half of LynxConnector (runs in each worker process, next to the paged KV cache).

P: after the forward of the step in which a request's prompt completes, encode every layer of it into one
contiguous anchor region and one contiguous residual region of staging (registered with NIXL once) and
publish them; D pulls them. P's staging is freed when D says it is done, on abort, or when the lease ends.

D: pull the anchor stream (high priority) and the residual stream (low priority) into D's staging, then write
into the request's blocks: mode ``anchor`` (and the single-stream baselines) writes when the anchor lands;
``full`` merges anchor+residual when both have landed; ``speculative`` writes the anchor when it lands,
reports the request ready, and merges the residual in place later (signalled through worker metadata:
``residual_merged``, or ``residual_failed`` when the residual cannot arrive any more; a residual that fails in
the very step its anchor is reported turns into an ordinary ``failed_recving``).
Integrity (issue 14.4): each layer's plane in staging is followed by its checksum (``codec/integrity.py`` owns
that layout); P seals every layer right after encoding it, D verifies every layer of a plane as soon as the
plane lands (and the anchor's metadata finite) before anything of it is decoded: a mismatch fails only that
request, by the same path as a failed stream.
Every path ends in ``_finish_recv``: staging freed on both sides, exactly once, whatever happened. An aborted
request is reported in ``finished_recving`` (again, for a speculative one) so that vLLM frees its blocks only
now; a cancelled one (preempted while speculating: its blocks are already freed) is dropped silently.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lynx_connector.codec import (
    IntegrityError,
    KVLayout,
    NonFiniteKVError,
    StagedLayout,
    check_metadata,
    decode_anchor,
    encode,
    get_codec,
    merge_residual,
    staged_layout,
    staging_id,
)
from lynx_connector.compat import dtype_name, kv_compat, staged_dtype
from lynx_connector.config import LynxConfig
from lynx_connector.logger import init_logger
from lynx_connector.metadata import (
    LynxConnectorMetadata,
    LynxHandshakeMetadata,
    LynxWorkerMeta,
    RecvSpec,
    SaveSpec,
)
from lynx_connector.modes import LYNX_CODEC, get_mode
from lynx_connector.saving import SaveQueue
from lynx_connector.stats import LynxStats, TransportExporter
from lynx_connector.testing import fault_hooks
from lynx_connector.transport import (
    StagingFullError,
    TransferSink,
    TransferSource,
    load_side_channel_key,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


@dataclass
class _Recv:
    spec: RecvSpec
    staged: Any  # the sink's staging handle: .anchor / .residual uint8 views
    t_start: float
    anchor_landed: bool = False
    residual_landed: bool = False
    reported: bool = False  # finished_recving already sent to the scheduler
    anchor_step: int = -1  # worker step in which the anchor was written (speculative mode)


class LynxConnectorWorker:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, config: LynxConfig):
        self.config = config
        self.engine_id = engine_id
        self.vllm_config = vllm_config
        self._codecs: dict[str, Any] = {}
        self._codec(config.mode)  # validate the configured codec at start-up, not on the first request
        kv_cfg = vllm_config.kv_transfer_config
        self.is_producer = kv_cfg.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_cfg.kv_role in ("kv_consumer", "kv_both")
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank = 0
        self.layers: list[tuple[str, torch.Tensor]] = []
        self.layout: KVLayout | None = None
        self.source: TransferSource | None = None
        self.saves: SaveQueue | None = None
        self.sink: TransferSink | None = None
        self.stats = LynxStats()
        self._exporter = TransportExporter()
        self._recvs: dict[str, _Recv] = {}
        self._finished_recving: set[str] = set()
        # D: pulls waiting for room in D's staging pool, in arrival order: req_id -> (spec, hooks, deadline)
        self._recv_waiting: OrderedDict[str, tuple[RecvSpec, dict[str, Any], float]] = OrderedDict()
        self._failed_recving: set[str] = set()
        self._merged: set[str] = set()
        self._residual_failed: set[str] = set()
        self._step = 0  # poll() calls, one per engine step
        self._faults = fault_hooks(config)  # test-only (lynx_connector.testing)
        # The side channel's deployment key, read once at start-up (a missing or bad key fails start-up here)
        self._key = load_side_channel_key(insecure=config.insecure_side_channel)

    # ---- start-up -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank as rank
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size as world

        try:
            self.tp_rank, tp_size = rank(), world()
        except Exception:  # not initialised in some unit-test set-ups
            self.tp_rank, tp_size = 0, 1
        self._exporter.rank = self.tp_rank
        self.layers = list(kv_caches.items())
        if not self.layers:
            raise ValueError("LynxConnector: register_kv_caches got no KV cache tensors")
        first = self.layers[0][1]
        model_cfg = self.vllm_config.model_config
        # vLLM's CPU backend keeps a K tile then a V tile per (block, head), ordered by the attention ISA it
        # picked; on GPUs the FlashAttention layout interleaves K and V per token.
        self.layout = KVLayout.from_kv_cache(first, block_size=self.block_size,
                                             backend="cpu" if first.device.type == "cpu" else "flash")
        for name, t in self.layers[1:]:
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"LynxConnector: layer {name} has shape {tuple(t.shape)} {t.dtype}, expected "
                                 f"{tuple(first.shape)} {first.dtype} like the first layer")
        # What P and D must share, and nothing else: block size, layout and cache dtype may differ (compat.py)
        compat = kv_compat(model=model_cfg.model, layer_names=[n for n, _ in self.layers], layout=self.layout,
                           codec_options=self.config.codec_options, tp_rank=self.tp_rank, tp_size=tp_size)
        name = f"lynx-{self.engine_id}-tp{self.tp_rank}"
        if self.is_producer:
            self.source = TransferSource(self.config.transport_config(self.tp_rank, self._key, name + "-src"), compat,
                                         name=name + "-src", status_extra=self._status_counters)
            # P gives up on a request that found no room before D's own deadline would
            self.saves = SaveQueue(self.source, self._encode_request, wait_s=self.config.timeout_s / 2,
                                   on_reject=self.stats.record_failure)
        if self.is_consumer:
            self.sink = TransferSink(self.config.transport_config(self.tp_rank, self._key, name + "-dst"), compat,
                                     name=name + "-dst", status_extra=self._status_counters)
        logger.info("LynxConnector worker ready: %d layers, layout %s, mode %s, role %s, side channel %s",
                    len(self.layers), self.layout, self.config.mode,
                    self.vllm_config.kv_transfer_config.kv_role,
                    self.source.address if self.source else None)

    def _status_counters(self) -> dict[str, Any]:
        """The worker's queues for the status file (read from a transport thread: sizes only)."""
        return {"save_waiting": self.saves.waiting if self.saves is not None else 0,
                "recv_waiting": len(self._recv_waiting), "recvs_live": len(self._recvs)}

    def handshake_metadata(self) -> LynxHandshakeMetadata | None:
        if self.source is None:
            return None
        host, port = self.source.address
        return LynxHandshakeMetadata(host=host, port=port, tp_rank=self.tp_rank,
                                     kv_dtype=dtype_name(self.layout.dtype) if self.layout else "")

    def _codec(self, mode: str) -> Any:
        """The codec of a transfer mode (the modes table): every Lynx mode shares the lynx planes; baselines are
        their own. ``codec_options`` configure the Lynx codec only."""
        name = get_mode(mode).codec
        codec = self._codecs.get(name)
        if codec is None:
            opts = dict(self.config.codec_options) if name == LYNX_CODEC else {}
            codec = self._codecs[name] = get_codec(name, **opts)
        return codec

    def _plane_nbytes(self, mode: str, num_tokens: int, staged: torch.dtype | None = None) -> StagedLayout:
        """A request's staging layout: per layer, the anchor and residual planes and their checksum trailers
        (the same function on P and D, so both stage identical sizes; ``staged``: P's cache dtype on D)."""
        assert self.layout is not None
        return staged_layout(self._codec(mode), self.layout, num_tokens, len(self.layers), staged_dtype=staged)

    # ---- P: encode after the forward -------------------------------------------------------------------
    def save(self, meta: LynxConnectorMetadata) -> None:
        if self.source is None:
            if meta.reqs_to_save:
                logger.error("LynxConnector: %d requests to save but this worker is not a producer (kv_role)",
                             len(meta.reqs_to_save))
            return
        assert self.saves is not None
        for req_id in meta.save_aborted:
            self.saves.abort(req_id)
        self.saves.retry()  # room freed since the last step goes to the requests already waiting, in order
        for spec in meta.reqs_to_save:
            self.saves.submit(spec)

    def _encode_request(self, spec: SaveSpec) -> None:
        """Stage, encode and publish one request; `StagingFullError` when the pool has no room (the save queue
        then waits for room); any other failure rejects the request, so D hears why at once."""
        assert self.source is not None and self.layout is not None
        t0 = time.perf_counter()
        sl = self._plane_nbytes(spec.mode, spec.num_tokens)
        a, r = sl.nbytes
        codec = self._codec(spec.mode)
        if a + r > self.source.pool.nbytes:  # can never fit: no point in waiting for room
            msg = (f"the request needs {a + r} bytes of staging, more than P's whole pool "
                   f"(staging_mb={self.source.pool.nbytes >> 20})")
            logger.error("LynxConnector: request %s not sent: %s", spec.req_id, msg)
            self.source.reject(spec.req_id, "too_large", msg)
            self.stats.record_failure("too_large")
            return
        staged = self.source.alloc(spec.req_id, a, r, transfer_id=spec.transfer_id or None,
                                   token=spec.token or None)
        sid = staging_id(self.source.ticket(spec.req_id)[0], staged.generation)  # seeds the checksums
        try:
            for i, (name, kv) in enumerate(self.layers):
                encode(codec, kv, spec.block_ids, self.layout, spec.num_tokens,
                       sl.anchor.plane(staged.anchor, i), sl.residual.plane(staged.residual, i) if r else None,
                       layer_name=name)
                sl.anchor.seal(staged.anchor, i, sid)  # checksums right after the layer is encoded
                if r:
                    sl.residual.seal(staged.residual, i, sid)
        except NonFiniteKVError as exc:
            logger.error("LynxConnector: request %s not sent: %s", spec.req_id, exc)
            self.source.reject(spec.req_id, "nonfinite_kv", f"P's KV of the request is not finite: {exc}")
            self.stats.record_failure("nonfinite")
            return
        except Exception as exc:  # a bug or bad input must fail this request, not P's engine
            logger.exception("LynxConnector: encoding request %s failed", spec.req_id)
            self.source.reject(spec.req_id, "encode_failed", f"P could not encode the request: {exc}")
            self.stats.record_failure("encode")
            return
        self.source.publish(spec.req_id)
        self.stats.record_encode(a, r, time.perf_counter() - t0)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """P: requests whose KV blocks may be freed (staged or given up, and finished in vLLM); after poll()."""
        if self.saves is None:
            return set()
        return self.saves.finished_sending(finished_req_ids)

    # ---- D: pull and merge -----------------------------------------------------------------------------
    def start_load(self, meta: LynxConnectorMetadata) -> None:
        for req_id in meta.recv_aborted:
            rec = self._recvs.get(req_id)
            if rec is not None:
                self._finish_recv(rec, error="aborted by the client", outcome="aborted")
            elif (waiting := self._recv_waiting.pop(req_id, None)) is not None:
                self._finished_recving.add(req_id)  # never pulled: vLLM frees its blocks now
                self._discard(waiting[0])
        for req_id in meta.recv_cancelled:
            rec = self._recvs.get(req_id)
            if rec is not None:
                self._finish_recv(rec, error="preempted while speculating", outcome="cancelled")
            self._recv_waiting.pop(req_id, None)
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
        need = sum(self._pull_layout(spec).nbytes)
        if need > self.sink.pool.nbytes:  # can never fit: fail now rather than after waiting for room
            logger.error("LynxConnector: request %s needs %d bytes of staging, more than D's whole pool "
                         "(staging_mb=%d)", spec.req_id, need, self.sink.pool.nbytes >> 20)
            self._fail_unstarted(spec)
            return
        if self._recv_waiting or not self._begin_pull(spec, hooks):  # FIFO behind requests already waiting
            self._recv_waiting[spec.req_id] = (spec, hooks, time.monotonic() + self.config.timeout_s)
            logger.info("LynxConnector: D's staging full, request %s waits for room (%d waiting)", spec.req_id,
                        len(self._recv_waiting))

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
            logger.error("LynxConnector: request %s found no room in D's staging pool (staging_mb=%d) within "
                         "%.1fs", req_id, self.sink.pool.nbytes >> 20, self.config.timeout_s)
            self._fail_unstarted(spec)

    def _discard(self, spec: RecvSpec) -> None:
        """P's staging of a load that will never be pulled is freed now (a Done), not at its lease."""
        with contextlib.suppress(ValueError):  # params D could not have pulled with either: nothing to free
            self.sink.discard(spec.remote_host, spec.port_for_rank(self.tp_rank), spec.transfer_id, spec.token)

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
        rec = _Recv(spec=spec, staged=staged, t_start=time.perf_counter())
        self._recvs[spec.req_id] = rec
        self._faults.track(spec.req_id, hooks)
        try:
            port = spec.port_for_rank(self.tp_rank)
            self.sink.pull(spec.req_id, spec.remote_host, port, spec.transfer_id, spec.token,
                           staged.anchor, staged.residual if r else None)
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
        try:
            plane.verify_all(buf, staging_id(spec.transfer_id, generation), names)
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

    def poll(self) -> None:
        """Apply landed streams to the KV cache; called once per step (also on steps with no forward)."""
        self._step += 1
        self._exporter.maybe_export(self.stats, {"p": self.source, "d": self.sink})  # gauges, side-channel events
        if self.source is not None:
            self.source.poll()
            if self.saves is not None and self.saves.waiting:
                self.saves.retry()  # room freed by D's done; or the wait is over and D is told why
        if self.sink is None:
            return
        for req_id in self._faults.due_merges(self._step):  # test hook delay_residual_steps
            rec = self._recvs.get(req_id)
            if rec is not None:
                self._apply(rec, full=True)
        for ev in self.sink.poll():
            rec = self._recvs.get(ev.req_id)
            if rec is None:
                continue
            if not ev.ok:
                self._finish_recv(rec, error=f"{ev.stream} stream failed: {ev.error}")
                continue
            now = time.perf_counter() - rec.t_start
            mode = get_mode(rec.spec.mode)
            if ev.stream == "anchor":
                rec.anchor_landed = True
                self.stats.record_stream("anchor", ev.nbytes, now)
                bad = self._verify(rec, "anchor", ev.generation)
                if bad is not None:
                    self._finish_recv(rec, error=bad)
                    continue
                if mode.decodes_on_anchor:
                    self._apply(rec, full=False)
            else:
                rec.residual_landed = True
                self.stats.record_stream("residual", ev.nbytes, now)
                fault = self._faults.residual_error(ev.req_id) or self._verify(rec, "residual", ev.generation)
                if fault is not None:
                    self._finish_recv(rec, error=fault)
                    continue
            if rec.anchor_landed and rec.residual_landed and mode.pulls_residual:
                if mode.late_residual and self._faults.defer_merge(ev.req_id, rec.anchor_step, self._step):
                    continue  # test hook: merged in a later step (due_merges)
                self._apply(rec, full=True)
        if self._recv_waiting:  # staging freed by the pulls that finished above
            self._retry_waiting_recvs()

    def _apply(self, rec: _Recv, full: bool) -> None:
        try:
            self._write_blocks(rec, full)
        except Exception as exc:  # malformed planes must fail this request, not the engine
            logger.exception("LynxConnector: writing request %s into the KV cache failed", rec.spec.req_id)
            self._finish_recv(rec, error=f"decode failed: {exc}")
            return
        mode = get_mode(rec.spec.mode)
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
        is finished: report it so vLLM frees its blocks now) or "cancelled" (preempted: no report at all)."""
        assert self.sink is not None
        req_id = rec.spec.req_id
        self._recvs.pop(req_id, None)
        self._faults.forget(req_id)
        if error is not None:
            if outcome == "failed":
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
        else:
            self.stats.record_request(time.perf_counter() - rec.t_start)
        if not rec.reported:
            rec.reported = True
            self._finished_recving.add(req_id)
        self.sink.release(req_id)
        self.sink.pool.free_request(req_id)

    def take_results(self) -> tuple[set[str], set[str]]:
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return done, failed

    def take_worker_meta(self) -> LynxWorkerMeta | None:
        if not self._merged and not self._residual_failed:
            return None
        merged, failed = self._merged, self._residual_failed
        self._merged, self._residual_failed = set(), set()
        return LynxWorkerMeta(residual_merged=merged, residual_failed=failed)

    def shutdown(self) -> None:
        for rec in list(self._recvs.values()):
            self._finish_recv(rec, error="worker shutting down")
        for end in (self.sink, self.source):
            if end is not None:
                end.close()
        self.sink = self.source = None
