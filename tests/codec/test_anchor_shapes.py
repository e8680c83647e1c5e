"""The Lynx default anchor on shapes other than the benchmark model's (issue 17.3): one KV head, head_dim 256, K
with outlier channels and an attention-sink token, through the real encode/decode path over a paged cache.

Synthetic KV shaped like real models' (a few K channels tens of times larger than the rest, the first token a sink
with a large K and a near-zero V) and queries that attend through the outlier channels. The anchor must not
collapse there (attention-output error well below per-token int4's), the full precision must stay within the lynx
full target (vNMSE <= 5e-5), and every CPU implementation must write the same cache.
"""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import KVLayout, decode_anchor, decode_full, encode, get_codec, plane_nbytes
from lynx_connector.codec.numba_path import numba_kernels

BS = 32
FULL_TARGET = 5e-5
SINK_LOGIT = 6.0  # the sink's score above the rest: about a third of the attention over 300 tokens
SHAPES = [(1, 256), (1, 64), (4, 128)]  # (kv heads, head_dim)
IMPLS = ["torch"] + (["numba"] if numba_kernels() is not None else [])


def _kv(t: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V [t, h, d] and queries [32, h, d]: outlier K channels, a sink first token."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=gen)
    out = torch.randperm(d, generator=gen)[: max(2, d // 32)]
    k[:, :, out] = k[:, :, out] * 4 + 25.0 * torch.sign(torch.randn(len(out), generator=gen))  # K outlier channels
    q = torch.randn(32, h, d, generator=gen) * 0.3
    q[:, :, out] = 0.3
    # the sink: its K lies further out along the outlier channels, so it scores SINK_LOGIT above the others and
    # draws a large share of every query's attention; its V is close to zero
    k[0] = k[0] * 0.2
    k[0, :, out] = k[1:, :, out].mean(0) + SINK_LOGIT * d**0.5 / (0.3 * len(out))
    v = torch.randn(t, h, d, generator=gen)
    v[0] = v[0] * 0.05
    return k, v, q


def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = torch.einsum("qhd,thd->hqt", q.double(), k.double()) / k.shape[-1] ** 0.5
    return torch.einsum("hqt,thd->hqd", s.softmax(-1), v.double())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).pow(2).sum() / b.double().pow(2).sum())


def _roundtrip(codec, k, v, h, d, impl, full):
    t = k.shape[0]
    layout = KVLayout.cpu(h, BS, d, torch.float32, isa="vec")
    nb = -(-t // BS) + 2
    ids = list(range(nb - 1, 0, -1))[: -(-t // BS)]  # blocks in a scrambled order
    src = torch.zeros(nb, h, BS, 2 * d)
    layout.scatter(src, ids, t, k, v)
    na, nr = plane_nbytes(codec, layout, t)
    anchor, residual = torch.zeros(na, dtype=torch.uint8), torch.zeros(nr, dtype=torch.uint8)
    encode(codec, src, ids, layout, t, anchor, residual if codec.two_stream else None, impl=impl)
    dst = torch.full_like(src, 7.0)
    if full:
        decode_full(codec, anchor, residual, dst, ids, layout, t, impl=impl)
    else:
        decode_anchor(codec, anchor, dst, ids, layout, t, impl=impl)
    return layout.gather(dst, ids, t)


@pytest.mark.parametrize(("h", "d"), SHAPES)
def test_default_anchor_does_not_collapse_on_outlier_channels(h: int, d: int) -> None:
    k, v, q = _kv(300, h, d, seed=d + h)
    ref = _attn(q, k, v)
    errs = {}
    for name in ("lynx", "int4"):
        ka, va = _roundtrip(get_codec(name), k, v, h, d, "torch", full=False)
        assert torch.isfinite(ka).all() and torch.isfinite(va).all()
        errs[name] = _rel(_attn(q, ka, va), ref)
    assert errs["lynx"] < 0.5 * errs["int4"], errs  # per-channel K keeps the outlier channels' range to themselves
    assert errs["lynx"] < 2e-2, errs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("h", "d"), SHAPES)
def test_default_full_precision_meets_the_target(h: int, d: int, impl: str) -> None:
    k, v, q = _kv(300, h, d, seed=2 * d + h)
    kf, vf = _roundtrip(get_codec("lynx"), k, v, h, d, impl, full=True)
    assert _rel(kf, k) <= FULL_TARGET and _rel(vf, v) <= FULL_TARGET
    ka, va = _roundtrip(get_codec("lynx"), k, v, h, d, impl, full=False)
    ref = _attn(q, k, v)
    full_err = _rel(_attn(q, kf, vf), ref)  # the near-zero sink value makes this ratio a little above the KV's
    assert full_err <= 4 * FULL_TARGET and full_err <= _rel(_attn(q, ka, va), ref) / 50


@pytest.mark.skipif(len(IMPLS) < 2, reason="numba missing")
@pytest.mark.parametrize(("h", "d"), SHAPES)
def test_default_anchor_same_cache_on_every_cpu_impl(h: int, d: int) -> None:
    k, v, _ = _kv(2 * BS + 5, h, d, seed=3 * d + h)
    outs = [_roundtrip(get_codec("lynx"), k, v, h, d, impl, full=False) for impl in IMPLS]
    for got in outs[1:]:
        assert torch.equal(got[0], outs[0][0]) and torch.equal(got[1], outs[0][1])


def test_default_anchor_fits_the_wire_budget() -> None:
    codec = get_codec("lynx")
    for t, h, d in ((1024, 3, 64), (1024, 1, 256), (4096, 8, 128)):
        anchor_bits, full_bits = codec.bits_per_value(t, h, d, torch.float32)
        assert anchor_bits <= 4.6, (t, h, d, anchor_bits)
        assert full_bits == pytest.approx(anchor_bits + 4.0)


@pytest.mark.parametrize(("h", "d"), SHAPES)
def test_default_anchor_plane_is_int4_kivis_plane(h: int, d: int) -> None:
    """The default anchor is int4_kivi's format byte for byte (K channel/64, V per token, the same fp16 metadata):
    the benchmarks read int4_kivi's accuracy rows as the anchor's (benchmarks/README.md, "Anchor format")."""
    t = 3 * BS + 7
    k, v, _ = _kv(t, h, d, seed=7 * d + h)
    layout = KVLayout.cpu(h, BS, d, torch.float32, isa="vec")
    ids = [4, 0, 2, 1]
    src = torch.zeros(6, h, BS, 2 * d)
    layout.scatter(src, ids, t, k, v)
    planes = []
    for name in ("lynx", "int4_kivi"):
        codec = get_codec(name)
        na, nr = plane_nbytes(codec, layout, t)
        anchor = torch.zeros(na, dtype=torch.uint8)
        encode(codec, src, ids, layout, t, anchor, torch.zeros(nr, dtype=torch.uint8) if nr else None)
        planes.append(anchor)
    assert torch.equal(planes[0], planes[1])
