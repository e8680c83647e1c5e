"""The codec interface: token-major K/V of one layer of one request <-> anchor and residual byte planes.

Codecs never see the paged cache; ``api.py`` gathers/scatters through a :class:`KVLayout`. A codec writes
into caller-provided uint8 views (staging memory registered with NIXL), so no plane is copied twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Codec(ABC):
    """Base class. ``two_stream`` codecs split every value into anchor (sent first) and residual planes;
    single-stream baselines put everything in the anchor plane and have an empty residual."""

    name: str = ""
    two_stream: bool = False
    #: True when the planes carry the cache's values in their own dtype (the passthrough): the plane size then
    #: depends on the *staged* dtype (P's cache dtype) and D converts on write when its cache dtype differs.
    #: False for the quantizing codecs, whose planes (codes, fp16 metadata) are the same for any cache dtype.
    stages_cache_dtype: bool = False

    @abstractmethod
    def plane_nbytes(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype) -> tuple[int, int]:
        """(anchor_nbytes, residual_nbytes) for K and V of ``num_tokens`` tokens; residual 0 if single stream."""

    @abstractmethod
    def encode_tokens(
        self, k: torch.Tensor, v: torch.Tensor, anchor_out: torch.Tensor, residual_out: torch.Tensor | None, name: str
    ) -> None:
        """Encode K, V ``[T, H, D]`` into the planes (uint8 views of exactly ``plane_nbytes`` bytes)."""

    @abstractmethod
    def decode_tokens(
        self,
        anchor: torch.Tensor,
        residual: torch.Tensor | None,
        num_tokens: int,
        num_heads: int,
        head_size: int,
        cache_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[T, H, D]``: anchor precision when ``residual`` is None, full precision otherwise."""

    def check_metadata(
        self, anchor: torch.Tensor, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype,
        name: str,
    ) -> None:
        """Raise :class:`NonFiniteKVError` when the anchor plane's metadata (scales, minima) is not finite, so a
        bad plane never turns into NaN or inf in D's cache. Default: no metadata (the lossless passthrough,
        whose values P checked finite before encoding)."""
        return None

    def bits_per_value(self, num_tokens: int, num_heads: int, head_size: int, cache_dtype: torch.dtype) -> tuple[float, float]:
        """Wire bits per K/V value (metadata included) of the (anchor, anchor + residual) planes."""
        a, r = self.plane_nbytes(num_tokens, num_heads, head_size, cache_dtype)
        n = 2 * num_tokens * num_heads * head_size
        return 8.0 * a / n, 8.0 * (a + r) / n

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def check_plane(buf: torch.Tensor | None, nbytes: int, what: str) -> torch.Tensor:
    """Validate a caller-provided plane: contiguous uint8 with at least ``nbytes`` bytes (prefix used)."""
    if buf is None:
        raise ValueError(f"{what} plane is required")
    if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.numel() < nbytes:
        raise ValueError(f"{what} plane must be contiguous uint8 with >= {nbytes} bytes, got {buf.dtype} {buf.numel()}")
    return buf.view(-1)[:nbytes]
