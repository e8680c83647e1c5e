"""Worker half of LynxConnector (runs in each worker process, next to the paged KV cache).

P: after the forward of the step in which a request's prompt completes, encode every layer of it into one
contiguous anchor region and one contiguous residual region of staging (registered with NIXL once) and
publish them; D pulls them. P's staging is freed when D says it is done, on abort, or when the lease ends.

D: pull the planes and write them into the request's blocks (``receiving.py``, the `ReceiveHalf` mixin).
Integrity (issue 14.4): each layer's plane in staging is followed by its checksum (``codec/integrity.py`` owns
that layout), seeded with P's transfer id and the staging's generation; P seals every layer right after
encoding it, D verifies each before decoding it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from lynx_connector.auto import LinkMeter
from lynx_connector.codec import (
    STAGED_DTYPES,
    KVLayout,
    KVRangeError,
    NonFiniteKVError,
    StagedLayout,
    encode,
    get_codec,
    kernel_path,
    staged_layout,
    staging_id,
)
from lynx_connector.compat import dtype_name, kv_compat, model_identity
from lynx_connector.config import LynxConfig
from lynx_connector.layerwise import StagingJob
from lynx_connector.logger import init_logger
from lynx_connector.memory import check_staging_memory
from lynx_connector.metadata import (
    LynxConnectorMetadata,
    LynxHandshakeMetadata,
    LynxWorkerMeta,
    SaveSpec,
)
from lynx_connector.modes import LYNX_CODEC, get_mode, is_mode
from lynx_connector.receiving import ReceiveHalf
from lynx_connector.saving import SaveQueue
from lynx_connector.stats import LynxStats, TransportExporter
from lynx_connector.testing import fault_hooks
from lynx_connector.trace import trace
from lynx_connector.transport import (
    StagingAbandoned,
    StagingFullError,
    TransferSink,
    TransferSource,
    load_extra_keys,
    load_side_channel_key,
)
from lynx_connector.transport.pool import ALIGN as STAGING_ALIGN
from lynx_connector.transport.protocol import VERSION as PROTOCOL_VERSION

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


class LynxConnectorWorker(ReceiveHalf):
    def __init__(self, vllm_config: VllmConfig, engine_id: str, config: LynxConfig):
        self.config = config
        self.engine_id = engine_id
        self.vllm_config = vllm_config
        self._codecs: dict[str, Any] = {}
        for mode in config.concrete_modes:  # validate the configured codecs at start-up, not on the first request
            self._codec(mode)
        kv_cfg = vllm_config.kv_transfer_config
        self.is_producer = kv_cfg.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_cfg.kv_role in ("kv_consumer", "kv_both")
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank = 0
        self.tp_size = 1
        self.layers: list[tuple[str, torch.Tensor]] = []
        self.layout: KVLayout | None = None
        self.source: TransferSource | None = None
        self.saves: SaveQueue | None = None
        self.sink: TransferSink | None = None
        self.stats = LynxStats()
        self._exporter = TransportExporter()
        # P, for auto (lynx_connector/auto.py): the link measured from D's completed reads, Lynx encode s/token
        self._link_meter = LinkMeter(config.auto_window_s)
        # seconds per token of recent Lynx layer encodes (times the layers): their minimum is the codec's cost,
        # without a first call's compilation or a moment of CPU contention
        self._lynx_encode_s: deque[float] = deque(maxlen=64)
        self._longest_prompt: dict[str, int] = {}  # P: per mode, the longest prompt its pool holds (start-up)
        self._link_sent_at = 0.0
        self._init_receive()  # D's pulls (receiving.py)
        self._step = 0  # poll() calls, one per engine step
        self._faults = fault_hooks(config)  # test-only (lynx_connector.testing)
        # P, layer-wise publish: requests being encoded in this step's forward, and those rejected meanwhile
        self._layerwise: dict[str, StagingJob] = {}
        self._layerwise_failed: set[str] = set()
        self._layerwise_meta: LynxConnectorMetadata | None = None
        self._layer_index: dict[str, int] = {}
        # The side channel's deployment key, read once at start-up (a missing or bad key fails start-up here)
        self._key = load_side_channel_key(insecure=config.insecure_side_channel)
        self._extra_keys = load_extra_keys(insecure=config.insecure_side_channel)  # D accepts them from P

    # ---- start-up -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank as rank
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size as world

        try:
            self.tp_rank, self.tp_size = rank(), world()
        except Exception:  # not initialised in some unit-test set-ups
            self.tp_rank, self.tp_size = 0, 1
        self._exporter.rank = self.tp_rank
        self.layers = list(kv_caches.items())
        self._layer_index = {name: i for i, (name, _) in enumerate(self.layers)}
        if not self.layers:
            raise ValueError("LynxConnector: register_kv_caches got no KV cache tensors")
        first = self.layers[0][1]
        model_cfg = self.vllm_config.model_config
        if first.dtype not in STAGED_DTYPES:  # an fp8 cache (uint8 on the CPU backend): its bytes are no values
            cache_dtype = getattr(getattr(self.vllm_config, "cache_config", None), "cache_dtype", "?")
            raise ValueError(f"LynxConnector: a KV cache of {first.dtype} (--kv-cache-dtype {cache_dtype}) is not "
                             f"supported: the codecs read and write {', '.join(map(str, STAGED_DTYPES))} caches; "
                             "use --kv-cache-dtype auto (the model's dtype)")
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
                           codec_options=self.config.codec_options, tp_rank=self.tp_rank, tp_size=self.tp_size,
                           identity=model_identity(model_cfg))
        name = f"lynx-{self.engine_id}-tp{self.tp_rank}"
        check_staging_memory(self.config.staging_mb, self.is_producer + self.is_consumer,
                             self.vllm_config.kv_transfer_config.kv_role)
        if self.is_producer:
            self.source = TransferSource(self.config.transport_config(self.tp_rank, self._key, name + "-src"), compat,
                                         name=name + "-src", status_extra=self._status_counters)
            # P gives up on a request that found no room before D's own deadline would
            self.saves = SaveQueue(self.source, self._encode_request, wait_s=self.config.timeout_s / 2,
                                   on_reject=self.stats.record_failure)
        if self.is_consumer:
            dst = self.config.transport_config(self.tp_rank, self._key, name + "-dst", self._extra_keys)
            self.sink = TransferSink(dst, compat, name=name + "-dst", status_extra=self._status_counters)
        self._warm_up()
        self._check_staging_reach()
        logger.info("LynxConnector worker ready: %d layers, layout %s, mode %s, role %s, side channel %s "
                    "(protocol v%d)", len(self.layers), self.layout, self.config.mode,
                    self.vllm_config.kv_transfer_config.kv_role,
                    self.source.address if self.source else None, PROTOCOL_VERSION)

    def _warm_up(self) -> None:
        """Compile (or load from numba's / Triton's disk cache) the kernels of every codec this instance may use,
        before the engine serves: else the first request pays it inside P's forward or D's pull
        (codec/warmup.py). A failure is logged, never fatal: the request would meet it again and fail alone."""
        from lynx_connector.codec.warmup import warm_up

        assert self.layout is not None
        paths: dict[str, str] = {}  # the modes table's codec name -> the kernels it runs on this cache
        for mode in self.config.allowed_modes:
            if not is_mode(mode) or get_mode(mode).codec in paths:  # auto is no codec
                continue
            codec = self._codec(mode)
            paths[get_mode(mode).codec] = kernel_path(codec, self.layers[0][1], self.layout)
            try:
                seconds = warm_up(codec, self.layout, self.layers[0][1])
            except Exception as exc:
                logger.warning("LynxConnector: warming up codec %s failed: %s", codec.name, exc)
                continue
            logger.debug("LynxConnector: codec %s warmed up in %.2fs", codec.name, seconds)
        logger.info("LynxConnector: codec kernels on this cache: %s",
                    ", ".join(f"{name} {path}" for name, path in paths.items()))

    def _check_staging_reach(self) -> None:
        """Start-up: warn when the staging pool cannot hold one request of ``max_model_len`` tokens in a mode this
        instance allows, with the longest prompt each mode can carry and the staging_mb that holds them all (D's
        passthrough is sized as this cache's dtype: P's may differ). P's longest prompt per mode also goes to its
        scheduler half (handshake metadata), which refuses a longer one before it is staged."""
        max_len = getattr(self.vllm_config.model_config, "max_model_len", None)
        if not isinstance(max_len, int) or max_len < 1:
            return
        endpoint = self.source if self.source is not None else self.sink
        if endpoint is None:
            return
        short: dict[str, int] = {}
        need = 0

        def layout(mode: str, n: int) -> StagedLayout:  # a D-only instance stages no residual it never pulls
            sl = self._plane_nbytes(mode, n)
            return sl.without_residual() if self.source is None and not get_mode(mode).pulls_residual else sl

        def fits(mode: str, n: int) -> bool:  # as the pool places a request (its anchor region aligned)
            return endpoint.pool.fits(*layout(mode, n).nbytes)

        for mode in self.config.allowed_modes:
            if not is_mode(mode):  # auto picks among the others
                continue
            need = max(need, sum(layout(mode, max_len).nbytes))
            if not fits(mode, max_len):
                lo, hi = 0, max_len  # the longest prompt that fits: sizes grow with the token count
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if fits(mode, mid) else (lo, mid - 1)
                short[mode] = lo
            if endpoint is self.source:  # told to P's scheduler half, which refuses longer prompts before staging
                self._longest_prompt[mode] = short.get(mode, max_len)
        if short:
            logger.warning("LynxConnector: staging_mb=%d holds one request of at most %s tokens, but "
                           "max_model_len is %d: a longer prompt in those modes %s. staging_mb=%d holds "
                           "max_model_len in every allowed mode", self.config.staging_mb,
                           ", ".join(f"{n} ({m})" for m, n in short.items()), max_len,
                           "is refused by P (a 400 lynx_error, after its prefill)" if self.source is not None else
                           "fails on D (its KV cannot be staged)", -(-(need + STAGING_ALIGN) // (1 << 20)))  # + the anchor region's alignment

    def _status_counters(self) -> dict[str, Any]:
        """The worker's queues for the status file (read from a transport thread: sizes only)."""
        return {"save_waiting": self.saves.waiting if self.saves is not None else 0,
                "recv_waiting": len(self._recv_waiting), "recvs_live": len(self._recvs)}

    def handshake_metadata(self) -> LynxHandshakeMetadata | None:
        if self.source is None:
            return None
        host, port = self.source.address
        return LynxHandshakeMetadata(host=host, port=port, tp_rank=self.tp_rank,
                                     kv_dtype=dtype_name(self.layout.dtype) if self.layout else "",
                                     longest_prompt=dict(self._longest_prompt))

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
        if meta is not self._layerwise_meta:  # no layer was saved in this step's forward (or layerwise is off)
            self._drop_saves(meta)
        self.saves.retry()  # room freed since the last step goes to the requests already waiting, in order
        for spec in meta.reqs_to_save:
            if spec.req_id in self._layerwise or spec.req_id in self._layerwise_failed:
                # staged in this step's forward (D may even have read it all and freed it already)
                self._encode_request(spec)
                self.saves.resolved(spec.req_id)
                continue
            self._faults.track(spec.req_id, meta.test_hooks.get(spec.req_id))
            self.saves.submit(spec)
        for req_id in list(self._layerwise):  # begun in the forward but not staged by the queue (D gave up on it)
            del self._layerwise[req_id]
            self.source.abort(req_id)
        self._layerwise_failed.clear()

    def _encode_request(self, spec: SaveSpec) -> None:
        """Stage, encode and publish one request (the save queue's ``stage``): the layers ``save_kv_layer``
        encoded already are kept. `StagingFullError` when the pool has no room (the save queue then waits for
        room); any other failure rejects the request, so D hears why at once."""
        job = self._layerwise.pop(spec.req_id, None)
        if job is None:
            if spec.req_id in self._layerwise_failed:
                self._layerwise_failed.discard(spec.req_id)
                return  # rejected while its layers were being encoded: D has been told
            job = self._begin(spec)
            if job is None:
                return
        try:
            for i in range(len(self.layers)):
                if i not in job.encoded:
                    self._encode_layer(job, i)
        except Exception as exc:
            self._encode_failed(job, exc)
            return
        if not job.published:
            self.source.publish(spec.req_id)  # False: D freed it meanwhile (aborted): its staging is freed now
            trace("P", spec.transfer_id or spec.req_id, "published", encode_s=round(job.encode_s, 6))
        a, r = job.layout.nbytes
        self.stats.record_encode(a, r, job.encode_s)

    def _begin(self, spec: SaveSpec) -> StagingJob | None:
        """Allocate a request's staging (`StagingFullError` when the pool has no room); None when it was
        rejected (it can never fit, or a test hook made its KV bad) or D gave up on it meanwhile."""
        assert self.source is not None and self.layout is not None
        sl = self._plane_nbytes(spec.mode, spec.num_tokens)
        a, r = sl.nbytes
        if not self.source.pool.fits(a, r):  # can never fit: no point in waiting for room
            msg = (f"the request needs {a + r} bytes of staging, more than P's whole pool "
                   f"(staging_mb={self.source.pool.nbytes >> 20})")
            logger.error("LynxConnector: request %s not sent: %s", spec.req_id, msg)
            self.source.reject(spec.req_id, "too_large", msg)
            self.stats.record_failure("too_large")
            return None
        try:
            staged = self.source.alloc(spec.req_id, a, r, transfer_id=spec.transfer_id or None,
                                       token=spec.token or None, mode=spec.mode, auto_reason=spec.auto_reason)
        except StagingAbandoned:
            logger.info("LynxConnector: request %s not staged: its decode instance gave up on it", spec.req_id)
            return None
        sid = staging_id(self.source.ticket(spec.req_id)[0], staged.generation)  # seeds the checksums
        self._faults.out_of_range_kv(spec.req_id, self.layers[0][1], self.layout, spec.block_ids, spec.num_tokens)
        return StagingJob(spec.req_id, spec, self._codec(spec.mode), sl, staged, sid)

    def _encode_layer(self, job: StagingJob, i: int) -> None:
        name, kv = self.layers[i]
        assert self.layout is not None
        t0 = time.perf_counter()
        encode(job.codec, kv, job.spec.block_ids, self.layout, job.spec.num_tokens, job.anchor_plane(i),
               job.residual_plane(i), layer_name=name)
        t_seal = time.perf_counter()
        job.seal(i)  # checksums right after the layer is encoded
        t_end = time.perf_counter()
        self.stats.record_security("p", "checksum", t_end - t_seal)
        job.encode_s += t_end - t0
        if job.codec.name == LYNX_CODEC and job.spec.num_tokens:  # auto's estimate of the Lynx codec's cost
            self._lynx_encode_s.append((t_end - t0) * len(self.layers) / job.spec.num_tokens)

    def _encode_failed(self, job: StagingJob, exc: Exception) -> None:
        """Reject a request whose encode failed: bad data (non-finite or out-of-range KV) fails only this
        request, and D hears why; any other error is logged with its traceback (a bug), never fails P."""
        assert self.source is not None
        if isinstance(exc, (NonFiniteKVError, KVRangeError)):
            bad = "nonfinite" if isinstance(exc, NonFiniteKVError) else "range"
            what = "is not finite" if bad == "nonfinite" else "is beyond the codec's range (|x| <= 65504)"
            logger.error("LynxConnector: request %s not sent: %s", job.req_id, exc)
            self.source.reject(job.req_id, f"{bad}_kv", f"P's KV of the request {what}: {exc}")
            self.stats.record_failure(bad)
            return
        logger.error("LynxConnector: encoding request %s failed", job.req_id, exc_info=exc)
        self.source.reject(job.req_id, "encode_failed", f"P could not encode the request: {exc}")
        self.stats.record_failure("encode")

    # ---- P: encode inside the forward, layer by layer (config.layerwise) ---------------------------------
    def save_layer(self, layer_name: str, meta: LynxConnectorMetadata) -> None:
        """After attention layer ``layer_name`` wrote its KV in this step's forward: encode that layer of every
        request whose prompt completes in this step and publish it (D reads it while P computes the rest)."""
        if self.source is None or self.saves is None or not self.config.layerwise:
            return
        if meta is not self._layerwise_meta:  # the first layer of a new step
            self._layerwise_meta = meta
            self._begin_layerwise(meta)
        i = self._layer_index.get(layer_name)
        if i is None or not self._layerwise:
            return
        for job in list(self._layerwise.values()):
            if i in job.encoded or job.spec is None:
                continue
            try:
                self._encode_layer(job, i)
            except Exception as exc:
                del self._layerwise[job.req_id]
                self._layerwise_failed.add(job.req_id)
                self._encode_failed(job, exc)
                continue
            if len(job.encoded) == 1:
                trace("P", job.spec.transfer_id or job.req_id, "first_layer_encoded")
            if len(job.encoded) == len(self.layers):  # the last layer: whole (D may finish before wait_for_save)
                job.published = True
                self.source.publish(job.req_id)
                trace("P", job.spec.transfer_id or job.req_id, "published", encode_s=round(job.encode_s, 6))
                continue
            a, r = job.ready_bytes()
            if a and not self.source.publish_partial(job.req_id, a, r):  # D gave up on it: stop encoding it
                del self._layerwise[job.req_id]
                self._layerwise_failed.add(job.req_id)
                self.source.abort(job.req_id)

    def _drop_saves(self, meta: LynxConnectorMetadata) -> None:
        """Aborted requests' staging goes; a preempted request still waiting for staging room is given up (its
        blocks were freed in this step: staging them later could copy another request's KV), D told why."""
        assert self.saves is not None
        for req_id in meta.save_aborted:
            self.saves.abort(req_id)
        for req_id in meta.save_preempted:
            self.saves.reject_waiting(req_id, "preempted", f"request {req_id} was preempted on the prefill instance "
                                      "while it waited for staging room: its KV blocks were freed, it is not sent")

    def _begin_layerwise(self, meta: LynxConnectorMetadata) -> None:
        """Stage this step's requests before its first layer is saved, while nothing waits for staging room
        (a request that waits keeps its place in the queue: it is staged after the forward)."""
        assert self.saves is not None
        self._drop_saves(meta)
        for spec in meta.reqs_to_save:
            if self.saves.waiting or spec.req_id in self._layerwise:
                break
            self._faults.track(spec.req_id, meta.test_hooks.get(spec.req_id))
            try:
                job = self._begin(spec)
            except StagingFullError:
                break  # the save queue waits for room after the forward
            except Exception as exc:
                logger.error("LynxConnector: staging request %s failed", spec.req_id, exc_info=exc)
                self.source.reject(spec.req_id, "encode_failed", f"P could not stage the request: {exc}")
                self.stats.record_failure("encode")
                self._layerwise_failed.add(spec.req_id)
                continue
            if job is None:
                self._layerwise_failed.add(spec.req_id)
            else:
                self._layerwise[spec.req_id] = job

    def announce_first_tokens(self, first_tokens: dict[str, int]) -> None:
        """P: the token sampled after each finished request's prompt (by transfer id), named in every later Regions
        answer of its transfer (a speculative D of the concurrent flow releases its first token on it). A transfer
        D has freed already is skipped; a value that is not a token id is a bug, logged, never fatal."""
        if self.source is None:
            return
        for tid, tok in first_tokens.items():
            trace("P", tid, "first_token_announced")
            try:
                self.source.set_first_token(tid, tok)
            except ValueError as exc:
                logger.error("LynxConnector: first token of transfer %s not announced: %s", tid[:8], exc)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """P: requests whose KV blocks may be freed (staged or given up, and finished in vLLM); after poll()."""
        if self.saves is None:
            return set()
        return self.saves.finished_sending(finished_req_ids)

    def poll(self) -> None:
        """Apply landed streams to the KV cache; called once per step (also on steps with no forward)."""
        self._step += 1
        self._exporter.maybe_export(self.stats, {"p": self.source, "d": self.sink})  # gauges, side-channel events
        if self.source is not None:
            self.source.poll()
            self._link_meter.add(self.source.take_pulled())
            if self.saves is not None and self.saves.waiting:
                self.saves.retry()  # room freed by D's done; or the wait is over and D is told why
        self._poll_recvs()

    def take_worker_meta(self) -> LynxWorkerMeta | None:
        """D's merge signals (ReceiveHalf) and, on P about every 0.1 s, the link as auto sees it (p_link)."""
        meta = super().take_worker_meta()
        now = time.monotonic()
        if self.source is None or now - self._link_sent_at < 0.1:
            return meta
        self._link_sent_at = now
        meta = meta if meta is not None else LynxWorkerMeta()
        meta.p_link = (self._link_meter.rate() or 0.0, self.source.pool.bytes_allocated,
                       min(self._lynx_encode_s, default=0.0))
        return meta

    def shutdown(self) -> None:
        """D: loads waiting for staging tell their P to free (a Done each), and the sink's close drops every pull
        in flight telling its P the same, in one bounded wait (not one abort round trip per pull); P: its source
        closes, telling each D it is shutting down (D's pulls from it fail at once). Whatever fails, both ends are closed."""
        try:
            if self.sink is not None:
                for spec, _hooks, _deadline in list(self._recv_waiting.values()):
                    if spec.req_id not in self._recvs:  # a watched one is the sink's pull: its close tells P
                        self._discard(spec)
        finally:
            for end in (self.sink, self.source):
                if end is not None:
                    try:
                        end.close()
                    except Exception:  # the other end must still close
                        logger.exception("LynxConnector: closing %s failed", type(end).__name__)
            self.sink = self.source = None
            self._recvs.clear()
            self._recv_waiting.clear()
