"""The codec contract on paged KV: round trips within each codec's bound, block ids in any order, idempotence,
untouched blocks and rows beyond num_tokens, non-finite input rejected, plane sizes and wire bits."""

from __future__ import annotations

import pytest
import torch

from lynx_connector.codec import (
    CODEC_NAMES,
    KVLayout,
    NonFiniteKVError,
    decode_anchor,
    encode,
    get_codec,
    merge_residual,
    plane_nbytes,
)

H, BS = 2, 32


def _setup(dtype: torch.dtype, head_size: int = 64, isa: str = "vec", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(6, H, BS, 2 * head_size, generator=gen) * 2).to(dtype)
    return src, KVLayout.cpu(H, BS, head_size, dtype, isa=isa)


def _planes(codec, layout, t):
    a, r = plane_nbytes(codec, layout, t)
    return torch.zeros(a, dtype=torch.uint8), (torch.zeros(r, dtype=torch.uint8) if r else None)


def _max_rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).abs().max() / x.float().abs().max())


# worst-case |err| / max|x| per codec (groups span at most 2*max|x|): half a step, plus dtype rounding
BOUNDS = {"lynx": 2 / 15 / 2 + 0.01, "int4": 2 / 15 / 2 + 0.01, "int4_kivi": 2 / 15 / 2 + 0.01,
          "int8": 2 / 255 / 2 + 0.01, "fp8": 2**-4 + 0.01, "bf16": 0.0}


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_bound(name: str, dtype: torch.dtype) -> None:
    src, layout = _setup(dtype)
    codec, t, ids = get_codec(name), 3 * BS + 5, [5, 2, 0, 3]
    anchor, residual = _planes(codec, layout, t)
    encode(codec, src, ids, layout, t, anchor, residual)
    dst = torch.zeros_like(src)
    decode_anchor(codec, anchor, dst, ids, layout, t)
    (k, v), (k2, v2) = layout.gather(src, ids, t), layout.gather(dst, ids, t)
    for x, y in ((k, k2), (v, v2)):
        if name == "bf16":
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        else:
            assert _max_rel_err(x, y) <= BOUNDS[name]
    if codec.two_stream:
        merge_residual(codec, anchor, residual, dst, ids, layout, t)
        (k3, v3) = layout.gather(dst, ids, t)
        tol = 2 / 15 / 32 + (2**-8 if dtype == torch.bfloat16 else 2**-10)
        assert _max_rel_err(k, k3) <= tol and _max_rel_err(v, v3) <= tol


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_untouched_rows_blocks_and_idempotence(head_size: int, isa: str) -> None:
    src, layout = _setup(torch.bfloat16, head_size, isa, seed=head_size)
    codec, t, ids = get_codec("lynx"), 2 * BS + 9, [4, 1, 3, 0]  # 3 blocks used; id 0 listed but unused
    anchor, residual = _planes(codec, layout, t)
    encode(codec, src, ids, layout, t, anchor, residual)
    a2, r2 = anchor.clone(), residual.clone()
    encode(codec, src, ids, layout, t, a2, r2)
    assert torch.equal(anchor, a2) and torch.equal(residual, r2)
    dst = torch.randn_like(src.float()).to(src.dtype)
    before = dst.clone()
    decode_anchor(codec, anchor, dst, ids, layout, t)
    merge_residual(codec, anchor, residual, dst, ids, layout, t)
    once = dst.clone()
    merge_residual(codec, anchor, residual, dst, ids, layout, t)
    assert torch.equal(dst.view(torch.uint8), once.view(torch.uint8))
    for b in (0, 2, 5):  # not used
        assert torch.equal(dst[b].view(torch.int16), before[b].view(torch.int16))
    k_new, _ = layout.gather(dst, [3], BS)
    k_old, _ = layout.gather(before, [3], BS)
    tail = t - 2 * BS
    assert torch.equal(k_new[tail:].view(torch.int16), k_old[tail:].view(torch.int16))


def test_block_order_is_respected() -> None:
    src, layout = _setup(torch.float32)
    codec, t = get_codec("lynx"), 2 * BS
    a1, r1 = _planes(codec, layout, t)
    a2, r2 = _planes(codec, layout, t)
    encode(codec, src, [1, 4], layout, t, a1, r1)
    swapped = src.clone()
    swapped[[1, 4]] = src[[4, 1]]
    encode(codec, swapped, [4, 1], layout, t, a2, r2)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rejected(name: str, bad: float) -> None:
    src, layout = _setup(torch.float32)
    src[2, 1, 3, 70] = bad  # a V value of block 2
    codec = get_codec(name)
    anchor, residual = _planes(codec, layout, BS)
    with pytest.raises(NonFiniteKVError, match="layer7"):
        encode(codec, src, [2], layout, BS, anchor, residual, layer_name="layer7")


