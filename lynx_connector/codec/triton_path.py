"""Dispatch of the contract functions to the Triton kernels (GPU, or the CPU interpreter in tests).

Only 4-bit group codecs with token/channel groups have kernels (Lynx, int4, int4_kivi); the Hadamard
grouping, int8 and the fp8/bf16 baselines run through the torch path. Non-finite input cannot raise inside
a kernel, so it is detected afterwards from the fp16 metadata (NaN/inf min or scale) before the planes leave.
"""

from __future__ import annotations

import torch

from lynx_connector.kernels.errors import NonFiniteKVError

from .base import Codec, check_plane
from .groupquant import GroupQuantCodec
from .layout import BlockIds, KVLayout


def supports_triton(codec: Codec) -> bool:
    """True when ``codec`` has Triton kernels (4-bit, token/channel groups, power-of-two group_tokens)."""
    if not isinstance(codec, GroupQuantCodec) or codec.bits != 4:
        return False
    pow2 = all(g & (g - 1) == 0 for g in (codec.k_tokens, codec.v_tokens))
    return all(x in ("token", "channel") for x in (codec.k_group, codec.v_group)) and pow2


def _parts(codec: GroupQuantCodec, anchor, residual, t: int, h: int, d: int):
    """Per tensor (K, V): (group, group_tokens, codes, residual codes | None, scale, min, its anchor bytes)."""
    na, nr = codec.plane_nbytes(t, h, d, torch.float32)
    anchor = check_plane(anchor, na, "anchor")
    if residual is not None:
        residual = check_plane(residual, nr, "residual")
    nk = codec._tensor_nbytes(codec.k_group, codec.k_tokens, t, h, d)
    half = t * h * d // 2
    out = []
    tensors = ((codec.k_group, codec.k_tokens, anchor[:nk]), (codec.v_group, codec.v_tokens, anchor[nk:]))
    for i, (group, g, abuf) in enumerate(tensors):
        codes, scale, mn = codec._split(abuf, group, g, t, h, d)
        res = None if residual is None else residual[i * half:(i + 1) * half]
        out.append((group, g, codes, res, scale, mn, abuf))
    return out


def _ids(kv_layer: torch.Tensor, block_ids: BlockIds, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    return layout._check(kv_layer, block_ids, num_tokens).contiguous()


def encode_triton(
    codec: Codec, kv_layer: torch.Tensor, block_ids: BlockIds, layout: KVLayout, num_tokens: int,
    anchor_out: torch.Tensor, residual_out: torch.Tensor | None, layer_name: str, block_rows: int = 64,
) -> None:
    """Encode straight from the paged cache with ``encode_kernel``."""
    from lynx_connector.kernels.lynx_triton import encode_paged

    assert isinstance(codec, GroupQuantCodec)
    t, h, d = num_tokens, layout.num_heads, layout.head_size
    ids = _ids(kv_layer, block_ids, layout, t)
    if t == 0:
        return
    for kind, (group, g, codes, res, scale, mn, abuf) in zip(
        "kv", _parts(codec, anchor_out, residual_out if codec.two_stream else None, t, h, d), strict=True
    ):
        encode_paged(kv_layer, ids, layout.tile_addr(kv_layer, kind), t, h, layout.block_size, d, codes, res,
                     scale, mn, group == "channel", g, block_rows)
        codec._commit(abuf, group, g, t, h, d, scale, mn)
        if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(mn).all())):
            raise NonFiniteKVError(f"{layer_name}.{kind}: KV contains NaN/inf or exceeds the fp16 metadata range")


def decode_triton(
    codec: Codec, anchor: torch.Tensor, residual: torch.Tensor | None, kv_layer: torch.Tensor,
    block_ids: BlockIds, layout: KVLayout, num_tokens: int, block_rows: int = 64,
) -> None:
    """Write anchor or full values straight into the paged cache with ``decode_kernel``."""
    from lynx_connector.kernels.lynx_triton import decode_paged

    assert isinstance(codec, GroupQuantCodec)
    t, h, d = num_tokens, layout.num_heads, layout.head_size
    ids = _ids(kv_layer, block_ids, layout, t)
    if t == 0:
        return
    for kind, (group, g, codes, res, scale, mn, _) in zip("kv", _parts(codec, anchor, residual, t, h, d), strict=True):
        decode_paged(kv_layer, ids, layout.tile_addr(kv_layer, kind), t, h, layout.block_size, d, codes, res,
                     scale, mn, group == "channel", g, block_rows)
