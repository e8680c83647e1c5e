"""Randomized Hadamard rotation per (token, head): spreads outlier channels over the whole head so a per-token
group sees a flatter distribution (QuaRot-style). Orthonormal, so the inverse is the transpose (itself)."""

from __future__ import annotations

from functools import lru_cache

import torch

SEED = 0x1A9C


@lru_cache(maxsize=8)
def _rotation(head_size: int) -> torch.Tensor:
    if head_size & (head_size - 1):
        raise ValueError(f"hadamard grouping needs a power-of-two head size, got {head_size}")
    h = torch.ones(1, 1)
    while h.shape[0] < head_size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    gen = torch.Generator().manual_seed(SEED)
    signs = torch.randint(0, 2, (head_size,), generator=gen).float() * 2 - 1
    return (signs[:, None] * h) / head_size**0.5  # diag(signs) @ H / sqrt(D)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x @ (diag(signs) H / sqrt(D)), fp32."""
    return x.float() @ _rotation(x.shape[-1]).to(x.device)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`."""
    return y.float() @ _rotation(y.shape[-1]).to(y.device).T
