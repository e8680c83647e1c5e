"""A guard around one vLLM 0.32 function that the Lynx speculative preset reaches and plain serving does not.

`lynx:speculative` turns on vLLM's speculative-decoding path for every request on the instance (the Lynx
scheduler feeds it the tokens decoded on the anchor). On that path vLLM runs its rejection sampler even for a
batch without a single draft token, and on the CPU backend its top-k step then takes ``k.max()`` of an empty
tensor: any request with ``top_k`` (e.g. n > 1 with ``top_k=1``) killed the engine with ``RuntimeError: max():
Expected reduction dim to be specified for input.numel() == 0`` (``vllm/v1/sample/ops/topk_topp_sampler.py``,
``apply_top_k_only``). The guard returns an empty batch unchanged, which is what the function does for any
other batch size; everything else goes to vLLM's function untouched. Installed by the plugin in every vLLM
process; idempotent; a vLLM without that function is left alone.
"""

from __future__ import annotations

import functools
from typing import Any

from lynx_connector.logger import init_logger

logger = init_logger(__name__)

_MARK = "_lynx_empty_batch_guard"


def guard_empty_top_k() -> bool:
    """Install the guard; True when it is in place (now or before)."""
    try:
        from vllm.v1.sample.ops import topk_topp_sampler as mod
    except Exception:  # no vLLM, or another layout: nothing to guard
        return False
    original = getattr(mod, "apply_top_k_only", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def apply_top_k_only(logits: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
        if logits.shape[0] == 0:  # no row to mask (a speculative batch without draft tokens)
            return logits
        return original(logits, k, *args, **kwargs)

    setattr(apply_top_k_only, _MARK, True)
    mod.apply_top_k_only = apply_top_k_only
    return True