def test_plane_sizes_and_bits() -> None:
    layout = KVLayout.cpu(3, BS, 64, torch.bfloat16, isa="vec")
    bits = {n: get_codec(n).bits_per_value(1024, 3, 64, torch.bfloat16) for n in CODEC_NAMES}
    assert bits["lynx"][0] <= 4.6 and bits["lynx"][1] <= 8.6
    assert bits["int4"] == (4.5, 4.5) and bits["int8"] == (8.5, 8.5) and bits["bf16"] == (16.0, 16.0)
    assert bits["fp8"] == (8.25, 8.25) and bits["int4_kivi"] == (4.5, 4.5)
    assert plane_nbytes(get_codec("int4"), layout, 10)[1] == 0
    with pytest.raises(ValueError):
        get_codec("nope")
    with pytest.raises(ValueError):
        merge_residual(get_codec("int8"), torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8),
                       torch.zeros(1, H, BS, 128), [0], KVLayout.cpu(H, BS, 64, torch.float32, isa="vec"), 1)


@pytest.mark.parametrize("opts", [{"k_group": "token", "v_group": "token"}, {"k_group": "hadamard", "v_group": "hadamard"},
                                  {"group_tokens": 64}, {"k_group_tokens": 16, "v_group": "token"}])
def test_groupings_selectable(opts: dict) -> None:
    src, layout = _setup(torch.float32)
    codec, t, ids = get_codec("lynx", **opts), BS + 3, [3, 1]
    anchor, residual = _planes(codec, layout, t)
    encode(codec, src, ids, layout, t, anchor, residual)
    dst = torch.zeros_like(src)
    merge_residual(codec, anchor, residual, dst, ids, layout, t)
    (k, v), (k2, v2) = layout.gather(src, ids, t), layout.gather(dst, ids, t)
    assert _max_rel_err(k, k2) < 0.01 and _max_rel_err(v, v2) < 0.01


def test_zero_tokens_is_noop() -> None:
    src, layout = _setup(torch.float32)
    codec = get_codec("lynx")
    anchor, residual = _planes(codec, layout, 0)
    encode(codec, src, [], layout, 0, anchor, residual)
    before = src.clone()
    decode_anchor(codec, anchor, src, [], layout, 0)
    assert torch.equal(src, before)


def test_skip_blocks_leaves_prefix_cache_blocks_untouched():
    """D's local prefix-cache hits are shared blocks: decoding must not write them."""
    import torch

    from lynx_connector.codec import KVLayout, decode_anchor, encode, get_codec, merge_residual

    torch.manual_seed(3)
    layout = KVLayout.cpu(2, 32, 64, torch.float32, isa="vec")
    kv = torch.randn(8, 2, 32, 128)
    codec = get_codec("lynx")
    n = 80
    a, r = codec.plane_nbytes(n, 2, 64, torch.float32)
    pa, pr = torch.empty(a, dtype=torch.uint8), torch.empty(r, dtype=torch.uint8)
    encode(codec, kv, [5, 1, 6], layout, n, pa, pr)
    dst = torch.randn(8, 2, 32, 128)
    before = dst.clone()
    merge_residual(codec, pa, pr, dst, [2, 3, 4], layout, n, skip_blocks=1)
    assert torch.equal(dst[2], before[2])  # skipped
    ref = dst.clone()
    merge_residual(codec, pa, pr, ref, [2, 3, 4], layout, n)
    assert torch.equal(dst[3:5], ref[3:5]) and not torch.equal(ref[2], before[2])
    decode_anchor(codec, pa, dst, [2, 3, 4], layout, n, skip_blocks=2)
    assert torch.equal(dst[3], ref[3])  # skipped this time
    assert not torch.equal(dst[4], ref[4])  # written at anchor precision


