"""Directed rounding of fp32 group statistics to fp16 (torch twin of the Triton helpers).

Group metadata travels as fp16. Codes are computed from the *stored* values, so to keep the error bounds
exact the minimum is rounded toward -inf (every x >= mn) and the scale toward +inf (mn + 15*s >= max).
The first cast may round either way (RNE on torch/GPU, truncation in some emulators); the fix-up then
steps one ulp, so every implementation lands on the same directed result.
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0


def round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    """Largest fp16 value <= x (x fp32, finite, |x| <= 65504)."""
    h = x.to(torch.float16)
    bits = h.view(torch.int16)
    down = torch.where(h > 0, bits - 1, torch.where(h == 0, torch.full_like(bits, -32767), bits + 1))
    return torch.where(h.float() > x, down, bits).view(torch.float16)


def round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 value >= x, for x >= 0 (x fp32, finite, x <= 65504)."""
    h = x.to(torch.float16)
    bits = h.view(torch.int16)
    return torch.where(h.float() < x, bits + 1, bits).view(torch.float16)
