"""Codec edge cases found by review: a request within one cache block (fp8), values at the top of an fp16 cache
(every codec, torch and numba paths) and KV beyond what fp8 with an fp16 scale holds."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import (
    KVLayout,
    KVRangeError,
    check_metadata,
    decode_anchor,
    decode_full,
    encode,
    get_codec,
    plane_nbytes,
)


@pytest.mark.parametrize("layout, tokens", [
    (KVLayout.cpu(2, 32, 64, torch.bfloat16, isa="vec"), 5),
    (KVLayout.cpu(8, 16, 128, torch.float32, isa="vec"), 16),
    (KVLayout.flash(2, 16, 64, torch.bfloat16), 5),
])
def test_fp8_encodes_a_request_within_one_block(layout: KVLayout, tokens: int) -> None:
    """The gathered K/V of one block is a strided view of the cache: fp8 flattened it with view() and raised."""
    codec = get_codec("fp8")
    kv = torch.randn(4, layout.num_heads, layout.block_size, 2 * layout.head_size).to(layout.dtype)
    anchor = torch.zeros(plane_nbytes(codec, layout, tokens)[0], dtype=torch.uint8)
    encode(codec, kv, [0, 1, 2, 3], layout, tokens, anchor)
    out = torch.zeros_like(kv)
    decode_anchor(codec, anchor, out, [0, 1, 2, 3], layout, tokens)
    k, v = layout.gather(kv, [0], tokens)
    k2, v2 = layout.gather(out, [0], tokens)
    assert torch.allclose(k2.float(), k.float(), rtol=2 ** -4, atol=1e-2)
    assert torch.allclose(v2.float(), v.float(), rtol=2 ** -4, atol=1e-2)


@pytest.mark.parametrize("name, impl", [("lynx", "torch"), ("lynx", "numba"), ("int4", "torch"), ("int4", "numba"),
                                        ("int8", "torch"), ("int8", "numba"), ("fp8", "torch")])
def test_the_top_of_an_fp16_cache_decodes_finite(name: str, impl: str) -> None:
    """65504 (fp16's largest value) is accepted by encode; the top level mn + levels * s, with s rounded up, lies
    above it, and was written as inf into D's fp16 cache. It is written as 65504."""
    h, bs, d = 1, 16, 64
    layout = KVLayout.cpu(h, bs, d, torch.float16, isa="vec")
    kv = torch.zeros(2, h, bs, 2 * d, dtype=torch.float16)
    x = torch.zeros(2 * bs, h, d)
    x[:, :, 0] = 65504.0
    x[:, :, 1] = -65504.0
    layout.scatter(kv, [0, 1], 2 * bs, x, x)
    codec = get_codec(name)
    a, r = plane_nbytes(codec, layout, 2 * bs)
    anchor, residual = torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8) if r else None
    encode(codec, kv, [0, 1], layout, 2 * bs, anchor, residual, impl=impl)
    check_metadata(codec, anchor, layout, 2 * bs)
    for decode in ("anchor", "full"):
        out = torch.zeros_like(kv)
        if decode == "anchor":
            decode_anchor(codec, anchor, out, [0, 1], layout, 2 * bs, impl=impl)
        else:
            decode_full(codec, anchor, residual, out, [0, 1], layout, 2 * bs, impl=impl)
        assert bool(torch.isfinite(out).all()), (decode, int((~torch.isfinite(out)).sum()))
        k, _ = layout.gather(out, [0, 1], 2 * bs)
        assert float(k[:, :, 0].min()) > 65000 and float(k[:, :, 1].max()) < -65000


def test_fp8_refuses_kv_its_fp16_scale_cannot_reach() -> None:
    """|x| > 448 * 65504 was silently saturated (1e9 came back as 2.9e7); the group codecs refuse it, so does fp8."""
    layout = KVLayout.cpu(1, 16, 64, torch.float32, isa="vec")
    kv = torch.randn(1, 1, 16, 128)
    kv[0, 0, 3, 5] = 1e9
    codec = get_codec("fp8")
    anchor = torch.zeros(plane_nbytes(codec, layout, 16)[0], dtype=torch.uint8)
    with pytest.raises(KVRangeError, match="layer.k"):
        encode(codec, kv, [0], layout, 16, anchor)


@pytest.mark.parametrize("impl", ["torch", "numba"])
@pytest.mark.parametrize("ids", [[0, 4], [0, -1], [1, 0, 1]])
def test_block_ids_out_of_range_or_repeated_are_refused_before_any_write(impl: str, ids: list[int]) -> None:
    """The kernels index the cache with the ids unchecked: numba wrote past the layer for id 4 of 4 blocks and into
    the last (unlisted) block for -1, and a repeated block had rows past num_tokens overwritten. Each impl refuses
    them with one ValueError, and nothing is written."""
    h, bs, d = 1, 16, 64
    layout = KVLayout.cpu(h, bs, d, torch.float32, isa="vec")
    codec = get_codec("lynx")
    tokens = bs * (len(ids) - 1) + 8
    src = torch.randn(4, h, bs, 2 * d)
    a, r = plane_nbytes(codec, layout, tokens)
    anchor, residual = torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8)
    good = list(range(len(ids)))
    encode(codec, src, good, layout, tokens, anchor, residual, impl=impl)
    with pytest.raises(ValueError, match="block ids must be distinct"):
        encode(codec, src, ids, layout, tokens, torch.zeros_like(anchor), torch.zeros_like(residual), impl=impl)
    dst = torch.full((4, h, bs, 2 * d), 7.0)
    for call in (lambda: decode_anchor(codec, anchor, dst, ids, layout, tokens, impl=impl),
                 lambda: decode_full(codec, anchor, residual, dst, ids, layout, tokens, impl=impl)):
        with pytest.raises(ValueError, match="block ids must be distinct"):
            call()
        assert torch.equal(dst, torch.full_like(dst, 7.0))


@pytest.mark.parametrize("impl", ["torch", "numba"])
def test_the_null_block_may_repeat(impl: str) -> None:
    """vLLM lists its null block (id 0) for every position a sliding window dropped: [0, 0, 2, 3] is a block table
    (refusing it failed every long prompt of a sliding-window model); rows of real blocks decode as ever."""
    h, bs, d = 1, 16, 64
    layout = KVLayout.cpu(h, bs, d, torch.float32, isa="vec")
    codec = get_codec("lynx")
    tokens = 4 * bs
    src = torch.randn(4, h, bs, 2 * d)
    a, r = plane_nbytes(codec, layout, tokens)
    anchor, residual = torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8)
    encode(codec, src, [0, 0, 2, 3], layout, tokens, anchor, residual, impl=impl)
    dst = torch.zeros(4, h, bs, 2 * d)
    decode_full(codec, anchor, residual, dst, [0, 0, 2, 3], layout, tokens, impl=impl)
    assert torch.allclose(dst[2:], src[2:], atol=0.05) and not dst[1].any()
