"""LynxConnector: the thin facade vLLM instantiates (twice per engine: once per role).

It builds exactly one half from the role: ``LynxConnectorScheduler`` in the engine-core process,
``LynxConnectorWorker`` in each worker process, and delegates. The halves share only the serializable
messages in ``metadata.py``. Enable it with ``--kv-transfer-config lynx`` (the plugin's preset) or
``{"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_connector.connector", "kv_role": "kv_both"}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lynx_connector.config import LynxConfig
from lynx_connector.logger import init_logger
from lynx_connector.metadata import LynxConnectorMetadata
from lynx_connector.scheduler import LynxConnectorScheduler
from lynx_connector.stats import LynxPromMetrics, LynxStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lynx_connector.worker import LynxConnectorWorker

logger = init_logger(__name__)


class LynxConnector(KVConnectorBase_V1):
    #: D's pulled prompt tokens count under ``source="p2p"`` in vLLM's vllm:prompt_tokens_cached_by_source (as
    #: NixlConnector's do), not "external_unspecified"
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:  # vLLM turns its hybrid KV cache manager off for us unless the user forces it on
            raise ValueError(f"LynxConnector: the KV cache has {len(groups)} groups (vLLM's hybrid KV cache manager, "
                             "forced on with --no-disable-hybrid-kv-cache-manager): Lynx moves one group's blocks; "
                             "drop that flag")
        kv_cfg = vllm_config.kv_transfer_config
        self.lynx_config = LynxConfig.from_extra_config(kv_cfg.kv_connector_extra_config)
        self.engine_id = str(kv_cfg.engine_id)
        self.connector_scheduler: LynxConnectorScheduler | None = None
        self.connector_worker: LynxConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            logger.info("LynxConnector (engine %s, role %s): %s", self.engine_id, kv_cfg.kv_role,
                        self.lynx_config.describe())
            self.connector_scheduler = LynxConnectorScheduler(vllm_config, self.engine_id, self.lynx_config)
        else:
            from lynx_connector.vllm_fixes import install_guards
            from lynx_connector.worker import LynxConnectorWorker

            install_guards()  # also where VLLM_PLUGINS kept the plugin out of this (spawned) process
            self.connector_worker = LynxConnectorWorker(vllm_config, self.engine_id, self.lynx_config)

    def _sched(self) -> LynxConnectorScheduler:
        assert self.connector_scheduler is not None, "scheduler-side method called on a worker connector"
        return self.connector_scheduler

    def _worker(self) -> LynxConnectorWorker:
        assert self.connector_worker is not None, "worker-side method called on a scheduler connector"
        return self.connector_worker

    # ==== scheduler side ====
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched().set_handshake(metadata)

    # ==== worker side ====
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # P: first tokens go to the side channel before this step's forward (which may be a long prefill)
        if isinstance(connector_metadata, LynxConnectorMetadata) and connector_metadata.first_tokens:
            self._worker().announce_first_tokens(connector_metadata.first_tokens)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker().handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LynxConnectorMetadata)
        self._worker().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous between steps, never inside a forward

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # P, layer-wise publish: encode this layer of the requests whose prompt completes in this step
        meta = self._get_connector_metadata()
        assert isinstance(meta, LynxConnectorMetadata)
        if meta.reqs_to_save:
            self._worker().save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LynxConnectorMetadata)
        self._worker().save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        worker = self._worker()
        meta = self._get_connector_metadata()
        if isinstance(meta, LynxConnectorMetadata):
            worker.wait_idle(meta)  # D, an empty step with pulls in flight: until one lands, bounded
        worker.poll()
        done, failed = worker.take_results()
        return KVConnectorTransferResults(finished_sending=worker.finished_sending(finished_req_ids),
                                          finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().take_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both halves: the workers' transfer counters, the scheduler half's refused params
        half = self.connector_worker or self.connector_scheduler
        if half is None:
            return None
        stats = half.stats
        return None if stats.is_empty() else stats.clone_and_reset()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ==== class-level hooks ====
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LynxStats(data=data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues) -> KVConnectorPromMetrics | None:
        return LynxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
