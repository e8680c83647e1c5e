"""Layouts of one layer of vLLM's paged KV cache, and token-major gather/scatter over block ids.

Verified against the installed vLLM (``torch.ops._C.cpu_attn_reshape_and_cache`` is the oracle; see
tests/codec/test_layout.py). The per-layer tensor is ``[num_blocks, kv_heads, block_size, 2*head_size]``.

* ``cpu`` (CPU_ATTN): each (block, head) slice of ``2*block_size*head_size`` elements is a K tile then a V
  tile, ordered by the attention ISA vLLM picked (``_get_attn_isa``):
  - ``vec``/``vec16`` (fp32, fp16, bf16 without AMX): K tile ``[D, BS]`` (transposed), V tile ``[BS, D]``.
  - ``amx`` (bf16 with AMX, block_size % 32 == 0): K tile ``[BS/16, D/2, 16, 2]`` (16-token panels of
    dim pairs), V tile ``[D/16, BS/2, 16, 2]`` (16-dim panels of token pairs).
* ``flash`` (FlashAttention, vLLM 0.32): the same logical shape split on the last dim,
  ``kv.transpose(1, 2).split(D, -1)`` -> K and V ``[B, BS, H, D]``: per (block, head, token) ``[K_t | V_t]``.
  The tensor may be a strided view of another physical order; gather/scatter go through its strides.

Each layout also exposes element-offset formulas (``tile_addr``) so the Triton kernels address the cache
directly: ``off(b, h, t, d) = b*sB + h*sH + base + (t//PT)*sT1 + (t%PT)*sT0 + (d//PD)*sD1 + (d%PD)*sD0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

CPU_ISAS = ("vec", "vec16", "amx")
BlockIds = torch.Tensor | list[int] | tuple[int, ...]
#: vLLM's null block (the first its block pool hands out): where a sliding-window layer's dropped positions point.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class TileAddr:
    """Element-offset formula of K or V inside one (block, head) of the cache (see module docstring)."""

    s_block: int
    s_head: int
    base: int
    pt: int
    s_t1: int
    s_t0: int
    pd: int
    s_d1: int
    s_d0: int


def cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU attention picks for this cache (vLLM's own ``_get_attn_isa`` when importable)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # vLLM absent: replicate its x86 decision
        if head_size % 32 != 0 and head_size % 16 == 0:
            return "vec16"
        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
        if amx and dtype == torch.bfloat16 and block_size % 32 == 0:
            return "amx"
        return "vec" if block_size % 32 == 0 else "vec16"
    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


@dataclass(frozen=True)
class KVLayout:
    """How one layer's paged KV is laid out; built with :meth:`cpu`, :meth:`flash` or :meth:`from_kv_cache`."""

    backend: Literal["cpu", "flash"]
    num_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype
    isa: str | None = None

    def __post_init__(self) -> None:
        if self.backend == "cpu":
            if self.isa not in CPU_ISAS:
                raise ValueError(f"unsupported CPU attention ISA {self.isa!r}; supported: {CPU_ISAS}")
            if self.isa == "amx" and (self.block_size % 32 or self.head_size % 32):
                raise ValueError("amx layout needs block_size and head_size multiples of 32")
        elif self.backend != "flash":
            raise ValueError(f"unknown KV layout backend {self.backend!r}")
        if self.head_size % 2:
            raise ValueError("head_size must be even (codes are packed in pairs)")

    @classmethod
    def cpu(cls, num_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str | None = None) -> KVLayout:
        """vLLM CPU_ATTN layout; ``isa=None`` picks it the way vLLM does for this dtype/shape."""
        isa = isa or cpu_attn_isa(dtype, block_size, head_size)
        return cls("cpu", num_heads, block_size, head_size, dtype, isa)

    @classmethod
    def flash(cls, num_heads: int, block_size: int, head_size: int, dtype: torch.dtype) -> KVLayout:
        """vLLM FlashAttention layout (K/V interleaved per token on the last dim)."""
        return cls("flash", num_heads, block_size, head_size, dtype, None)

    @classmethod
    def from_kv_cache(
        cls, kv_layer: torch.Tensor, block_size: int | None = None, backend: str = "cpu", isa: str | None = None
    ) -> KVLayout:
        """Layout of a per-layer cache tensor ``[num_blocks, kv_heads, block_size, 2*head_size]``."""
        if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
            raise ValueError(f"expected [num_blocks, kv_heads, block_size, 2*head_size], got {tuple(kv_layer.shape)}")
        _, h, bs, two_d = kv_layer.shape
        if block_size is not None and block_size != bs:
            raise ValueError(f"block_size {block_size} does not match the cache's {bs}")
        if backend == "cpu":
            return cls.cpu(h, bs, two_d // 2, kv_layer.dtype, isa)
        if backend == "flash":
            return cls.flash(h, bs, two_d // 2, kv_layer.dtype)
        raise ValueError(f"unknown KV layout backend {backend!r}")

    # ---- token-major views --------------------------------------------------------------------------
    def _views(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``tiles`` [nb, H, BS, 2D] whose dims refine [nb, BS, H, D] in order (K, V)."""
        nb, h, bs, d = tiles.shape[0], self.num_heads, self.block_size, self.head_size
        if self.backend == "flash":
            return tiles[..., :d].transpose(1, 2), tiles[..., d:].transpose(1, 2)
        kt, vt = tiles.reshape(nb, h, 2, bs * d).unbind(2)
        if self.isa == "amx":
            k = kt.view(nb, h, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
            v = vt.view(nb, h, d // 16, bs // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
            return k, v
        return kt.view(nb, h, d, bs).permute(0, 3, 1, 2), vt.view(nb, h, bs, d).transpose(1, 2)

    def _check(self, kv_layer: torch.Tensor, block_ids: BlockIds, num_tokens: int) -> torch.Tensor:
        expect = (self.num_heads, self.block_size, 2 * self.head_size)
        if tuple(kv_layer.shape[1:]) != expect or kv_layer.dtype != self.dtype:
            raise ValueError(f"cache {tuple(kv_layer.shape)} {kv_layer.dtype} does not match layout {self}")
        ids = torch.as_tensor(block_ids, dtype=torch.int64).flatten()  # vLLM's lists: checked on the host
        need = -(-num_tokens // self.block_size)
        if num_tokens < 0 or ids.numel() < need:
            raise ValueError(f"{num_tokens} tokens need {need} blocks, got {ids.numel()} block ids")
        ids = ids[:need]
        # The kernels index the cache with these ids unchecked (numba wrote past the layer, or a negative id into
        # its last block); a block listed twice would take two requests' rows: refused, whatever the impl. Block
        # NULL_BLOCK_ID may repeat: vLLM lists its null block for the positions a sliding window dropped.
        real = ids[ids != NULL_BLOCK_ID]
        if need and (int(ids.min()) < 0 or int(ids.max()) >= kv_layer.shape[0]
                     or real.unique().numel() != real.numel()):
            raise ValueError(f"block ids must be distinct (but for the null block {NULL_BLOCK_ID}) and in "
                             f"[0, {kv_layer.shape[0]}): got {ids.tolist()[:16]}{' ...' if need > 16 else ''}")
        return ids.to(kv_layer.device)

    def gather(self, kv_layer: torch.Tensor, block_ids: BlockIds, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, H, D]`` (cache dtype) of the tokens held by ``block_ids`` in order."""
        ids = self._check(kv_layer, block_ids, num_tokens)
        tiles = kv_layer.index_select(0, ids)
        k, v = self._views(tiles)
        shape = (-1, self.num_heads, self.head_size)
        return k.reshape(shape)[:num_tokens], v.reshape(shape)[:num_tokens]

    def scatter(
        self, kv_layer: torch.Tensor, block_ids: BlockIds, num_tokens: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K and V ``[num_tokens, H, D]`` into the blocks; rows >= num_tokens keep their bytes."""
        ids = self._check(kv_layer, block_ids, num_tokens)
        if num_tokens == 0:
            return
        k, v = _fit(k, self.dtype), _fit(v, self.dtype)
        full = ids.numel() * self.block_size
        if full != num_tokens:  # read-modify-write of the last block keeps its later rows intact
            k_old, v_old = self.gather(kv_layer, ids[-1:], self.block_size)
            keep = num_tokens - full + self.block_size
            k = torch.cat((k, k_old[keep:]), 0)
            v = torch.cat((v, v_old[keep:]), 0)
        tiles = torch.empty((ids.numel(), *kv_layer.shape[1:]), dtype=self.dtype, device=kv_layer.device)
        kview, vview = self._views(tiles)
        kview.copy_(k.reshape(kview.shape))
        vview.copy_(v.reshape(vview.shape))
        kv_layer.index_copy_(0, ids, tiles)

    # ---- direct addressing for kernels --------------------------------------------------------------
    def tile_addr(self, kv_layer: torch.Tensor, kind: Literal["k", "v"]) -> TileAddr:
        """Element-offset formula of K or V (see module docstring) for this cache tensor."""
        bs, d = self.block_size, self.head_size
        sb, sh, sn, sc = kv_layer.stride()
        if self.backend == "flash":
            return TileAddr(sb, sh, 0 if kind == "k" else d * sc, bs, 0, sn, d, 0, sc)
        if sn != 2 * d or sc != 1:
            raise ValueError("CPU layout needs each (block, head) slice contiguous")
        base = 0 if kind == "k" else bs * d
        if self.isa == "amx":
            if kind == "k":
                return TileAddr(sb, sh, base, 16, d * 16, 2, 2, 32, 1)
            return TileAddr(sb, sh, base, 2, 32, 1, 16, bs * 16, 2)
        if kind == "k":
            return TileAddr(sb, sh, base, bs, 0, 1, d, 0, bs)
        return TileAddr(sb, sh, base, bs, 0, d, d, 0, 1)


def _fit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decoded values in the cache dtype. A codec's top level (``mn + levels * s``, the scale rounded up) may lie a
    little above the largest finite value of a narrower cache (fp16: 65504) although every value P encoded was
    within it: such a value is written as that largest value, never as inf."""
    if x.dtype != dtype and dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        fmax = torch.finfo(dtype).max
        x = x.clamp(-fmax, fmax)
    return x.to(dtype)
