"""decode_full (both planes at hand, one pass) against decode_anchor followed by merge_residual: byte-identical
caches on every layout and cache dtype, with every implementation on CPU, with and without skipped blocks;
single-stream codecs decode their anchor."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import (
    KVLayout,
    decode_anchor,
    decode_full,
    encode,
    get_codec,
    merge_residual,
    plane_nbytes,
)
from lynx_connector.codec.numba_path import numba_kernels

H, BS = 2, 32
LAYOUTS = [("cpu", "vec"), ("cpu", "vec16"), ("cpu", "amx"), ("flash", None)]
TWO_STREAM = [("lynx", {}), ("lynx", {"k_group": "token", "v_group_tokens": 16})]
IMPLS = ["torch"] + (["numba"] if numba_kernels() is not None else [])


def _layout(backend: str, isa: str | None, dtype: torch.dtype, d: int) -> KVLayout:
    return KVLayout.cpu(H, BS, d, dtype, isa=isa) if backend == "cpu" else KVLayout.flash(H, BS, d, dtype)


def _case(dtype: torch.dtype, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(7, H, BS, 2 * d, generator=gen) * 3).to(dtype)
    garbage = (torch.randn(src.shape, generator=gen) * 50).to(dtype)  # what D's blocks held before
    return src, garbage


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("backend", "isa"), LAYOUTS)
@pytest.mark.parametrize("d", [64, 128])
def test_decode_full_is_anchor_then_merge(impl: str, dtype: torch.dtype, backend: str, isa: str | None, d: int) -> None:
    if isa == "amx" and dtype == torch.float32:
        pytest.skip("amx tiles exist for 16-bit caches only")
    layout = _layout(backend, isa, dtype, d)
    src, garbage = _case(dtype, d, d)
    t, ids = 3 * BS + 11, [3, 1, 6, 4]  # ragged groups, partial last block
    for name, opts in TWO_STREAM:
        codec = get_codec(name, **opts)
        na, nr = plane_nbytes(codec, layout, t)
        anchor, residual = torch.zeros(na, dtype=torch.uint8), torch.zeros(nr, dtype=torch.uint8)
        encode(codec, src, ids, layout, t, anchor, residual, impl=impl)
        for skip in (0, 1):
            two_pass, one_pass = garbage.clone(), garbage.clone()
            decode_anchor(codec, anchor, two_pass, ids, layout, t, skip_blocks=skip, impl=impl)
            merge_residual(codec, anchor, residual, two_pass, ids, layout, t, skip_blocks=skip, impl=impl)
            decode_full(codec, anchor, residual, one_pass, ids, layout, t, skip_blocks=skip, impl=impl)
            assert torch.equal(two_pass.view(torch.uint8), one_pass.view(torch.uint8)), (name, opts, skip)
            assert not torch.equal(one_pass.view(torch.uint8), garbage.view(torch.uint8))


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_full_matches_across_impls(impl: str) -> None:
    """The one-pass decode of the numba kernels and of the torch twin write the same bytes (fp32 vec: the kernels'
    fused K+V path)."""
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    src, garbage = _case(torch.float32, 64, 5)
    codec, t, ids = get_codec("lynx"), 5 * BS + 3, [2, 0, 6, 4, 1, 5]
    na, nr = plane_nbytes(codec, layout, t)
    anchor, residual = torch.zeros(na, dtype=torch.uint8), torch.zeros(nr, dtype=torch.uint8)
    encode(codec, src, ids, layout, t, anchor, residual, impl="torch")
    ref, got = garbage.clone(), garbage.clone()
    decode_full(codec, anchor, residual, ref, ids, layout, t, impl="torch")
    decode_full(codec, anchor, residual, got, ids, layout, t, impl=impl)
    assert torch.equal(ref.view(torch.uint8), got.view(torch.uint8))


@pytest.mark.parametrize("name", ["int4", "int8", "bf16", "fp8"])
def test_decode_full_single_stream_is_anchor(name: str) -> None:
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    src, garbage = _case(torch.float32, 64, 1)
    codec, t, ids = get_codec(name), 2 * BS + 7, [4, 0, 2]
    na, nr = plane_nbytes(codec, layout, t)
    assert nr == 0
    anchor = torch.zeros(na, dtype=torch.uint8)
    encode(codec, src, ids, layout, t, anchor, None)
    a, b, c = garbage.clone(), garbage.clone(), garbage.clone()
    decode_anchor(codec, anchor, a, ids, layout, t)
    decode_full(codec, anchor, None, b, ids, layout, t)
    decode_full(codec, anchor, torch.zeros(0, dtype=torch.uint8), c, ids, layout, t)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    with pytest.raises(ValueError, match="single-stream"):
        decode_full(codec, anchor, torch.zeros(4, dtype=torch.uint8), c, ids, layout, t)


def test_decode_full_needs_the_residual_for_two_stream_codecs() -> None:
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    codec = get_codec("lynx")
    na, _ = plane_nbytes(codec, layout, BS)
    with pytest.raises(ValueError, match="residual"):
        decode_full(codec, torch.zeros(na, dtype=torch.uint8), None, torch.zeros(2, H, BS, 128), [0], layout, BS)
