"""Keep lossy KV out of D's prefix cache (issue 14.6).

vLLM caches a request's full blocks under ``request.block_hashes`` (chained hashes of the prompt's tokens,
computed when the request is created and extended as it grows): ``KVCacheManager.cache_blocks`` when the
connector reports the load finished (``Scheduler._update_waiting_for_remote_kv``) and again in every
``allocate_slots`` while the request runs. A block loaded in a lossy mode would then serve every later request
with the same prefix. :func:`fence_lossy_blocks` replaces the hashes of the blocks the connector loads (from the
first block after the local prefix-cache hit on) with random ones before anything caches them: those blocks, and
every block the request computes after them (vLLM chains each new hash on the previous one), land under hashes no
other request can produce, so they are never a prefix-cache hit, and they are recycled like any free block. The
local hit before them is untouched (it is already cached, at full precision). A preempted or failed request that
recomputes its prompt simply misses the cache (correct, only slower).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

__all__ = ["fence_lossy_blocks"]


def fence_lossy_blocks(request: Request, local_hit_tokens: int, manager: KVCacheManager | None,
                       block_size: int) -> int:
    """Give the hashes of ``request``'s blocks from token ``local_hit_tokens`` on private random values; returns
    how many hashes were replaced (0 when prefix caching is off: nothing is cached then)."""
    if manager is not None and not getattr(manager, "enable_caching", True):
        return 0
    pool = getattr(manager, "block_pool", None)
    hash_block_size = getattr(pool, "hash_block_size", None) or block_size
    hashes = request.block_hashes
    first = local_hit_tokens // hash_block_size
    for i in range(first, len(hashes)):
        old = hashes[i]
        hashes[i] = type(old)(secrets.token_bytes(len(old) or 32))
    return max(0, len(hashes) - first)
