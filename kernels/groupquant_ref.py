"""Torch twin of the Lynx group quantizer: the CPU implementation and the oracle of ``lynx_triton``.

Per group: ``mn`` = min rounded DOWN to fp16, ``s`` = (max - mn)/levels rounded UP to fp16 (both stored), so
every value lies in ``[mn, mn + levels*s]`` and the bounds below hold without clamping surprises.

* anchor code ``a = clamp(floor((x - mn)/s + 0.5), 0, levels)``; anchor value ``mn + s*a``; |err| <= s/2.
* residual (4+4 codec only, levels = 15): ``e = x - (mn + s*a)`` lies in [-s/2, s/2];
  ``r = clamp(floor(e / (s/16)), -8, 7)`` stored as ``r + 8``; full value ``mn + (s/32)*(32a + 2r + 1)``,
  i.e. the residual reconstructs the *midpoint* of its s/16 cell, so |err| <= s/32 everywhere. (The textbook
  ``mn + s*a + (s/16)*r`` with round-to-nearest needs 17 residual levels to reach s/32; 16 midpoint
  levels cover [-s/2, s/2] exactly.)
* both reconstructions are one exact product (<= 11+9 significant bits) and one fp32 add, so FMA
  contraction on a GPU cannot change the result; the kernel and this twin agree bit for bit.
* ``s == 0`` (constant group whose value is fp16-representable): codes 0/8 and the value ``mn`` exactly.

Groups: ``token`` = the head_size values of one (token, head); ``channel`` = one (head, dim) over
``group_tokens`` consecutive tokens (last group ragged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KVRangeError, NonFiniteKVError
from .fp16_meta import FP16_MAX, round_down_fp16, round_up_fp16

GROUP_MODES = ("token", "channel")


@dataclass
class QuantPlanes:
    """Unpacked codes ([T, H, D] uint8), optional residual codes, and fp16 metadata (group shape)."""

    codes: torch.Tensor
    residual: torch.Tensor | None
    scale: torch.Tensor
    mn: torch.Tensor


def meta_shape(num_tokens: int, num_heads: int, head_size: int, mode: str, group_tokens: int) -> tuple[int, ...]:
    """Shape of the per-group metadata arrays for ``mode``."""
    if mode == "token":
        return (num_tokens, num_heads)
    if mode == "channel":
        return (-(-num_tokens // group_tokens), num_heads, head_size)
    raise ValueError(f"unknown group mode {mode!r}; expected one of {GROUP_MODES}")


def _grouped(x: torch.Tensor, mode: str, group_tokens: int) -> tuple[torch.Tensor, int]:
    """View x [T, H, D] so the group axis is a single dim; pads a ragged channel group by repeating the last
    token (min/max unchanged). Returns (view, reduce_dim)."""
    if mode == "token":
        return x, -1
    t = x.shape[0]
    pad = (-t) % group_tokens
    if pad:
        x = torch.cat((x, x[-1:].expand(pad, *x.shape[1:])), 0)
    return x.view(-1, group_tokens, *x.shape[1:]), 1


def _ungroup(y: torch.Tensor, mode: str, num_tokens: int) -> torch.Tensor:
    if mode == "token":
        return y
    return y.reshape(-1, *y.shape[2:])[:num_tokens]


def _bcast(meta: torch.Tensor, mode: str) -> torch.Tensor:
    return meta.unsqueeze(-1) if mode == "token" else meta.unsqueeze(1)


def quantize_ref(
    x: torch.Tensor, mode: str, group_tokens: int, levels: int, residual: bool, name: str = "kv"
) -> QuantPlanes:
    """Quantize x [T, H, D] (any float dtype) into codes + fp16 metadata. Raises on non-finite input."""
    t = x.shape[0]
    xg, dim = _grouped(x.float(), mode, group_tokens)
    gmin = xg.amin(dim)
    gmax = xg.amax(dim)
    lo, hi = gmin.min(), gmax.max()
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        raise NonFiniteKVError(f"{name}: KV contains NaN or inf (min={lo.item()}, max={hi.item()}); refusing to encode")
    if lo < -FP16_MAX or hi > FP16_MAX or ((gmax - gmin) / levels).max() > FP16_MAX / 2:
        raise KVRangeError(f"{name}: KV range [{lo.item()}, {hi.item()}] exceeds the fp16 metadata range")
    mn16 = round_down_fp16(gmin)
    mnf = mn16.float()
    # divide by a tensor, not the Python int: on CUDA, PyTorch turns division by a CPU scalar into a multiply by
    # its reciprocal, which is not the IEEE quotient the kernels (and this twin on the CPU) compute
    s16 = round_up_fp16((gmax - mnf) / torch.full_like(gmax, levels))
    sf = s16.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    mnb, sb, safeb = _bcast(mnf, mode), _bcast(sf, mode), _bcast(safe, mode)
    a = torch.floor((xg - mnb) / safeb + 0.5).clamp_(0, levels)
    res = None
    if residual:
        e = xg - (mnb + sb * a)
        r = torch.floor(e / (safeb * 0.0625)).clamp_(-8, 7)
        res = _ungroup((r + 8).to(torch.uint8), mode, t)
    codes = _ungroup(a.to(torch.uint8), mode, t)
    return QuantPlanes(codes.contiguous(), None if res is None else res.contiguous(), s16, mn16)


def dequantize_ref(
    codes: torch.Tensor,
    residual: torch.Tensor | None,
    scale: torch.Tensor,
    mn: torch.Tensor,
    mode: str,
    group_tokens: int,
) -> torch.Tensor:
    """Reconstruct fp32 [T, H, D]: anchor precision without ``residual``, full precision with it."""
    t = codes.shape[0]
    a, _ = _grouped(codes.float(), mode, group_tokens)
    mnb, sb = _bcast(mn.float(), mode), _bcast(scale.float(), mode)
    if residual is None:
        y = mnb + sb * a
    else:
        r, _ = _grouped(residual.float(), mode, group_tokens)
        y = mnb + (sb * 0.03125) * (a * 32 + r * 2 - 15)
    return _ungroup(y, mode, t)
