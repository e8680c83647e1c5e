"""The plugin's guard around vLLM's top-k step (lynx_connector/vllm_fixes.py): an empty batch, which the
speculative path hands it when no request has draft tokens, used to raise and kill the engine."""

from __future__ import annotations

import pytest
import torch

from lynx_connector import plugin
from lynx_connector.vllm_fixes import guard_empty_top_k


def test_empty_batch_is_returned_and_other_batches_are_vllms():
    from vllm.v1.sample.ops import topk_topp_sampler as mod

    plugin.register()
    assert guard_empty_top_k() and getattr(mod.apply_top_k_only, "_lynx_empty_batch_guard", False)
    original = mod.apply_top_k_only.__wrapped__
    empty, k0 = torch.empty(0, 50), torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="numel"):
        original(empty.clone(), k0.clone())  # vLLM's own function on the batch the speculative path builds
    assert mod.apply_top_k_only(empty, k0).shape == (0, 50)
    logits = torch.randn(3, 50)
    k = torch.tensor([1, 5, 50])
    assert torch.equal(mod.apply_top_k_only(logits.clone(), k.clone()), original(logits.clone(), k.clone()))
    # through vLLM's caller, as the rejection sampler calls it
    assert mod.apply_top_k_top_p_pytorch(empty, k0, None, allow_cpu_sync=True).shape == (0, 50)
