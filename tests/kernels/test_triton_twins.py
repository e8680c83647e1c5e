"""The Triton kernels (CPU interpreter, small shapes, few programs) against their torch twins: identical planes
from encode, byte-identical caches from decode and merge, for every layout, dtype and grouping.

With ``LYNX_TEST_DEVICE=cuda`` the same cases run compiled on a GPU, tensors on the device, no interpreter
(benchmarks/gpu/kernel_check.sh runs them so on the lent GPU machine)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from lynx_connector.codec import (
    KVLayout,
    KVRangeError,
    NonFiniteKVError,
    decode_anchor,
    encode,
    get_codec,
    merge_residual,
    plane_nbytes,
)
from tests.rerun import rerun_in_subprocess

triton = pytest.importorskip("triton")

# Triton runs on CPU only in its interpreter, chosen from TRITON_INTERPRET when the kernels are decorated (and
# read when triton is imported). The flag must not leak into the rest of the session (vLLM, imported by other
# tests, behaves differently under it), so in the main session one test re-runs this file in a subprocess
# with the flag set, and the cases below run only there.
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = os.environ.get("LYNX_TEST_DEVICE") == "cuda"
DEV = "cuda" if ON_CUDA else "cpu"
pytestmark = pytest.mark.triton
interpreter_only = pytest.mark.skipif(not (IN_INTERPRETER or ON_CUDA),
                                      reason="runs in the interpreter subprocess (or with LYNX_TEST_DEVICE=cuda)")


def test_the_asked_device_is_there() -> None:
    """LYNX_TEST_DEVICE=cuda on a machine without CUDA must fail, not skip every case."""
    assert not ON_CUDA or torch.cuda.is_available(), "LYNX_TEST_DEVICE=cuda but torch sees no CUDA device"



def _encode_both(codec, src, ids, layout, t):
    """Encode with the torch twin and the Triton kernel; their planes must be bit-identical (returns torch's)."""
    na, nr = plane_nbytes(codec, layout, t)
    planes = {}
    for impl in ("torch", "triton"):
        a, r = torch.zeros(na, dtype=torch.uint8, device=DEV), torch.zeros(nr, dtype=torch.uint8, device=DEV)
        encode(codec, src, ids, layout, t, a, r, impl=impl)
        planes[impl] = (a, r)
    assert torch.equal(planes["torch"][0], planes["triton"][0])
    assert torch.equal(planes["torch"][1], planes["triton"][1])
    return planes["torch"]

@pytest.mark.skipif(IN_INTERPRETER or ON_CUDA, reason="this is the subprocess, or the cases run on CUDA")
@pytest.mark.timeout(900)
def test_triton_twins_in_the_interpreter() -> None:
    out = rerun_in_subprocess(__file__, {"TRITON_INTERPRET": "1"}, timeout=880)
    assert re.search(r"\b[1-9][0-9]* passed", out), out[-4000:]


H, BS = 2, 32
CASES = [
    ("cpu", "vec", torch.float32, 64, "channel", "token"),
    ("cpu", "vec16", torch.float16, 64, "token", "channel"),
    ("cpu", "amx", torch.bfloat16, 64, "channel", "channel"),
    ("cpu", "amx", torch.float16, 128, "token", "token"),
    ("cpu", "vec", torch.bfloat16, 256, "channel", "channel"),
    ("flash", None, torch.bfloat16, 64, "channel", "channel"),
    ("flash", None, torch.float32, 128, "token", "channel"),
    # head sizes whose half is not a power of two (Phi-2's 80, Phi-3's 96): padded columns, masked
    ("flash", None, torch.bfloat16, 96, "channel", "token"),
    ("cpu", "vec16", torch.float16, 80, "token", "channel"),
]


def _layout(backend, isa, dtype, d):
    return KVLayout.cpu(H, BS, d, dtype, isa=isa) if backend == "cpu" else KVLayout.flash(H, BS, d, dtype)


@interpreter_only
@pytest.mark.parametrize(("backend", "isa", "dtype", "d", "kg", "vg"), CASES)
def test_triton_bit_exact(backend, isa, dtype, d, kg, vg) -> None:
    gen = torch.Generator().manual_seed(d)
    src = (torch.randn(5, H, BS, 2 * d, generator=gen) * 3).to(dtype).to(DEV)
    src[1, 0, :, :8] = 0.5  # constant stretches
    layout = _layout(backend, isa, dtype, d)
    codec = get_codec("lynx", k_group=kg, v_group=vg, k_group_tokens=32, v_group_tokens=16)
    t, ids = 2 * BS + 11, [3, 1, 4]  # ragged channel group and partial block
    a, r = _encode_both(codec, src, ids, layout, t)
    base = torch.randn(src.shape, generator=gen).to(dtype).to(DEV)
    for merge in (False, True):
        outs = []
        for impl in ("torch", "triton"):
            dst = base.clone()
            if merge:
                merge_residual(codec, a, r, dst, ids, layout, t, impl=impl)
            else:
                decode_anchor(codec, a, dst, ids, layout, t, impl=impl)
            outs.append(dst.view(torch.uint8))
        assert torch.equal(outs[0], outs[1])


@interpreter_only
def test_triton_top_of_an_fp16_cache_is_finite_and_the_twins() -> None:
    """65504 in an fp16 cache: the top level mn + 15 s (s rounded up) lies above it; Triton writes 65504, not inf,
    bit for bit as the torch twin."""
    layout = KVLayout.cpu(H, BS, 64, torch.float16, isa="vec16")
    src = torch.zeros(2, H, BS, 128, dtype=torch.float16)
    src[..., 0], src[..., 64] = 65504.0, -65504.0
    src = src.to(DEV)
    codec = get_codec("lynx")
    a, r = _encode_both(codec, src, [0, 1], layout, 2 * BS)
    outs = []
    for impl in ("torch", "triton"):
        dst = torch.zeros_like(src)
        decode_anchor(codec, a, dst, [0, 1], layout, 2 * BS, impl=impl)
        assert bool(torch.isfinite(dst).all())
        outs.append(dst.view(torch.uint8))
    assert torch.equal(outs[0], outs[1])


@interpreter_only
def test_triton_int4_and_nonfinite() -> None:
    layout = KVLayout.cpu(H, BS, 64, torch.float32, isa="vec")
    src = torch.randn(3, H, BS, 128).to(DEV)
    for name in ("int4", "int4_kivi"):
        codec = get_codec(name)
        na, _ = plane_nbytes(codec, layout, BS)
        a1, a2 = torch.zeros(na, dtype=torch.uint8, device=DEV), torch.zeros(na, dtype=torch.uint8, device=DEV)
        encode(codec, src, [2], layout, BS, a1, impl="torch")
        encode(codec, src, [2], layout, BS, a2, impl="triton")
        assert torch.equal(a1, a2)
    src[2, 1, 5, 3] = float("inf")
    codec = get_codec("lynx")
    na, nr = plane_nbytes(codec, layout, BS)
    with pytest.raises(NonFiniteKVError):
        encode(codec, src, [2], layout, BS, torch.zeros(na, dtype=torch.uint8, device=DEV),
               torch.zeros(nr, dtype=torch.uint8, device=DEV), impl="triton")


@interpreter_only
@pytest.mark.parametrize(("backend", "dtype"), [("cpu", torch.float32), ("flash", torch.bfloat16)])
def test_triton_default_lynx_one_head_256(backend, dtype) -> None:
    """The default Lynx grouping (LYNX_DEFAULTS) on one KV head of 256 with K outlier channels and a sink token:
    Triton's planes and caches equal the torch twin's (issue 17.3)."""
    d, t, ids = 256, 3 * BS + 7, [5, 2, 0, 3]
    layout = KVLayout.cpu(1, BS, d, dtype, isa="vec") if backend == "cpu" else KVLayout.flash(1, BS, d, dtype)
    gen = torch.Generator().manual_seed(17)
    src = torch.randn(6, 1, BS, 2 * d, generator=gen)
    src[..., [3, 77, 200]] *= 40.0  # K outlier channels
    src[5, 0, 0, :d] *= 8.0  # block 5 holds the first token: a sink with a large K
    src = src.to(dtype).to(DEV)
    codec = get_codec("lynx")
    a, r = _encode_both(codec, src, ids, layout, t)
    for merge in (False, True):
        outs = []
        for impl in ("torch", "triton"):
            dst = torch.zeros_like(src)
            decode_anchor(codec, a, dst, ids, layout, t, impl=impl)
            if merge:
                merge_residual(codec, a, r, dst, ids, layout, t, impl=impl)
            outs.append(dst.view(torch.uint8))
        assert torch.equal(outs[0], outs[1])


@interpreter_only
@pytest.mark.parametrize(("h", "t"), [(1, 1), (3, 5)])
def test_triton_odd_metadata_offset(h, t) -> None:
    """head_size 2 with an odd h*t: the K codes end at an odd byte, so the fp16 metadata the kernels write and read
    sits at an odd offset of the anchor plane (aligned copies in the dispatch); planes and caches equal the twin's."""
    layout = KVLayout.flash(h, BS, 2, torch.float32)
    gen = torch.Generator().manual_seed(h)
    src = torch.randn(2, h, BS, 4, generator=gen).to(DEV)
    for kg in ("token", "channel"):
        codec = get_codec("lynx", k_group=kg, v_group="token", k_group_tokens=16)
        a, r = _encode_both(codec, src, [1], layout, t)
        outs = []
        for impl in ("torch", "triton"):
            dst = torch.zeros_like(src)
            merge_residual(codec, a, r, dst, [1], layout, t, impl=impl)
            outs.append(dst.view(torch.uint8))
        assert torch.equal(outs[0], outs[1])
        want, got = layout.gather(src, [1], t), layout.gather(dst, [1], t)
        assert all(float((g - w).abs().max()) < 0.05 for g, w in zip(got, want, strict=True))


@interpreter_only
@pytest.mark.parametrize(("value", "col", "error"), [(70000.0, 2, KVRangeError), (-65510.0, 12, KVRangeError),
                                                     (float("nan"), 2, NonFiniteKVError),
                                                     (float("nan"), 12, NonFiniteKVError), (65504.0, 2, None)])
def test_triton_refuses_what_the_twin_refuses(value, col, error) -> None:
    """KV past fp16's range is refused as the twin refuses it (KVRangeError; Triton encoded 70000 silently and
    called -65510 non-finite), NaN as non-finite (min and max skip it: Triton encoded it silently); 65504 itself, whose top level the metadata rounds past 65504,
    encodes to the twin's planes."""
    layout = KVLayout.flash(1, 16, 8, torch.float32)
    src = torch.randn(2, 1, 16, 16)
    src[1, 0, 3, col] = value  # K (channel groups) or V (token groups)
    src = src.to(DEV)
    codec = get_codec("lynx")
    if error is None:
        _encode_both(codec, src, [1], layout, 16)
        return
    na, nr = plane_nbytes(codec, layout, 16)
    for impl in ("torch", "triton"):
        with pytest.raises(error):
            encode(codec, src, [1], layout, 16, torch.zeros(na, dtype=torch.uint8, device=DEV),
                   torch.zeros(nr, dtype=torch.uint8, device=DEV), impl=impl)


def test_triton_takes_channel_groups_up_to_its_limit_only() -> None:
    """A channel group longer than TRITON_MAX_GROUP_TOKENS is no Triton case (one program's tile would exceed
    Triton's tensor size: 65536-token groups failed to compile); the torch twin encodes it on the GPU."""
    from lynx_connector.codec.triton_path import TRITON_MAX_GROUP_TOKENS, supports_triton

    assert supports_triton(get_codec("lynx"))
    assert supports_triton(get_codec("lynx", k_group_tokens=TRITON_MAX_GROUP_TOKENS))
    assert not supports_triton(get_codec("lynx", k_group_tokens=2 * TRITON_MAX_GROUP_TOKENS))
    assert not supports_triton(get_codec("lynx", k_group_tokens=48))
    assert supports_triton(get_codec("lynx", k_group="token", v_group="token", group_tokens=4096))  # unused there
