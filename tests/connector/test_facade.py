"""The connector facade (lynx_connector/connector.py) forwards each vLLM scheduler hook the scheduler half
implements: a hook the half defines but the facade does not override falls through to vLLM's no-op base method
and the half's code never runs (vLLM calls the facade only)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from lynx_connector.connector import LynxConnector
from lynx_connector.scheduler import LynxConnectorScheduler


def _half_hooks() -> set[str]:
    hooks = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_") and callable(getattr(KVConnectorBase_V1, n))}
    ours = [c for c in LynxConnectorScheduler.__mro__ if c.__module__.startswith("lynx_connector")]
    return {n for n in hooks if any(n in vars(c) for c in ours)}


def test_every_hook_of_the_scheduler_half_is_overridden_by_the_facade() -> None:
    hooks = _half_hooks()
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "on_new_request", "request_finished"} <= hooks
    assert sorted(n for n in hooks if n not in vars(LynxConnector)) == []


def test_on_new_request_reaches_the_scheduler_half() -> None:
    """P checks the proxy ticket's expiry against the arrival time the half records here."""
    seen: list[object] = []
    facade = LynxConnector.__new__(LynxConnector)
    facade._sched = lambda: SimpleNamespace(on_new_request=seen.append)  # type: ignore[method-assign]
    request = SimpleNamespace(request_id="r1")
    facade.on_new_request(request)
    assert seen == [request]


def test_pulled_tokens_count_as_p2p_cache_hits() -> None:
    """vLLM's vllm:prompt_tokens_cached_by_source labels a connector's tokens by its _cache_hit_source (the
    base class's default is external_unspecified; NixlConnector's is p2p, as Lynx's now)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    facade = LynxConnector.__new__(LynxConnector)
    assert facade.get_external_cache_hit_sources(SimpleNamespace(request_id="r1"), 96) == {CacheHitSource.P2P: 96}
    assert facade.get_external_cache_hit_sources(SimpleNamespace(request_id="r1"), 0) == {}
