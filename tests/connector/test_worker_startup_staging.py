"""The worker's start-up check of its staging pool (real transport endpoints over a fake NIXL fabric): the warning
when one request of max_model_len tokens does not fit in an allowed mode, and the longest prompt per mode that P's
workers hand their scheduler half (which refuses a longer one before staging it)."""

from __future__ import annotations

import pytest
import torch

from lynx_connector import worker as worker_mod
from lynx_connector.config import LynxConfig
from lynx_connector.transport.pool import StagingPool
from tests.connector.test_worker_fake_nixl import BS, LAYERS, NB, D, H, use_fake_nixl, vcfg

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("max_model_len", [4096, 64])
def test_start_up_warns_when_staging_cannot_hold_max_model_len(monkeypatch, caplog, max_model_len):
    """One request must fit the pool whole (else it fails after P's prefill): a worker whose staging cannot hold
    max_model_len tokens in an allowed mode says so at start, with the longest prompt that fits per mode and the
    staging_mb that would hold them all; it is quiet when max_model_len fits."""
    import logging

    use_fake_nixl(monkeypatch)
    cfg = LynxConfig.from_extra_config({"staging_mb": 1, "timeout_s": 2, "allowed_modes": ["full", "bf16"]})
    vc = vcfg("kv_producer")
    vc.model_config.max_model_len = max_model_len
    w = worker_mod.LynxConnectorWorker(vc, "e-p", cfg)
    try:
        with caplog.at_level(logging.WARNING):
            w.register_kv_caches({f"layer.{i}": torch.randn(NB, H, BS, 2 * D) for i in range(LAYERS)})
        said = [r.getMessage() for r in caplog.records if "staging_mb=1 holds" in r.getMessage()]
        longest = w.handshake_metadata().longest_prompt  # what P's scheduler half refuses longer prompts by
        if max_model_len == 64:
            assert said == [] and longest == {"full": 64, "bf16": 64}
            return
        assert len(said) == 1, said

        def size(mode: str, n: int) -> int:
            return sum(w._plane_nbytes(mode, n).nbytes)

        def placeable(mode: str, n: int) -> bool:  # as the pool places it (the anchor region aligned)
            return w.source.pool.fits(*w._plane_nbytes(mode, n).nbytes)

        fits = {}
        for mode in ("full", "bf16"):
            if not placeable(mode, max_model_len):
                fits[mode] = max(n for n in range(0, max_model_len + 1) if placeable(mode, n))
        assert fits, "the test's sizes must not fit 1 MiB"  # the fp32 passthrough is 1 KiB a token here
        for mode, n in fits.items():
            assert f"{n} ({mode})" in said[0], (mode, n, said[0])
        assert longest == {m: fits.get(m, max_model_len) for m in ("full", "bf16")}
        need = max(size(m, max_model_len) for m in ("full", "bf16"))
        suggested = int(said[0].split("staging_mb=")[-1].split()[0])
        assert suggested == -(-need // (1 << 20)) or suggested == -(-need // (1 << 20)) + 1, said[0]
        big = StagingPool(suggested << 20)  # the suggestion holds max_model_len in both modes
        assert all(big.fits(*w._plane_nbytes(m, max_model_len).nbytes) for m in ("full", "bf16"))
        assert "max_model_len is 4096" in said[0]
    finally:
        w.shutdown()


def test_start_up_staging_check_counts_what_d_stages_in_the_anchor_mode(monkeypatch, caplog):
    """A decode-only worker stages no residual for the anchor-only mode (it is never pulled): its start-up check
    judges that mode by the anchor plane alone, while P, which stages both planes, warns for the same length."""
    import logging

    use_fake_nixl(monkeypatch)
    cfg = LynxConfig.from_extra_config({"staging_mb": 1, "timeout_s": 2, "mode": "anchor", "allowed_modes": ["anchor"]})
    caches = {f"layer.{i}": torch.randn(NB, H, BS, 2 * D) for i in range(LAYERS)}

    def started(role: str, max_model_len: int) -> tuple[worker_mod.LynxConnectorWorker, list[str]]:
        vc = vcfg(role)
        vc.model_config.max_model_len = max_model_len
        w = worker_mod.LynxConnectorWorker(vc, f"e-{role}", cfg)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            w.register_kv_caches(caches)
        return w, [r.getMessage() for r in caplog.records if "staging_mb=1 holds" in r.getMessage()]

    probe, _ = started("kv_producer", 1)
    try:
        pool = probe.source.pool
        n = 1  # the shortest prompt whose two planes do not fit 1 MiB while its anchor alone does
        while pool.fits(*probe._plane_nbytes("anchor", n).nbytes):
            n *= 2
        assert pool.fits(*probe._plane_nbytes("anchor", n).without_residual().nbytes), n
    finally:
        probe.shutdown()
    for role, warned in (("kv_consumer", False), ("kv_producer", True)):
        w, said = started(role, n)
        try:
            assert bool(said) is warned, (role, said)
        finally:
            w.shutdown()


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_start_up_refuses_staging_larger_than_the_memory_available(monkeypatch, role):
    """staging_mb past the memory left (each pool is written at start, so resident): a start-up error naming
    staging_mb and, for kv_both, that it holds two pools (review: a bare torch "can't allocate" error, or the OOM
    killer), before any pool is allocated. One pool of the same size fits and starts."""
    from lynx_connector import memory
    from lynx_connector.config import LynxConfigError

    use_fake_nixl(monkeypatch)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 5 << 20)  # 5 MiB left
    allocated = []
    real_pool_init = StagingPool.__init__
    monkeypatch.setattr(StagingPool, "__init__", lambda pool, n, *a: allocated.append(n) or real_pool_init(pool, n, *a))
    caches = {f"layer.{i}": torch.zeros(NB, H, BS, 2 * D) for i in range(LAYERS)}
    w = worker_mod.LynxConnectorWorker(vcfg(role), "e-m", LynxConfig.from_extra_config({"staging_mb": 3,
                                                                                       "timeout_s": 2}))
    try:
        if role == "kv_both":
            with pytest.raises(LynxConfigError, match=r"staging_mb: 2 staging pool\(s\) of 3 MiB \(kv_role kv_both "
                                                      r".*need 6 MiB, but only 5 MiB .* kv_both worker"):
                w.register_kv_caches(caches)
            assert allocated == []
        else:
            w.register_kv_caches(caches)
            assert allocated == [3 << 20]
    finally:
        w.shutdown()


def test_available_memory_is_the_cgroup_remainder_when_lower(tmp_path) -> None:
    from lynx_connector import memory

    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("805306368\n")
    assert memory.available_memory_bytes(str(tmp_path)) == 256 << 20
    # the weights just read sit in the cgroup's page cache: reclaimable, so not in use (review: a start refused)
    (tmp_path / "memory.stat").write_text("anon 268435456\nfile 536870912\ninactive_file 402653184\n")
    assert memory.available_memory_bytes(str(tmp_path)) == 640 << 20
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.available_memory_bytes(str(tmp_path)) > 256 << 20
