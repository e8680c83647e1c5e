"""Dispatch of the contract functions to the Triton kernels (GPU, or the CPU interpreter in tests).

Only 4-bit group codecs with token/channel groups have kernels (Lynx, int4, int4_kivi); the Hadamard
grouping, int8 and the fp8/bf16 baselines run through the torch path. Non-finite or out-of-range input cannot
raise inside a kernel: the fp16 metadata tells afterwards (NaN/inf min or scale, a top level past 65504), and such
a layer is encoded again by the twin, which raises the error it defines, before the planes leave.
"""

from __future__ import annotations

import torch

from lynx_connector.kernels.fp16_meta import FP16_MAX

from .base import Codec, check_plane
from .groupquant import GroupQuantCodec
from .layout import BlockIds, KVLayout

#: The longest channel group the Triton kernels take: one program holds a [group, head_size/2] tile (compiled and
#: checked on an H200 up to the default's 256); longer groups go through the torch twin on the GPU.
TRITON_MAX_GROUP_TOKENS = 256


def supports_triton(codec: Codec) -> bool:
    """True when ``codec`` has Triton kernels (4-bit, token/channel groups; a channel group's tokens a power of two,
    at most TRITON_MAX_GROUP_TOKENS)."""
    if not isinstance(codec, GroupQuantCodec) or codec.bits != 4:
        return False
    if not all(x in ("token", "channel") for x in (codec.k_group, codec.v_group)):
        return False
    channel = [g for g, kind in ((codec.k_tokens, codec.k_group), (codec.v_tokens, codec.v_group)) if kind == "channel"]
    return all(g & (g - 1) == 0 and g <= TRITON_MAX_GROUP_TOKENS for g in channel)


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
        # The kernels cannot raise: metadata that is not finite (NaN/inf KV, or below -65504) or whose top level
        # lies past fp16's largest value (KV possibly above 65504) sends the layer to the twin, which raises the
        # error it defines (NonFiniteKVError, KVRangeError) or, the values being in range after all, writes the
        # same planes. One host sync per tensor, as before.
        top = mn.double() + codec.levels * scale.double()  # exact: no rounding below the true top
        if not bool((torch.isfinite(scale).all() & torch.isfinite(mn).all() & (top <= FP16_MAX).all()).item()):
            k, v = layout.gather(kv_layer, block_ids, t)
            codec.encode_tokens(k, v, anchor_out, residual_out if codec.two_stream else None, layer_name)
            return


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
