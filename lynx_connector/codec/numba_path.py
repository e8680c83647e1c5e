"""Dispatch of the contract functions to the numba CPU kernels (``kernels/groupquant_numba`` and its fp32 fast path
``kernels/groupquant_numba_f32``, ``kernels/groupquant_numba_kv``).

An optional fast path: numba ships with vLLM but is not a dependency of this package; without it (or with
``LYNX_CODEC_NUMBA=0``) the torch twins run. The kernels cover the group codecs with token/channel groups (Lynx,
int4, int4_kivi, int8) on every layout and cache dtype; Hadamard groups and the fp8/bf16 baselines stay on torch.
When a kernel cannot guarantee the twin's exact answer (non-finite input, values beyond the fp16 metadata range,
signed-zero ties) it declines and the caller runs the twin, which then decides (and raises where it should).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from .base import Codec, check_plane
from .groupquant import GroupQuantCodec
from .layout import BlockIds, KVLayout, TileAddr

#: The longest span (whole blocks and channel groups of K and V together) the fp32 one-pass encode takes; longer
#: ones (co-prime group sizes: lcm(997, 1009) tokens) are handed to the twin.
MAX_SPAN_TOKENS = 1 << 13
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@lru_cache(maxsize=1)
def numba_kernels() -> Any:
    """The kernel module, or None when numba is missing or disabled with ``LYNX_CODEC_NUMBA=0``."""
    if os.environ.get("LYNX_CODEC_NUMBA", "1") == "0":
        return None
    try:
        from lynx_connector.kernels import groupquant_numba_kv
    except Exception:  # numba absent or broken: the torch twins are the CPU path
        return None
    return groupquant_numba_kv  # the fp32 fast path, re-exporting the generic kernels


def _codec_key(codec: GroupQuantCodec) -> tuple[Any, ...]:
    return (codec.bits, codec.levels, codec.two_stream, codec.k_group, codec.k_tokens, codec.v_group, codec.v_tokens)


def supports_numba(codec: Codec, kv_layer: torch.Tensor, layout: KVLayout) -> bool:
    """True when the numba kernels can run ``codec`` on this cache tensor."""
    if not isinstance(codec, GroupQuantCodec) or kv_layer.device.type != "cpu" or kv_layer.dtype not in _KINDS:
        return False
    return _supports(codec.k_group, codec.v_group, layout, tuple(kv_layer.shape), kv_layer.stride())


@lru_cache(maxsize=256)
def _supports(k_group: str, v_group: str, layout: KVLayout, shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if layout.backend == "cpu" and len(shape) == 4 and stride[2:] != (2 * layout.head_size, 1):
        return False
    if any(g not in ("token", "channel") for g in (k_group, v_group)):
        return False
    if any(st <= 0 for st in stride):
        return False
    return numba_kernels() is not None


def _flat(kv_layer: torch.Tensor) -> np.ndarray:
    """The cache's storage from its first element, as unsigned bits (uint32 for fp32, uint16 otherwise)."""
    span = 1 + sum((n - 1) * s for n, s in zip(kv_layer.shape, kv_layer.stride(), strict=True))
    flat = kv_layer.detach().as_strided((span,), (1,))
    if kv_layer.dtype == torch.float32:
        return flat.view(torch.int32).numpy().view(np.uint32)
    return flat.view(torch.int16).numpy().view(np.uint16)


