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


def test_cpu_expansion_of_sampling_parameters_is_correct():
    """vLLM's CPU kernel writes the expansion into an int64 copy of the output (cpu_triton_utils, _expand_kernel_impl):
    the tensor the rejection sampler reads keeps whatever memory held. The guard expands with torch."""
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler as mod

    from lynx_connector.vllm_fixes import guard_cpu_expand

    out = torch.full((6,), -7, dtype=torch.int32)
    x, cu = torch.tensor([1, 5, 3], dtype=torch.int32), torch.tensor([2, 5, 6], dtype=torch.int32)
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # registers the CPU ops of this CPU's build (not vllm._C: AVX512-BF16)
        cpu_triton_utils._expand_kernel_impl(out, x, cu, 0, 0)
    except (ImportError, AttributeError, RuntimeError):  # no CPU op in this build: nothing to show
        pass
    else:
        assert out.tolist() == [-7] * 6  # the bug: the caller's tensor was never written
    plugin.register()
    assert guard_cpu_expand() and getattr(mod.expand_batch_to_tokens, "_lynx_empty_batch_guard", False)
    assert mod.expand_batch_to_tokens(x, cu, 6).tolist() == [1, 1, 5, 5, 5, 3]
    temp = torch.tensor([0.7, -1.0, 1.3])
    got = mod.expand_batch_to_tokens(temp, torch.tensor([1, 1, 3], dtype=torch.int32), 3, replace_from=-1.0,
                                     replace_to=1)
    assert torch.allclose(got, torch.tensor([0.7, 1.3, 1.3])) and got.dtype == torch.float32
    assert mod.expand_batch_to_tokens(x, torch.tensor([0, 0, 0], dtype=torch.int32), 0).numel() == 0
    top_k = torch.tensor([1, 1], dtype=torch.int64)
    assert mod.expand_batch_to_tokens(top_k, torch.tensor([3, 4], dtype=torch.int32), 4).tolist() == [1] * 4


def test_guards_are_installed_by_the_worker_half_and_a_missing_target_is_warned(monkeypatch, caplog):
    """VLLM_PLUGINS naming other plugins keeps vLLM from loading the plugin in its spawned engine processes: the
    connector's worker half (in the process that samples) installs the guards itself. A vLLM without one of the
    guarded functions runs without that guard, with a warning (it used to be silent)."""
    import logging
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.v1.sample.ops import topk_topp_sampler

    from lynx_connector import connector, vllm_fixes, worker

    calls = []
    monkeypatch.setattr(vllm_fixes, "install_guards", lambda: calls.append("guards"))
    monkeypatch.setattr(KVConnectorBase_V1, "__init__", lambda self, *a: None)
    monkeypatch.setattr(worker, "LynxConnectorWorker", lambda *a: calls.append("worker"))
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}, engine_id="e",
                                                             kv_role="kv_both"))
    connector.LynxConnector(cfg, KVConnectorRole.WORKER, None)
    assert calls == ["guards", "worker"]
    # a KV cache of several groups (vLLM's hybrid manager forced on): refused by name, not wrong blocks later
    with pytest.raises(ValueError, match="2 groups.*hybrid KV cache manager"):
        connector.LynxConnector(cfg, KVConnectorRole.WORKER, SimpleNamespace(kv_cache_groups=[1, 2]))
    monkeypatch.undo()

    monkeypatch.delattr(topk_topp_sampler, "apply_top_k_only")
    with caplog.at_level(logging.WARNING):
        vllm_fixes.install_guards()
    assert any("apply_top_k_only was not found" in r.getMessage() for r in caplog.records)
