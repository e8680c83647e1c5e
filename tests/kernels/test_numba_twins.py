"""The numba CPU kernels against the torch twins (the format's definition): identical planes from encode and
byte-identical caches from decode and merge, on every layout, cache dtype, head size and grouping; the kernels
must not have handed over to the twin in those cases (that would make equality trivial). Hand-overs (non-finite
input, signed-zero ties) must still give the twin's answer or error; the fp16 bit conversions are checked
exhaustively against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lynx_connector.codec import (
    KVLayout,
    NonFiniteKVError,
    decode_anchor,
    encode,
    get_codec,
    merge_residual,
    plane_nbytes,
)

numba_path = pytest.importorskip("lynx_connector.codec.numba_path")
if numba_path.numba_kernels() is None:
    pytest.skip("numba unavailable", allow_module_level=True)
from lynx_connector.kernels import groupquant_numba as kernels  # noqa: E402  (its fp16 helpers, tested below)

H, BS = 2, 32
LAYOUTS = [("cpu", "vec"), ("cpu", "vec16"), ("cpu", "amx"), ("flash", None)]
CODECS = [("lynx", {}), ("lynx", {"k_group": "token", "v_group_tokens": 16}), ("int4", {}), ("int8", {}),
          ("int4_kivi", {}), ("int8", {"k_group": "channel", "group_tokens": 48})]


def _layout(backend, isa, dtype, d):
    return KVLayout.cpu(H, BS, d, dtype, isa=isa) if backend == "cpu" else KVLayout.flash(H, BS, d, dtype)


def _src(dtype, d, seed):
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(7, H, BS, 2 * d, generator=gen) * 3).to(dtype)
    src[1, 0, :, :8] = 0.5  # constant stretches
    src[3, 1, 4:9, 20:30] = 1e-6  # tiny values: subnormal fp16 metadata
    return src, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("backend", "isa"), LAYOUTS)
@pytest.mark.parametrize("d", [64, 128])
def test_numba_bit_exact(dtype, backend, isa, d) -> None:
    if isa == "amx" and dtype == torch.float32:
        pytest.skip("amx tiles exist for 16-bit caches only")
    layout = _layout(backend, isa, dtype, d)
    src, gen = _src(dtype, d, d)
    t, ids = 3 * BS + 11, [3, 1, 6, 4]  # ragged channel groups, partial last block
    base = torch.randn(src.shape, generator=gen).to(dtype)
    for name, opts in CODECS:
        codec = get_codec(name, **opts)
        na, nr = plane_nbytes(codec, layout, t)
        planes = []
        for impl in ("torch", "numba"):
            a = torch.zeros(na, dtype=torch.uint8)
            r = torch.zeros(nr, dtype=torch.uint8) if nr else None
            if impl == "numba":
                assert numba_path.encode_numba(codec, src, ids, layout, t, a, r), "kernel handed over"
            else:
                encode(codec, src, ids, layout, t, a, r, impl=impl)
            planes.append((a, r))
        (a, r), (a2, r2) = planes
        assert torch.equal(a, a2), name
        assert r is None or torch.equal(r, r2), name
        stages = [("anchor", None, 0)] + ([("full", r, 0), ("full", r, 1)] if r is not None else [])
        for _, res, skip in stages:
            outs = []
            for impl in ("torch", "numba"):
                dst = base.clone()
                fn = decode_anchor if res is None else merge_residual
                args = (codec, a, dst, ids, layout, t) if res is None else (codec, a, res, dst, ids, layout, t)
                fn(*args, skip_blocks=skip, impl=impl)
                outs.append(dst.view(torch.uint8))
            assert torch.equal(outs[0], outs[1]), (name, skip)


@pytest.mark.parametrize("d", [4, 12, 72])
def test_fp32_one_pass_encode_odd_head_sizes(d) -> None:
    """The fp32 one-pass K+V encode on head sizes below, and not a multiple of, its 8 lanes (token rows) and with
    channel groups that end inside a block: bit-exact, and not handed over."""
    layout = KVLayout.flash(H, BS, d, torch.float32)
    src, _ = _src(torch.float32, d, d)
    t, ids = 2 * BS + 5, [2, 0, 5]
    for name, opts in CODECS + [("lynx", {"k_group_tokens": 48})]:
        codec = get_codec(name, **opts)
        na, nr = plane_nbytes(codec, layout, t)
        out = []
        for impl in ("torch", "numba"):
            a, r = torch.zeros(na, dtype=torch.uint8), (torch.zeros(nr, dtype=torch.uint8) if nr else None)
            if impl == "numba":
                assert numba_path.encode_numba(codec, src, ids, layout, t, a, r), "kernel handed over"
            else:
                encode(codec, src, ids, layout, t, a, r, impl=impl)
            out.append((a, r))
        assert torch.equal(out[0][0], out[1][0]), (name, opts)
        assert out[0][1] is None or torch.equal(out[0][1], out[1][1]), (name, opts)


def test_signed_zero_tie_and_zero_groups_match_twin() -> None:
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    src = torch.randn(3, H, BS, 128)
    src[0, 0] = 0.0
    src[0, 0, ::2, 64:] = -0.0  # V groups with both zeros
    src[1, 1, :, :64] = -0.0  # K groups of negative zeros only
    for name in ("lynx", "int4"):
        codec = get_codec(name)
        na, nr = plane_nbytes(codec, layout, 2 * BS)
        outs = []
        for impl in ("torch", "numba"):
            a, r = torch.zeros(na, dtype=torch.uint8), (torch.zeros(nr, dtype=torch.uint8) if nr else None)
            encode(codec, src, [0, 1], layout, 2 * BS, a, r, impl=impl)
            outs.append((a, r))
        assert torch.equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e6])
def test_handover_raises_like_twin(bad: float) -> None:
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    src = torch.randn(3, H, BS, 128)
    src[2, 1, 3, 70] = bad
    codec = get_codec("lynx")
    na, nr = plane_nbytes(codec, layout, BS)
    a, r = torch.zeros(na, dtype=torch.uint8), torch.zeros(nr, dtype=torch.uint8)
    assert not numba_path.encode_numba(codec, src, [2], layout, BS, a, r)
    with pytest.raises(ValueError) as err:
        encode(codec, src, [2], layout, BS, a, r, impl="numba", layer_name="layer3")
    assert "layer3" in str(err.value)
    assert isinstance(err.value, NonFiniteKVError) == (bad != 1e6)


def test_fp16_conversions_exhaustive() -> None:
    bits = np.arange(1 << 16, dtype=np.int64)
    h = torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.float16)
    finite = torch.isfinite(h).numpy()
    want = h.float().view(torch.int32).numpy().view(np.uint32)
    got = np.array([kernels.f16_bits_to_f32_bits.py_func(int(b)) for b in bits[finite]], dtype=np.uint32)
    assert np.array_equal(got, want[finite])
    gen = torch.Generator().manual_seed(0)
    x = torch.cat((torch.randn(20000, generator=gen) * torch.logspace(-9, 4.8, 20000).float(),
                   h[finite].float() + h[finite].float() * 2.0**-11,  # exact ties between fp16 neighbours
                   torch.tensor([65504.0, 65519.0, 2.0**-25, 2.0**-24 * 1.5, -0.0, 0.0])))
    want16 = x.half().view(torch.int16).numpy().view(np.uint16)
    xb = x.view(torch.int32).numpy().view(np.uint32).astype(np.int64)
    got16 = np.array([kernels.f32_to_f16_bits.py_func(int(b)) for b in xb], dtype=np.int64).astype(np.uint16)
    assert np.array_equal(got16, want16)


def test_impl_numba_rejects_unsupported() -> None:
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    src = torch.randn(2, H, BS, 128)
    codec = get_codec("fp8")
    a = torch.zeros(plane_nbytes(codec, layout, BS)[0], dtype=torch.uint8)
    with pytest.raises(ValueError):
        encode(codec, src, [1], layout, BS, a, impl="numba")
    with pytest.raises(ValueError):
        encode(codec, src, [1], layout, BS, a, impl="nope")


def test_meta_f32_exhaustive() -> None:
    """The split (vectorized normal-number pass + scalar fix-up) fp16 -> fp32 metadata conversion, on every bit
    pattern, against the scalar conversion."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = kernels._meta_f32(bits).view(np.uint32)
    want = np.array([kernels.f16_bits_to_f32_bits.py_func(int(b)) for b in bits], dtype=np.uint32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize(("h", "d", "t"), [(1, 2, 1), (1, 6, 3), (3, 10, 5)])
def test_odd_metadata_offset_head_sizes(h, d, t) -> None:
    """h*d % 4 == 2 with an odd token count puts a 4-bit plane's fp16 metadata at an odd byte: the torch twin
    encodes such planes (it raised on the unaligned fp16 view) bit for bit as numba, and decodes them the same."""
    layout = KVLayout.cpu(h, 16, d, torch.bfloat16, isa="vec")
    gen = torch.Generator().manual_seed(d)
    src = torch.randn(2, h, 16, 2 * d, generator=gen).to(torch.bfloat16)
    for name, opts in (("lynx", {}), ("int4", {}), ("int4_kivi", {})):
        codec = get_codec(name, **opts)
        na, nr = plane_nbytes(codec, layout, t)
        assert (t * h * d // 2) % 2 == 1  # the K codes end at an odd byte
        out = []
        for impl in ("torch", "numba"):
            a, r = torch.zeros(na, dtype=torch.uint8), (torch.zeros(nr, dtype=torch.uint8) if nr else None)
            encode(codec, src, [1], layout, t, a, r, impl=impl)
            out.append((a, r))
        assert torch.equal(out[0][0], out[1][0]), name
        assert out[0][1] is None or torch.equal(out[0][1], out[1][1]), name
        a, r = out[0]
        decoded = []
        for impl in ("torch", "numba"):
            dst = torch.zeros_like(src)
            if r is None:
                decode_anchor(codec, a, dst, [1], layout, t, impl=impl)
            else:
                merge_residual(codec, a, r, dst, [1], layout, t, impl=impl)
            decoded.append(dst)
        assert torch.equal(decoded[0].view(torch.uint8), decoded[1].view(torch.uint8)), name
        want, got = layout.gather(src, [1], t), layout.gather(decoded[0], [1], t)
        err = max(float((g - w).float().abs().max()) for g, w in zip(got, want, strict=True))
        assert err < (0.05 if r is not None else 0.8), (name, err)  # full precision / a 4-bit level
