"""Functions run inside an ``EngineProcess`` child (single process: the scheduler, the connector's scheduler
half and its worker half are reachable from ``llm``) for tests/integration/test_signed_params.py."""

from __future__ import annotations

from typing import Any


def state(llm: Any) -> dict[str, Any]:
    """What must be back to idle when no request runs: the scheduler's requests and KV blocks in use, the
    scheduler half's per-request bookkeeping, the worker's pulls, D's peers and both staging pools. Steps the
    engine once first when it still holds requests (a finished request's blocks are released in a later step,
    once its connector work is done; the offline engine does not step by itself between generate calls)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    if sched.has_requests():
        llm.llm_engine.step()
    half = sched.connector.connector_scheduler
    wconn = get_kv_transfer_group().connector_worker
    sink = wconn.sink.stats() if wconn.sink is not None else {}
    source = wconn.source.stats() if wconn.source is not None else {}
    return {
        "requests": sorted(sched.requests),
        "blocks_in_use": sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
        - sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "half": {"verified": len(half._verified), "refused": len(half._refused),
                 "recv_inflight": len(half._recv_inflight), "recv_pending": len(half._recv_pending),
                 "save_tracked": len(half._save_tracked)},
        "worker_recvs": len(wconn._recvs),
        "peers": sink.get("peers", 0),
        "pulls_live": sink.get("pulls_live", 0),
        "staging_regions_live": sink.get("regions_live", 0) + source.get("regions_live", 0),
        "source_requests_live": source.get("requests_live", 0),
    }