@lru_cache(maxsize=64)
def _tables(a: TileAddr, block_size: int, head_size: int) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """(off_t[BS], off_d[D], d contiguous, tokens contiguous): the tile_addr formula of K or V tabulated per block
    row and dim."""
    u = np.arange(block_size, dtype=np.int64)
    d = np.arange(head_size, dtype=np.int64)
    off_t = (u // a.pt) * a.s_t1 + (u % a.pt) * a.s_t0
    off_d = (d // a.pd) * a.s_d1 + (d % a.pd) * a.s_d0
    return off_t, off_d, bool(np.array_equal(off_d, d)), bool(np.array_equal(off_t, u))


_EMPTY = np.empty(0, np.uint8)


class _TensorArgs(NamedTuple):
    """One tensor's (K or V) arguments of a kernel call, in the kernels' tuple order."""

    tile_base: np.ndarray  # per block: offset of its tile for head 0
    s_head: int
    off_t: np.ndarray
    off_d: np.ndarray
    t_contig: bool
    d_contig: bool
    channel: bool  # channel groups (else token groups)
    g: int
    codes: np.ndarray
    scale: np.ndarray
    mn: np.ndarray
    res: np.ndarray

_PLANS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _plan(codec: GroupQuantCodec, kv_layer: torch.Tensor, layout: KVLayout, t: int) -> tuple[Any, ...]:
    """Everything about one (codec, layout, cache geometry, token count) that does not change between calls (plane
    sizes; per tensor K, V: address tables, plane offsets, grouping), cached: it costs tens of microseconds per
    layer call otherwise."""
    key = (_codec_key(codec), layout, tuple(kv_layer.shape), kv_layer.stride(), t)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    h, d = layout.num_heads, layout.head_size
    na, nr = codec.plane_nbytes(t, h, d, layout.dtype)
    nk = codec._tensor_nbytes(codec.k_group, codec.k_tokens, t, h, d)
    half = t * h * d // 2
    tensors = []
    for i, (kind, group, g) in enumerate((("k", codec.k_group, codec.k_tokens), ("v", codec.v_group, codec.v_tokens))):
        addr = layout.tile_addr(kv_layer, kind)  # type: ignore[arg-type]
        off_t, off_d, contig, t_contig = _tables(addr, layout.block_size, d)
        nc, ng = codec._codes_nbytes(t, h, d), codec._meta_groups(group, g, t, h, d)
        a0 = 0 if i == 0 else nk
        tensors.append((addr.s_block, addr.base, addr.s_head, off_t, off_d, contig, t_contig, a0, nc, ng,
                        (i * half, (i + 1) * half), group == "channel", g))
    plan = (na, nr, tuple(tensors))
    if len(_PLANS) > 1024:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _run(codec: GroupQuantCodec, kv_layer: torch.Tensor, block_ids: BlockIds, layout: KVLayout, num_tokens: int,
         anchor: torch.Tensor, residual: torch.Tensor | None, skip: int | None) -> bool:
    """Encode (``skip is None``) or decode rows >= skip; False when a kernel declined."""
    kernels = numba_kernels()
    t, h = num_tokens, layout.num_heads
    ids = layout._check(kv_layer, block_ids, t).numpy()
    na, nr, tensors = _plan(codec, kv_layer, layout, t)
    anchor = check_plane(anchor, na, "anchor")
    if residual is not None:
        residual = check_plane(residual, nr, "residual")
    # plane views sliced in numpy: a torch slice/view costs microseconds, which adds up per layer and tensor
    a_np = anchor.numpy()
    r_np = None if residual is None else residual.numpy()
    flat = _flat(kv_layer)
    kind_code = _KINDS[layout.dtype]
    packed, two = codec.bits == 4, residual is not None
    bs = layout.block_size
    k, v = (_TensorArgs(ids * s_block + base, s_head, off_t, off_d, t_contig, contig, channel, g, a_np[a0:a0 + nc],
                        a_np[a0 + nc:a0 + nc + 2 * ng].view(np.uint16),
                        a_np[a0 + nc + 2 * ng:a0 + nc + 4 * ng].view(np.uint16),
                        _EMPTY if r_np is None else r_np[r0:r1])
            for s_block, base, s_head, off_t, off_d, contig, t_contig, a0, nc, ng, (r0, r1), channel, g in tensors)
    if kind_code == 0:  # fp32 caches: K and V in one pass over the cache where the kernels allow
        f32 = flat.view(np.float32)
        if skip is not None:
            kernels.decode_f32_kv(f32, bs, t, h, skip, packed, two, tuple(k), tuple(v))
            return True
        # one pass over K and V, per span of whole blocks and channel groups
        span = math.lcm(bs, *(a.g for a in (k, v) if a.channel))
        if span > MAX_SPAN_TOKENS:  # co-prime group sizes: the span's prefetch would take GiBs; the twin encodes
            return False
        return kernels.encode_f32_kv(f32, bs, t, h, span, codec.levels, packed, two, tuple(k), tuple(v)) == kernels.OK
    for a in (k, v):  # bf16/fp16 caches: the generic kernels, one tensor at a time
        if skip is None:
            status = kernels.encode_tensor(flat, kind_code, a.tile_base, a.s_head, a.off_t, a.off_d, a.d_contig, bs,
                                           t, h, a.channel, a.g, codec.levels, packed, two, a.codes, a.scale, a.mn,
                                           a.res)
        else:
            status = kernels.decode_tensor(flat, kind_code, a.tile_base, a.s_head, a.off_t, a.off_d, a.d_contig, bs,
                                           t, h, skip, a.channel, a.g, packed, two, a.codes, a.scale, a.mn, a.res)
        if status != kernels.OK:
            return False
    return True


def encode_numba(codec: Codec, kv_layer: torch.Tensor, block_ids: BlockIds, layout: KVLayout, num_tokens: int,
                 anchor_out: torch.Tensor, residual_out: torch.Tensor | None) -> bool:
    """Encode straight from the paged cache; False (planes unspecified) when the torch twin must decide."""
    assert isinstance(codec, GroupQuantCodec)
    return _run(codec, kv_layer, block_ids, layout, num_tokens, anchor_out,
                residual_out if codec.two_stream else None, None)


def decode_numba(codec: Codec, anchor: torch.Tensor, residual: torch.Tensor | None, kv_layer: torch.Tensor,
                 block_ids: BlockIds, layout: KVLayout, num_tokens: int, skip_tokens: int = 0) -> None:
    """Write anchor (or, with ``residual``, full) values of rows ``skip_tokens <= t < num_tokens`` into the cache."""
    assert isinstance(codec, GroupQuantCodec)
    _run(codec, kv_layer, block_ids, layout, num_tokens, anchor, residual, skip_tokens)
