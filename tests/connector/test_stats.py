"""The transport's state in the connector's stats: staging gauges, side-channel events and failure reasons, from
the real transport endpoints (fake NIXL) through `LynxStats` to the Prometheus series vLLM exports."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lynx_connector.signing import REFUSAL_REASONS
from lynx_connector.stats import FAILURE_REASONS, LynxPromMetrics, LynxStats, TransportExporter
from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.source import TransferSource
from tests.transport.fakes import TEST_KEY, FakeFabric, FakeNixlWrapper


def _prom(registry: CollectorRegistry) -> LynxPromMetrics:
    def bind(cls):
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a, multiprocess_mode: str = "", **kw):
                super().__init__(*a, registry=registry, **kw)
        return Bound

    return LynxPromMetrics(SimpleNamespace(kv_transfer_config=None), {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)},
                           ["model_name", "engine"], {0: ["m", "0"]})


def test_exporter_sends_staging_gauges_and_event_increments_once() -> None:
    src = TransferSource(TransportConfig(pool_bytes=1 << 16, lease_s=0.2, grace_s=30.0, key=TEST_KEY),
                         {"model": "m"}, nixl=FakeNixlWrapper(FakeFabric(), "P"))
    try:
        exp, stats = TransportExporter(rank=1, interval_s=0.0), LynxStats()
        src.alloc("r1", 1000, 1000)
        src.counters["malformed"] += 2
        src.counters["auth_failed"] += 1
        exp.maybe_export(stats, {"p": src, "d": None})
        assert sorted(stats.data["events"]) == [["p", "auth_failed", 1], ["p", "malformed", 2]]
        assert ["p", 1, "capacity", 1 << 16] in stats.data["gauges"] and ["p", 1, "used", 2048] in stats.data["gauges"]
        out = stats.clone_and_reset()
        exp.maybe_export(stats, {"p": src, "d": None})
        assert stats.is_empty()  # nothing changed: nothing sent again
        src.publish("r1")  # the lease (0.2 s) runs out: freed, and its regions quarantined
        src.counters["malformed"] += 1
        end = time.monotonic() + 5
        while src.stats()["freed_lease"] == 0 and time.monotonic() < end:
            time.sleep(0.01)
        exp.maybe_export(stats, {"p": src, "d": None})
        assert ["p", "freed_lease", 1] in stats.data["events"] and ["p", "malformed", 1] in stats.data["events"]
        assert ["p", 1, "quarantined", 2048] in stats.data["gauges"]
        assert "Side channel P malformed" in out.reduce()
    finally:
        src.close()


def test_prometheus_series_have_reason_side_and_state_labels() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    stats = LynxStats()
    for reason in FAILURE_REASONS:
        stats.record_failure(reason)
    stats.record_failure("integrity")
    stats.data["events"] += [["p", "auth_failed", 3], ["d", "lease_lost", 1]]
    stats.data["gauges"] += [["p", 0, "used", 4096], ["p", 0, "capacity", 8192]]
    prom.observe(stats.data)
    text = generate_latest(registry).decode()
    assert 'vllm:lynx_failed_transfers_total{engine="0",model_name="m",reason="integrity"} 2.0' in text
    assert 'vllm:lynx_failed_transfers_total{engine="0",model_name="m",reason="too_large"} 1.0' in text
    assert 'vllm:lynx_side_channel_events_total{engine="0",event="auth_failed",model_name="m",side="p"} 3.0' in text
    assert 'vllm:lynx_staging_bytes{engine="0",model_name="m",rank="0",side="p",state="used"} 4096.0' in text
    # every refusal reason is in its HELP (replayed was missing); the latency buckets reach concurrent_wait_s
    help_line = next(x for x in text.splitlines() if x.startswith("# HELP vllm:lynx_refused_params_total"))
    assert all(r in help_line for r in REFUSAL_REASONS), help_line
    prom.observe({"anchor_s": [90.0]})
    text = generate_latest(registry).decode()
    assert 'vllm:lynx_time_to_stream_seconds_bucket{engine="0",le="60.0",model_name="m",stream="anchor"} 0.0' in text
    assert 'vllm:lynx_time_to_stream_seconds_bucket{engine="0",le="120.0",model_name="m",stream="anchor"} 1.0' in text


def test_auto_choices_are_counted_by_mode_and_reason() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    stats = LynxStats()
    assert stats.is_empty()
    stats.record_auto("speculative", "slow_link")
    other = LynxStats()
    other.record_auto("speculative", "slow_link")
    other.record_auto("bf16", "fast_link")
    stats.aggregate(other)
    assert not stats.is_empty() and stats.reduce()["Auto chose speculative"] == 2
    prom.observe(stats.clone_and_reset().data)
    assert stats.is_empty()
    text = generate_latest(registry).decode()
    assert 'vllm:lynx_auto_choices_total{engine="0",mode="speculative",model_name="m",reason="slow_link"} 2.0' in text
    assert 'vllm:lynx_auto_choices_total{engine="0",mode="bf16",model_name="m",reason="fast_link"} 1.0' in text


def test_security_seconds_are_exported_per_side_and_cost() -> None:
    """Issue 14's cost: checksum seconds recorded by the workers, MAC seconds of the transport threads (exported
    as increments of their running totals), one Prometheus counter by side and what."""
    class End:  # the part of a transport endpoint the exporter reads
        def __init__(self) -> None:
            self.mac = 0.0
            self.pool = SimpleNamespace(nbytes=1, bytes_allocated=0, quarantined_bytes=0)

        def stats(self) -> dict:
            return {"mac_s": self.mac}

    end, exp, stats = End(), TransportExporter(interval_s=0.0), LynxStats()
    end.mac = 0.25
    exp.maybe_export(stats, {"p": None, "d": end})
    end.mac = 0.5
    exp.maybe_export(stats, {"p": None, "d": end})
    exp.maybe_export(stats, {"p": None, "d": end})  # unchanged: nothing more
    stats.record_security("p", "checksum", 0.125)
    assert stats.data["security"] == [["d", "mac", 0.25], ["d", "mac", 0.25], ["p", "checksum", 0.125]]
    registry = CollectorRegistry()
    _prom(registry).observe(stats.data)
    text = generate_latest(registry).decode()
    assert 'vllm:lynx_security_seconds_total{engine="0",model_name="m",side="d",what="mac"} 0.5' in text
    assert 'vllm:lynx_security_seconds_total{engine="0",model_name="m",side="p",what="checksum"} 0.125' in text
