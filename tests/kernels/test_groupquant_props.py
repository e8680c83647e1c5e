"""Properties of the torch twin (the CPU implementation): error bounds, constant groups, directed fp16 metadata
rounding, nibble packing. Bounds are exact up to fp32 rounding of the arithmetic: the tolerance is 4 ulp of
the group's magnitude (stated: |x - anchor| <= s/2 + 4ulp, |x - full| <= s/32 + 4ulp)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lynx_connector.kernels.fp16_meta import round_down_fp16, round_up_fp16
from lynx_connector.kernels.groupquant_ref import dequantize_ref, quantize_ref
from lynx_connector.kernels.pack import pack_nibbles, unpack_nibbles

EPS = 2.0**-23


@st.composite
def kv(draw):
    t = draw(st.integers(1, 40))
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 8, 16]))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0, 300.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -7.5, 200.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)) * scale + offset
    if draw(st.booleans()):  # some constant groups (fp16-representable value)
        x[0] = float(torch.tensor(offset).half())
    if draw(st.booleans()):  # an outlier channel
        x[..., 0] *= 20
    return x


def _scale_per_elem(q, mode: str, g: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
    s, m = q.scale.float(), q.mn.float()
    if mode == "token":
        return s[..., None].expand(shape), m[..., None].expand(shape)
    idx = torch.arange(shape[0]) // g
    return s[idx], m[idx]


@settings(max_examples=60, deadline=None)
@given(x=kv(), mode=st.sampled_from(["token", "channel"]), g=st.sampled_from([1, 4, 7, 16]))
def test_error_bounds(x: torch.Tensor, mode: str, g: int) -> None:
    q = quantize_ref(x, mode, g, 15, True)
    s, mn = _scale_per_elem(q, mode, g, x.shape)
    tol = 4 * EPS * (x.abs() + mn.abs() + 15 * s)
    anchor = dequantize_ref(q.codes, None, q.scale, q.mn, mode, g)
    full = dequantize_ref(q.codes, q.residual, q.scale, q.mn, mode, g)
    assert bool(((x - anchor).abs() <= s / 2 + tol).all())
    assert bool(((x - full).abs() <= s / 32 + tol).all())
    assert bool((mn <= x).all()) and bool((mn + 15 * s >= x - tol).all())  # stored meta brackets the group
    assert int(q.codes.max()) <= 15 and int(q.residual.max()) <= 15
    const = s == 0
    assert torch.equal(anchor[const], x[const]) and torch.equal(full[const], x[const])
    assert bool(torch.isfinite(full).all())


@settings(max_examples=30, deadline=None)
@given(x=kv())
def test_int8_bound(x: torch.Tensor) -> None:
    q = quantize_ref(x, "token", 1, 255, False)
    s, mn = _scale_per_elem(q, "token", 1, x.shape)
    y = dequantize_ref(q.codes, None, q.scale, q.mn, "token", 1)
    assert bool(((x - y).abs() <= s / 2 + 4 * EPS * (x.abs() + mn.abs() + 255 * s)).all())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-65000, 65000, allow_nan=False, width=32), min_size=1, max_size=64))
def test_fp16_directed_rounding(vals: list[float]) -> None:
    x = torch.tensor(vals, dtype=torch.float32)
    lo = round_down_fp16(x)
    assert bool((lo.float() <= x).all())
    step = torch.nextafter(lo, torch.tensor(float("inf"), dtype=torch.float16)).float()
    assert bool((step > x).all() | (lo.float() == x).all())
    a = x.abs()
    hi = round_up_fp16(a)
    assert bool((hi.float() >= a).all())
    prev = torch.nextafter(hi, torch.tensor(0.0, dtype=torch.float16)).float()
    assert bool(((prev < a) | (hi.float() == a)).all())


@given(st.integers(1, 5), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_pack_round_trip(rows: int, half: int, seed: int) -> None:
    codes = torch.randint(0, 16, (rows, 2 * half), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = pack_nibbles(codes)
    assert packed.shape == (rows, half)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(packed & 15, codes[:, 0::2])  # element 2j in the low nibble


def test_constant_and_ragged_channel_groups() -> None:
    x = torch.full((10, 2, 4), 0.375)
    x[:, 1] = -2.0
    for mode in ("token", "channel"):
        q = quantize_ref(x, mode, 4, 15, True)  # 10 tokens -> groups of 4, 4, 2
        assert torch.equal(dequantize_ref(q.codes, q.residual, q.scale, q.mn, mode, 4), x)
        assert torch.equal(dequantize_ref(q.codes, None, q.scale, q.mn, mode, 4), x)


def test_out_of_fp16_range_rejected() -> None:
    import pytest
    from lynx_connector.kernels.errors import KVRangeError

    with pytest.raises(KVRangeError):
        quantize_ref(torch.tensor([[[1e5, 0.0]]]), "token", 1, 15, True)