@pytest.mark.parametrize("name", ["int8", "lynx", "int4_kivi"])
def test_planes_do_not_depend_on_the_chunk_size(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path quantizes in token chunks (small on the CPU, large on a GPU: groupquant.GPU_CHUNK_ELEMS);
    the planes and the decoded cache are the same whatever the chunk, channel groups included."""
    from lynx_connector.codec import groupquant

    src, layout = _setup(torch.float32)
    codec = get_codec(name)
    t, ids = 5 * BS - 3, [4, 0, 2, 5, 1]
    out = []
    for elems in (groupquant.CHUNK_ELEMS, H * 64 * 8, 1 << 24):  # the default, 8 tokens, all tokens at once
        monkeypatch.setattr(groupquant, "CHUNK_ELEMS", elems)
        a, r = _planes(codec, layout, t)
        encode(codec, src, ids, layout, t, a, r, impl="torch")
        dst = torch.zeros_like(src)
        (merge_residual(codec, a, r, dst, ids, layout, t, impl="torch") if r is not None
         else decode_anchor(codec, a, dst, ids, layout, t, impl="torch"))
        out.append((a, r, dst))
    for a, r, dst in out[1:]:
        assert torch.equal(a, out[0][0]) and torch.equal(dst, out[0][2])
        assert r is None or torch.equal(r, out[0][1])


def test_kernel_path_names_what_encode_runs() -> None:
    """The worker logs ``kernel_path`` at start-up for the real cache: the CPU's numba kernels for the group
    quantizers on a cache they can address, the torch twin otherwise (the passthrough, a cache whose rows are
    not contiguous)."""
    from lynx_connector.codec import kernel_path
    from lynx_connector.codec.numba_path import numba_kernels

    src, layout = _setup(torch.float32)
    if numba_kernels() is None:
        pytest.skip("numba is not installed")
    assert kernel_path(get_codec("lynx"), src, layout) == "numba"
    assert kernel_path(get_codec("int8"), src, layout) == "numba"
    assert kernel_path(get_codec("bf16"), src, layout) == "torch"
    strided = torch.zeros(*src.shape[:3], 4 * src.shape[3])[..., ::2]  # same shape, rows not contiguous
    assert kernel_path(get_codec("lynx"), strided, layout) == "torch"


def test_a_head_size_the_hadamard_grouping_cannot_take_fails_at_start_up() -> None:
    """Hadamard needs a power-of-two head size: a Lynx codec with it on a model of head size 80 or 96 (accepted
    until then) is refused when sizes are computed and by the start-up compat, not at every request's encode."""
    from lynx_connector.compat import kv_compat

    codec = get_codec("lynx", k_group="hadamard")
    assert codec.plane_nbytes(16, 2, 64, torch.bfloat16)[0] > 0
    for d in (80, 96):
        with pytest.raises(ValueError, match="power-of-two head size, got"):
            codec.plane_nbytes(16, 2, d, torch.bfloat16)
        with pytest.raises(ValueError, match="hadamard"):
            kv_compat(model="m", layer_names=["l0"], layout=KVLayout.flash(2, 16, d, torch.bfloat16),
                      codec_options={"k_group": "hadamard"}, tp_rank=0, tp_size=1)
    kv_compat(model="m", layer_names=["l0"], layout=KVLayout.flash(2, 16, 96, torch.bfloat16), codec_options={},
              tp_rank=0, tp_size=1)  # the default grouping takes any even head size


def test_group_sizes_are_bounded_and_co_prime_channel_groups_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel group costs memory in its length, not the prompt's (2^20 tokens took GiBs for one token): options
    past MAX_GROUP_TOKENS are refused; co-prime K and V groups, whose common span would make numba's one-pass fp32
    encode allocate GiBs, are handed to the twin (same planes)."""
    from lynx_connector.codec import groupquant, numba_path

    with pytest.raises(ValueError, match="k_group_tokens must be an integer in"):
        get_codec("lynx", k_group_tokens=groupquant.MAX_GROUP_TOKENS + 1)
    if numba_path.numba_kernels() is None:
        pytest.skip("numba unavailable")
    codec = get_codec("lynx", k_group="channel", v_group="channel", k_group_tokens=997, v_group_tokens=1009)
    layout = KVLayout.flash(1, 16, 8, torch.float32)
    src = torch.randn(3, 1, 16, 16)
    na, nr = plane_nbytes(codec, layout, 20)
    planes = []
    for impl in ("torch", "numba"):
        a, r = torch.zeros(na, dtype=torch.uint8), torch.zeros(nr, dtype=torch.uint8)
        encode(codec, src, [2, 0], layout, 20, a, r, impl=impl)
        planes.append((a, r))
    assert torch.equal(planes[0][0], planes[1][0]) and torch.equal(planes[0][1], planes[1][1])
    a, r = torch.zeros(na, dtype=torch.uint8), torch.zeros(nr, dtype=torch.uint8)
    assert numba_path.encode_numba(codec, src, [2, 0], layout, 20, a, r) is False  # handed to the twin
