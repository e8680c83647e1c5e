"""Heterogeneous P and D at the codec level (issue 18.4): the staged planes are a function of the token values
and the codec only, never of P's paging (block size, ISA tiles, block ids), and D decodes them into any layout
and cache dtype: the same values as a D of P's own configuration, converted once to D's dtype."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import (
    CODEC_NAMES,
    KVLayout,
    KVRangeError,
    check_metadata,
    decode_anchor,
    encode,
    get_codec,
    merge_residual,
    plane_nbytes,
    staged_layout,
)
from lynx_connector.codec.numba_path import numba_kernels

H, HD, T = 2, 32, 300  # 300 tokens: several K groups (256) and V groups (32), a partial last block everywhere
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
IMPLS = ["torch", "numba"] if numba_kernels() is not None else ["torch"]


def values(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major K, V [T, H, D] with an outlier channel (K) and bf16-representable values, so an fp32 and a
    bf16 cache hold exactly the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, HD, generator=gen) * 2
    k[..., 3] += 9.0
    v = torch.randn(T, H, HD, generator=gen)
    return k.to(BF16).float(), v.to(BF16).float()


def paged(k: torch.Tensor, v: torch.Tensor, bs: int, dtype: torch.dtype, isa: str | None = None,
          seed: int = 1) -> tuple[torch.Tensor, KVLayout, list[int]]:
    """A cache of block size ``bs`` holding K, V in shuffled blocks (garbage elsewhere); ``isa="flash"``: the
    FlashAttention layout (GPU P or D), else the CPU layout of that ISA."""
    layout = KVLayout.flash(H, bs, HD, dtype) if isa == "flash" else KVLayout.cpu(H, bs, HD, dtype, isa=isa)
    need = -(-T // bs)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(need + 3, H, bs, 2 * HD, generator=gen).to(dtype)
    ids = torch.randperm(need + 3, generator=gen)[:need].tolist()
    layout.scatter(cache, ids, T, k, v)
    return cache, layout, ids


def stage(codec, cache, layout, ids, impl="torch"):
    a, r = plane_nbytes(codec, layout, T)
    anchor, residual = torch.zeros(a, dtype=torch.uint8), (torch.zeros(r, dtype=torch.uint8) if r else None)
    encode(codec, cache, ids, layout, T, anchor, residual, impl=impl)
    return anchor, residual


def decoded(codec, anchor, residual, bs, dtype, staged, isa=None, impl="torch"):
    """What a D of block size ``bs`` and cache ``dtype`` holds after writing the planes (token-major)."""
    layout = KVLayout.flash(H, bs, HD, dtype) if isa == "flash" else KVLayout.cpu(H, bs, HD, dtype, isa=isa)
    need = -(-T // bs)
    cache = torch.zeros(need + 2, H, bs, 2 * HD, dtype=dtype)
    ids = list(range(need + 1, 0, -1))[:need]
    check_metadata(codec, anchor, layout, T, staged_dtype=staged)
    if residual is None:
        decode_anchor(codec, anchor, cache, ids, layout, T, impl=impl, staged_dtype=staged)
    else:
        merge_residual(codec, anchor, residual, cache, ids, layout, T, impl=impl, staged_dtype=staged)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert not cache[untouched].any()  # blocks not listed stay as they were
    return layout.gather(cache, ids, T)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


P_LAYOUTS = [(16, F32, None), (32, F32, None), (128, F32, None), (16, BF16, "vec16"), (32, BF16, "vec"),
             (128, BF16, None), (16, BF16, "flash"), (64, F32, "flash")]  # None: vLLM's pick (amx with AMX)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("impl", IMPLS)
def test_planes_depend_on_the_token_values_only(name, impl):
    """Every P layout (block size, ISA, block ids, and for the quantizing codecs the cache dtype) that holds the
    same values stages byte-identical planes."""
    codec = get_codec(name)
    if impl == "numba" and name in ("bf16", "fp8"):
        pytest.skip("no numba kernels for the passthrough and fp8")
    k, v = values()
    ref = {}
    for i, (bs, dtype, isa) in enumerate(P_LAYOUTS):
        cache, layout, ids = paged(k, v, bs, dtype, isa, seed=i)
        planes = stage(codec, cache, layout, ids, impl)
        key = dtype if codec.stages_cache_dtype else None  # the passthrough stages P's dtype: 2 or 4 bytes/value
        if key not in ref:
            ref[key] = planes
            continue
        assert torch.equal(planes[0], ref[key][0]), (bs, dtype, isa)
        assert (planes[1] is None) == (ref[key][1] is None)
        if planes[1] is not None:
            assert torch.equal(planes[1], ref[key][1]), (bs, dtype, isa)
    if codec.stages_cache_dtype:
        assert ref[F32][0].numel() == 2 * ref[BF16][0].numel()


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize(("p", "d"), [((32, F32), (128, BF16)), ((128, BF16), (16, F32)), ((16, F32), (128, F32)),
                                      ((128, BF16), (32, BF16)), ((32, F16), (16, F32))])
@pytest.mark.parametrize("full", [False, True])
def test_d_holds_the_same_config_result_in_its_own_dtype(name, p, d, full):
    """D of another block size and dtype holds exactly what a D of P's configuration holds, converted once to
    its dtype (exact when D's dtype holds every value of P's; rounded to nearest even once when narrower)."""
    codec = get_codec(name)
    if full and not codec.two_stream:
        pytest.skip("single-stream codec: the anchor is its full precision")
    k, v = values(seed=3)
    (p_bs, p_dtype), (d_bs, d_dtype) = p, d
    cache, layout, ids = paged(k.to(p_dtype), v.to(p_dtype), p_bs, p_dtype)
    anchor, residual = stage(codec, cache, layout, ids)
    residual = residual if full else None
    same_k, same_v = decoded(codec, anchor, residual, p_bs, p_dtype, None)  # a D configured like P
    for impl in IMPLS:
        if impl == "numba" and name in ("bf16", "fp8"):
            continue
        got_k, got_v = decoded(codec, anchor, residual, d_bs, d_dtype, p_dtype, impl=impl)
        flash_k, flash_v = decoded(codec, anchor, residual, d_bs, d_dtype, p_dtype, isa="flash", impl=impl)
        assert torch.equal(bits(flash_k), bits(got_k)) and torch.equal(bits(flash_v), bits(got_v))  # a GPU D
        if codec.stages_cache_dtype:  # the passthrough: P's values themselves, converted once
            want_k, want_v = k.to(p_dtype).to(d_dtype), v.to(p_dtype).to(d_dtype)
        elif d_dtype.itemsize >= p_dtype.itemsize and d_dtype != p_dtype:
            # a wider D keeps more of the decoded value than P's dtype could: within rounding of the same result
            want_k, want_v = same_k.to(d_dtype), same_v.to(d_dtype)
            tol = 2 ** -7 if p_dtype == BF16 else 2 ** -10
            for got, same in ((got_k, same_k), (got_v, same_v)):
                assert float((got.float() - same.float()).abs().max()) <= tol * float(same.float().abs().max())
                assert torch.equal(got.to(p_dtype), same)  # rounds to exactly the same-config result
            continue
        else:
            want_k, want_v = same_k.to(d_dtype), same_v.to(d_dtype)
        assert torch.equal(bits(got_k), bits(want_k)), (name, p, d, impl)
        assert torch.equal(bits(got_v), bits(want_v)), (name, p, d, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_quantized_full_precision_into_a_narrower_d_is_the_fp32_decode_rounded_once(impl):
    """fp32 P -> bf16 D, Lynx full: D holds the fp32 full-precision reconstruction rounded to bf16 once, i.e.
    what a bf16 D writes for the same full-precision values."""
    codec = get_codec("lynx")
    k, v = values(seed=5)
    k = k + torch.randn_like(k) * 1e-3  # fp32 values that bf16 cannot hold
    cache, layout, ids = paged(k, v, 32, F32)
    anchor, residual = stage(codec, cache, layout, ids)
    k32, v32 = decoded(codec, anchor, residual, 128, F32, F32)
    k16, v16 = decoded(codec, anchor, residual, 16, BF16, F32, impl=impl)
    assert torch.equal(bits(k16), bits(k32.to(BF16))) and torch.equal(bits(v16), bits(v32.to(BF16)))


def test_passthrough_sizes_by_the_staged_dtype_and_refuses_values_d_cannot_hold():
    codec = get_codec("bf16")
    d_layout = KVLayout.cpu(H, 16, HD, F16)
    assert plane_nbytes(codec, d_layout, T, staged_dtype=F32) == (2 * T * H * HD * 4, 0)
    assert plane_nbytes(codec, d_layout, T) == (2 * T * H * HD * 2, 0)
    assert staged_layout(codec, d_layout, T, 3, staged_dtype=F32).nbytes == (3 * (2 * T * H * HD * 4 + 8), 0)
    lynx = get_codec("lynx")  # the quantizing codecs' planes do not depend on any dtype
    assert plane_nbytes(lynx, d_layout, T, staged_dtype=F32) == plane_nbytes(lynx, KVLayout.cpu(H, 128, HD, F32), T)
    k, v = values()
    k[7, 1, 2] = 1e6  # beyond fp16's range
    cache, layout, ids = paged(k, v, 32, F32)
    anchor, _ = stage(codec, cache, layout, ids)
    with pytest.raises(KVRangeError, match="beyond the range"):
        decoded(codec, anchor, None, 16, F16, F32)
    got_k, _ = decoded(codec, anchor, None, 16, BF16, F32)  # bf16 has fp32's range: rounded, not refused
    assert torch.equal(bits(got_k), bits(k.to(BF16)))
    with pytest.raises(ValueError, match="staged dtype"):
        plane_nbytes(codec, d_layout, T, staged_dtype=torch.float64)
