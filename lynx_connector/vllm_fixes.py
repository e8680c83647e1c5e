"""Guards around two vLLM 0.32 functions that the Lynx speculative preset reaches and plain serving does not.

`lynx:speculative` turns on vLLM's speculative-decoding path for every request on the instance (the Lynx
scheduler feeds it the tokens decoded on the anchor). On that path vLLM runs its rejection sampler even for a
batch without a single draft token, and on the CPU backend its top-k step then takes ``k.max()`` of an empty
tensor: any request with ``top_k`` (e.g. n > 1 with ``top_k=1``) killed the engine with ``RuntimeError: max():
Expected reduction dim to be specified for input.numel() == 0`` (``vllm/v1/sample/ops/topk_topp_sampler.py``,
``apply_top_k_only``). The guard returns an empty batch unchanged, which is what the function does for any
other batch size; everything else goes to vLLM's function untouched.

Second, on the same path with a non-greedy request in the batch, the rejection sampler expands each request's
temperature, top-k and top-p to its draft tokens (``expand_batch_to_tokens``, ``vllm/v1/sample/
rejection_sampler.py``). On the CPU backend that kernel (``vllm/utils/cpu_triton_utils.py``,
``_expand_kernel_impl``) converts the int32/float32 output tensor to int64 and writes into the *copy*: the
tensor the sampler reads stays uninitialised memory (and a float temperature is truncated to an integer on the
way in). With ``top_k`` set that killed the engine (``RuntimeError: selected index k out of range`` when the
garbage exceeded the vocabulary) or silently sampled with garbage parameters. The guard computes the expansion
with plain torch on CPU tensors (the same result the kernel documents); other devices go to vLLM's function.

Installed (:func:`install_guards`) by the plugin in every vLLM process that loads it, and again by the connector's
worker half (the process that samples): ``VLLM_PLUGINS`` naming other plugins keeps vLLM from loading this one in
its spawned engine processes. Idempotent; a vLLM without those functions is left alone, with a warning.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

_MARK = "_lynx_empty_batch_guard"


def _install(module: str, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], *,
             positional: int) -> bool:
    """Replace ``module.name`` by ``make(original)`` (marked, so a second call is a no-op); True when the guard
    is in place, False when vLLM (or that function) is not there. ``positional``: how many positional arguments
    the guard passes to vLLM's function (``scripts/check_vllm_api.py`` reads the target and this from the call,
    to check both against another vLLM version)."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # no vLLM, or another layout: nothing to guard
        return False
    original = getattr(mod, name, None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    guard = functools.wraps(original)(make(original))
    setattr(guard, _MARK, True)
    setattr(mod, name, guard)
    return True


def guard_empty_top_k() -> bool:
    """Install the top-k guard; True when it is in place (now or before)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def apply_top_k_only(logits: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
            if logits.shape[0] == 0:  # no row to mask (a speculative batch without draft tokens)
                return logits
            return original(logits, k, *args, **kwargs)

        return apply_top_k_only

    return _install("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_only", make, positional=2)


def guard_cpu_expand() -> bool:
    """Install the CPU expansion of the rejection sampler's per-request parameters; True when it is in place."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def expand_batch_to_tokens(x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: Any = 0,
                                   replace_to: Any = 0) -> Any:
            if x.device.type != "cpu":
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            import torch

            counts = torch.diff(cu_num_tokens.to(torch.int64),
                                prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
            values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
            return torch.repeat_interleave(values, counts, output_size=num_tokens)

        return expand_batch_to_tokens

    return _install("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", make, positional=5)


def install_guards() -> None:
    """Install both guards (idempotent); a missing target is logged as a warning: that vLLM runs without it."""
    for name, install in (("apply_top_k_only", guard_empty_top_k), ("expand_batch_to_tokens", guard_cpu_expand)):
        if not install():
            logger.warning("Lynx: vLLM's %s was not found; its guard (lynx_connector/vllm_fixes.py) is not "
                           "installed (speculative mode on the CPU backend may fail)", name)
