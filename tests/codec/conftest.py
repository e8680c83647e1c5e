"""Fixtures for codec tests: vLLM's CPU reshape-and-cache op as the layout oracle."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def reshape_and_cache():
    """``write(cache, k, v, slots, isa)``: vLLM writes K/V [T, H, D] into slots of a per-layer CPU cache."""
    try:
        # vLLM's own choice of its CPU kernel build (AVX512-BF16, AVX512 or AVX2 library): importing vllm._C
        # directly loads the AVX512-BF16 one, which dies of an illegal instruction on an AVX2-only CPU
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        op = torch.ops._C.cpu_attn_reshape_and_cache
    except Exception as e:  # pragma: no cover - vLLM missing
        pytest.skip(f"vLLM CPU ops unavailable: {e}")

    def write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
        nb, h, bs, two_d = cache.shape
        kc, vc = cache.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
        op(k.contiguous(), v.contiguous(), kc, vc, slots.to(torch.int64), isa, 1.0, 1.0, "auto")

    return write
