"""The staged layout with per-layer checksum trailers (codec/integrity.py) and the decoded-metadata check."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import (
    TRAILER_NBYTES,
    IntegrityError,
    KVLayout,
    NonFiniteKVError,
    PlaneLayout,
    check_metadata,
    encode,
    get_codec,
    staged_layout,
)

BS, H, D, T, LAYERS = 16, 2, 32, 40, 3


def _layout() -> KVLayout:
    return KVLayout.from_kv_cache(torch.zeros(4, H, BS, 2 * D), block_size=BS, backend="cpu")


def _staged(codec_name: str, seed: int = 0):
    codec, layout = get_codec(codec_name), _layout()
    sl = staged_layout(codec, layout, T, LAYERS)
    a, r = sl.nbytes
    anchor, residual = torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    for i in range(LAYERS):
        kv = torch.randn(4, H, BS, 2 * D, generator=gen)
        encode(codec, kv, [2, 0, 3], layout, T, sl.anchor.plane(anchor, i),
               sl.residual.plane(residual, i) if r else None)
        sl.anchor.seal(anchor, i, "req")
        sl.residual.seal(residual, i, "req")
    return codec, layout, sl, anchor, residual


@pytest.mark.parametrize("name", ["lynx", "int8", "int4", "fp8", "bf16"])
def test_sizes_are_planes_plus_one_trailer_per_layer(name):
    codec, layout = get_codec(name), _layout()
    a, r = codec.plane_nbytes(T, H, D, torch.float32)
    sl = staged_layout(codec, layout, T, LAYERS)
    assert sl.nbytes == (LAYERS * (a + TRAILER_NBYTES), LAYERS * (r + TRAILER_NBYTES) if r else 0)
    assert sl.without_residual().nbytes == (sl.nbytes[0], 0)
    buf = torch.zeros(sl.nbytes[0], dtype=torch.uint8)
    for i in range(LAYERS):  # layer offsets keep the planes' alignment (the fp16 metadata views)
        assert sl.anchor.plane(buf, i).numel() == a
        assert (i * sl.anchor.stride) % 8 == (i * a) % 8


def test_sealed_planes_verify_and_every_single_bit_flip_is_caught():
    _, _, sl, anchor, residual = _staged("lynx")
    sl.anchor.verify_all(anchor, "req")
    sl.residual.verify_all(residual, "req")
    for plane, buf in ((sl.anchor, anchor), (sl.residual, residual)):
        layer = 1
        lo = layer * plane.stride
        for byte in range(lo, lo + plane.stride, 7):  # plane bytes and the trailer itself
            for bit in (0, 3, 7):
                buf[byte] ^= 1 << bit
                with pytest.raises(IntegrityError, match=f"layer {layer} \\(x\\) {plane.name} plane") as e:
                    plane.verify_all(buf, "req", ["w", "x", "y"])
                assert (e.value.layer, e.value.plane) == (layer, plane.name)
                buf[byte] ^= 1 << bit
        plane.verify_all(buf, "req")


def test_a_plane_of_another_request_or_layer_is_caught():
    _, _, sl, anchor, _ = _staged("lynx")
    with pytest.raises(IntegrityError):
        sl.anchor.verify(anchor, 0, "other-req")  # e.g. a region reused by the next tenant
    swapped = anchor.clone()
    s = sl.anchor.stride
    swapped[:s], swapped[s:2 * s] = anchor[s:2 * s].clone(), anchor[:s].clone()
    with pytest.raises(IntegrityError, match="layer 0"):
        sl.anchor.verify_all(swapped, "req")


def test_empty_planes_have_no_trailer():
    _, _, sl, anchor, residual = _staged("int8")
    assert residual.numel() == 0 and sl.residual.stride == 0
    sl.residual.verify_all(residual, "req")  # nothing to check
    sl.anchor.verify_all(anchor, "req")


@pytest.mark.parametrize("name", ["lynx", "int8", "int4", "int4_kivi", "fp8"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_metadata_is_rejected(name, value):
    codec, layout, sl, anchor, _ = _staged(name)
    for i in range(LAYERS):
        check_metadata(codec, sl.anchor.plane(anchor, i), layout, T, layer_name=f"L{i}")
    plane = sl.anchor.plane(anchor, 2)
    # the last fp16 of the plane is V's last minimum (group codecs) or V's last scale (fp8)
    plane[-2:].view(torch.float16)[0] = value
    with pytest.raises(NonFiniteKVError, match=r"L2\.v: anchor plane (min|scale) metadata is not finite"):
        check_metadata(codec, plane, layout, T, layer_name="L2")
    if name != "fp8":  # K's first scale sits right after K's codes
        plane = sl.anchor.plane(anchor, 1)
        nc = T * H * D * codec.bits // 8
        plane[nc:nc + 2].view(torch.float16)[0] = value
        with pytest.raises(NonFiniteKVError, match=r"L1\.k: anchor plane scale metadata"):
            check_metadata(codec, plane, layout, T, layer_name="L1")


def test_passthrough_has_no_metadata_to_check():
    codec, layout, sl, anchor, _ = _staged("bf16")
    check_metadata(codec, sl.anchor.plane(anchor, 0), layout, T)


def test_a_plane_read_as_the_other_plane_is_caught():
    """The checksum seed names the plane: an anchor region read where a residual of the same size is expected
    (or the reverse) fails, even at the same staging id, layer and size."""
    anchor_pl, residual_pl = PlaneLayout("anchor", 64, 2), PlaneLayout("residual", 64, 2)
    buf = torch.randint(0, 256, (anchor_pl.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        anchor_pl.seal(buf, layer, "req")
    anchor_pl.verify_all(buf, "req")
    with pytest.raises(IntegrityError) as e:
        residual_pl.verify(buf, 0, "req")
    assert (e.value.layer, e.value.plane) == (0, "residual")
