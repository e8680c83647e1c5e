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


def test_pool_last_bytes_fit_a_size_that_is_no_multiple_of_the_alignment() -> None:
    """Regions are rounded up to 256 bytes; the pool's last bytes still take a request that fits them exactly
    (an empty 10000-byte pool refused 10000 bytes), and ``fits`` tells a request that can never be staged (the
    worker refuses it as too_large at once instead of letting it wait at the head of the staging queue)."""
    pool = StagingPool(10_000)
    off = pool.alloc(10_000)
    pool.free(off)
    assert pool.fits(10_000, 0) and not pool.fits(10_001, 0)
    mib = StagingPool(1 << 20)
    assert not mib.fits(600_001, 448_575)  # 1 MiB in all, but the anchor's rounding leaves the residual 63 short
    with pytest.raises(StagingFullError):
        mib.alloc_request("r", 600_001, 448_575)
    assert mib.fits(600_001, 448_512)
    staged = mib.alloc_request("r", 600_001, 448_512)
    assert staged.residual_offset + 448_512 == 1 << 20
    assert mib.free_request("r") and mib.free_bytes == 1 << 20 and mib.largest_free == 1 << 20


def test_pool_counters_do_not_count_a_quarantine_that_is_over() -> None:
    import time

    pool = StagingPool(1 << 16)
    pool.alloc_request("r", 1000, 1000)
    pool.free_request("r", quarantine_s=0.05)
    assert pool.bytes_allocated == 2048 and pool.regions_live == 2
    time.sleep(0.1)
    assert (pool.bytes_allocated, pool.regions_live, pool.largest_free) == (0, 0, 1 << 16)


def test_pool_one_request_id_is_staged_once_even_when_two_callers_race() -> None:
    """The id is taken before the regions are allocated: a second alloc_request for it in between (another
    thread) fails, instead of both succeeding and the first's regions never being freed."""
    pool = StagingPool(1 << 16)
    alloc, seen = pool.alloc, []

    def alloc_and_race(nbytes: int) -> int:
        if not seen:
            seen.append(True)
            with pytest.raises(ValueError, match="already has staging"):
                pool.alloc_request("r", 1000, 1000)
            assert pool.get_request("r") is None and not pool.free_request("r")  # not staged yet
        return alloc(nbytes)

    pool.alloc = alloc_and_race  # type: ignore[method-assign]
    staged = pool.alloc_request("r", 1000, 1000)
    assert pool.get_request("r") is staged and pool.requests_live == 1
    assert pool.free_request("r") and (pool.regions_live, pool.bytes_allocated, pool.requests_live) == (0, 0, 0)
    pool.alloc = alloc  # type: ignore[method-assign]
    with pytest.raises(StagingFullError):  # a failed allocation gives the id back
        pool.alloc_request("big", 1 << 17, 0)
    assert pool.requests_live == 0
    pool.alloc_request("big", 1 << 16, 0)
