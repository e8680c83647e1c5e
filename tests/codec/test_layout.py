"""KVLayout against vLLM's own reshape-and-cache op: what vLLM writes, our gather reads back exactly, and our
scatter writes byte-identical cache content. Also the FlashAttention view and partial-block rules."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import KVLayout, cpu_attn_isa

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [(isa, dt, d) for isa in ("vec", "vec16", "amx") for dt in DTYPES for d in (64, 128, 256)
         if not (isa == "amx" and dt == torch.float32)]  # vLLM picks amx only for 16-bit caches


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("isa", "dtype", "head_size"), CASES)
def test_cpu_layout_matches_vllm(reshape_and_cache, isa: str, dtype: torch.dtype, head_size: int) -> None:
    if isa == "amx" and not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM's AVX2 kernel build has no amx cache layout (it picks vec/vec16 on this CPU)")
    h, bs, nb = 2, 32, 5
    gen = torch.Generator().manual_seed(head_size)
    ids = torch.tensor([3, 0, 4])
    t = 2 * bs + 7  # partial last block
    k = torch.randn(t, h, head_size, generator=gen).to(dtype)
    v = torch.randn(t, h, head_size, generator=gen).to(dtype)
    slots = ids.repeat_interleave(bs)[:t] * bs + torch.arange(t) % bs
    layout = KVLayout.cpu(h, bs, head_size, dtype, isa=isa)

    oracle = torch.randn(nb, h, bs, 2 * head_size, generator=gen).to(dtype)
    ours = oracle.clone()
    reshape_and_cache(oracle, k, v, slots, isa)
    gk, gv = layout.gather(oracle, ids, t)
    assert torch.equal(_bytes(gk), _bytes(k)) and torch.equal(_bytes(gv), _bytes(v))

    layout.scatter(ours, ids, t, k, v)
    assert torch.equal(_bytes(ours), _bytes(oracle))


def test_isa_selection_follows_vllm() -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for dt in DTYPES:
        for bs, d in ((32, 64), (16, 128), (64, 80)):
            assert cpu_attn_isa(dt, bs, d) == _get_attn_isa(dt, bs, d)
            if d % 32 == 0 and not (cpu_attn_isa(dt, bs, d) == "amx" and bs % 32):
                assert KVLayout.cpu(2, bs, d, dt).isa == _get_attn_isa(dt, bs, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_layout_matches_vllm_view(dtype: torch.dtype) -> None:
    """FlashAttention hands reshape_and_cache_flash ``kv.transpose(1, 2).split(D, -1)`` ([B, BS, H, D] each) and
    writes ``key_cache[slot // BS, slot % BS] = key``; emulate that and compare (the CUDA op is absent here)."""
    h, bs, d, nb = 3, 16, 64, 4
    kv = torch.randn(nb, h, bs, 2 * d).to(dtype)
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
    ids, t = torch.tensor([2, 0]), bs + 5
    k, v = torch.randn(t, h, d).to(dtype), torch.randn(t, h, d).to(dtype)
    slots = ids.repeat_interleave(bs)[:t] * bs + torch.arange(t) % bs
    oracle = kv.clone()
    ok, ov = oracle.transpose(1, 2).split(d, dim=-1)
    ok[slots // bs, slots % bs] = k
    ov[slots // bs, slots % bs] = v
    layout = KVLayout.from_kv_cache(kv, backend="flash")
    gk, gv = layout.gather(oracle, ids, t)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    layout.scatter(kv, ids, t, k, v)
    assert torch.equal(_bytes(kv), _bytes(oracle))
    assert key_cache.data_ptr() == kv.data_ptr() and value_cache.shape == (nb, bs, h, d)


def test_layout_rejects_mismatch() -> None:
    layout = KVLayout.cpu(2, 32, 64, torch.float32, isa="vec")
    with pytest.raises(ValueError):
        layout.gather(torch.zeros(4, 2, 32, 64), [0], 8)  # wrong head size
    with pytest.raises(ValueError):
        layout.gather(torch.zeros(4, 2, 32, 128), [0], 40)  # too few blocks
    with pytest.raises(ValueError):
        KVLayout.cpu(2, 16, 64, torch.bfloat16, isa="amx")
