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
from typing import TYPE_CHECKING, Any

import torch

from lynx_connector.auto import LinkMeter
from lynx_connector.codec import (
    KVLayout,
    KVRangeError,
    NonFiniteKVError,
    StagedLayout,
    encode,
    get_codec,
    staged_layout,
    staging_id,
)
from lynx_connector.compat import dtype_name, kv_compat
from lynx_connector.config import LynxConfig
from lynx_connector.logger import init_logger
from lynx_connector.metadata import (
    LynxConnectorMetadata,
    LynxHandshakeMetadata,
    LynxWorkerMeta,
    SaveSpec,
)
from lynx_connector.modes import LYNX_CODEC, get_mode
from lynx_connector.receiving import ReceiveHalf
from lynx_connector.saving import SaveQueue
from lynx_connector.stats import LynxStats, TransportExporter
from lynx_connector.testing import fault_hooks
from lynx_connector.transport import (
    TransferSink,
    TransferSource,
    load_side_channel_key,
)

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
        self.layers: list[tuple[str, torch.Tensor]] = []
        self.layout: KVLayout | None = None
        self.source: TransferSource | None = None
        self.saves: SaveQueue | None = None
        self.sink: TransferSink | None = None
        self.stats = LynxStats()
        self._exporter = TransportExporter()
        # P, for auto (lynx_connector/auto.py): the link measured from D's completed reads, Lynx encode s/token
        self._link_meter = LinkMeter(config.auto_window_s)
        self._lynx_encode_s_per_token = 0.0
        self._link_sent_at = 0.0
        self._init_receive()  # D's pulls (receiving.py)
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
            self._faults.track(spec.req_id, meta.test_hooks.get(spec.req_id))
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
            self._faults.out_of_range_kv(spec.req_id, self.layers[0][1], self.layout, spec.block_ids, spec.num_tokens)
            for i, (name, kv) in enumerate(self.layers):
                encode(codec, kv, spec.block_ids, self.layout, spec.num_tokens,
                       sl.anchor.plane(staged.anchor, i), sl.residual.plane(staged.residual, i) if r else None,
                       layer_name=name)
                sl.anchor.seal(staged.anchor, i, sid)  # checksums right after the layer is encoded
                if r:
                    sl.residual.seal(staged.residual, i, sid)
        except (NonFiniteKVError, KVRangeError) as exc:  # the data, not P: only this request fails, D hears why
            bad = "nonfinite" if isinstance(exc, NonFiniteKVError) else "range"
            what = "is not finite" if bad == "nonfinite" else "is beyond the codec's range (|x| <= 65504)"
            logger.error("LynxConnector: request %s not sent: %s", spec.req_id, exc)
            self.source.reject(spec.req_id, f"{bad}_kv", f"P's KV of the request {what}: {exc}")
            self.stats.record_failure(bad)
            return
        except Exception as exc:  # a bug or bad input must fail this request, not P's engine
            logger.exception("LynxConnector: encoding request %s failed", spec.req_id)
            self.source.reject(spec.req_id, "encode_failed", f"P could not encode the request: {exc}")
            self.stats.record_failure("encode")
            return
        self.source.publish(spec.req_id)
        seconds = time.perf_counter() - t0
        self.stats.record_encode(a, r, seconds)
        if codec.name == LYNX_CODEC and spec.num_tokens:  # auto's estimate of the Lynx codec's cost
            per, last = seconds / spec.num_tokens, self._lynx_encode_s_per_token
            self._lynx_encode_s_per_token = per if not last else last + 0.3 * (per - last)

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
                       self._lynx_encode_s_per_token)
        return meta

    def shutdown(self) -> None:
        for rec in list(self._recvs.values()):
            self._finish_recv(rec, error="worker shutting down")
        for end in (self.sink, self.source):
            if end is not None:
                end.close()
        self.sink = self.source = None
