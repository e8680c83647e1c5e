"""Two 4-bit codes per byte: element 2j in the low nibble, 2j+1 in the high nibble (torch twin of the
Triton packing). Packing runs along the last (head) dimension, which is even for every supported head size."""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], last dim even -> uint8 with half the last dim."""
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 [..., n] -> uint8 codes [..., 2n]."""
    out = torch.stack((packed & 15, packed >> 4), dim=-1)
    return out.view(*packed.shape[:-1], packed.shape[-1] * 2)
