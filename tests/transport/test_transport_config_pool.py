"""TransportConfig validation and the StagingPool allocator."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.transport.config import TransportConfig
from lynx_connector.transport.pool import StagingFullError, StagingPool

pytestmark = pytest.mark.timeout(30)


def test_config_defaults_and_rate() -> None:
    cfg = TransportConfig(link_gbps=8.0)
    assert cfg.link_bytes_per_s == pytest.approx(1e9)
    assert TransportConfig().link_bytes_per_s is None
    assert TransportConfig(num_workers=2).nixl_backend_params() == {"num_workers": "2"}


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"link_gbps": 0}, "link_gbps"),
        ({"link_gbps": float("inf")}, "link_gbps"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": 1 << 20, "window_bytes": 1 << 10}, "window_bytes"),
        ({"lease_s": -1}, "lease_s"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"port": 70000}, "port"),
        ({"host": ""}, "host"),
        ({"num_workers": True}, "num_workers"),
        ({"backend_params": {"a": 1}}, "backend_params"),
        ({"target_progress_s": -0.1}, "target_progress_s"),
        ({"lease_s": 2e6}, "lease_s"),  # past limits.MAX_SECONDS: the wire's HelloOk refuses such a lease
        ({"timeout_s": 1e10}, "timeout_s"),  # threading waits refuse timeouts past TIMEOUT_MAX
        ({"grace_s": 1e7}, "grace_s"),
        ({"link_gbps": 1e-6, "lease_s": 1e6}, "lower staging_mb or raise link_gbps"),
    ],
)
def test_config_rejects(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TransportConfig(**kwargs)


def test_pool_first_fit_coalesce_and_counters() -> None:
    pool = StagingPool(4096)
    a, b, c = pool.alloc(1000), pool.alloc(1000), pool.alloc(1000)
    assert (a, b, c) == (0, 1024, 2048)
    assert pool.regions_live == 3 and pool.bytes_allocated == 3072
    pool.free(b)
    assert pool.alloc(512) == 1024  # first fit reuses the hole
    pool.free(1024)
    pool.free(a)
    pool.free(c)
    assert pool.regions_live == 0 and pool.bytes_allocated == 0
    assert pool.largest_free == 4096  # fully coalesced
    with pytest.raises(KeyError):
        pool.free(a)


def test_pool_full_never_overwrites() -> None:
    pool = StagingPool(8192)
    st = pool.alloc_request("r1", 3000, 3000)
    st.anchor.fill_(7)
    st.residual.fill_(9)
    with pytest.raises(StagingFullError, match="staging pool full"):
        pool.alloc_request("r2", 1000, 3000)  # anchor fits, residual does not: rolled back
    assert pool.regions_live == 2
    assert bool((st.anchor == 7).all()) and bool((st.residual == 9).all())
    with pytest.raises(ValueError, match="already"):
        pool.alloc_request("r1", 10, 10)
    assert pool.free_request("r1") and not pool.free_request("r1")
    assert pool.regions_live == 0 and pool.requests_live == 0


def test_pool_single_stream_and_views() -> None:
    pool = StagingPool(4096)
    st = pool.alloc_request("r", 100, 0)
    assert st.residual is None and st.residual_nbytes == 0 and st.anchor_nbytes == 100
    assert pool.offset_of(st.anchor) == st.anchor_offset
    with pytest.raises(ValueError, match="inside"):
        pool.offset_of(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pool.offset_of(torch.zeros(10, dtype=torch.float32))
    with pytest.raises(ValueError):
        pool.alloc(0)
