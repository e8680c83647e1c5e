"""Compile the codec kernels at start-up, not inside a request.

The CPU kernels are numba functions compiled on first call (``cache=True`` keeps the machine code on disk, so a
later process only loads it); the GPU kernels are Triton's, compiled per shape class on first launch. Either way
the first request would pay it inside P's forward (layer-wise encode) or D's pull: tens of seconds of compile on a
small CPU when nothing is cached yet, a second or two to load when it is, which a D's deadline for P's next layer
(``timeout_s``) can mistake for a stalled P. `warm_up` runs one encode and one decode of each codec on a few
scratch blocks shaped like the real cache, so the worker pays it before the engine reports healthy.
"""

from __future__ import annotations

import time

import torch

from .api import decode_anchor, decode_full, encode, merge_residual
from .base import Codec
from .integrity import staged_layout
from .layout import KVLayout

__all__ = ["WARMUP_TOKENS", "warm_up"]

#: Tokens of the warm-up request: more than one 256-token channel group plus a partial one and a partial block,
#: so that every kernel path of the Lynx codec (full and partial groups, token groups) runs once.
WARMUP_TOKENS = 300


def warm_up(codec: Codec, layout: KVLayout, like: torch.Tensor, num_tokens: int = WARMUP_TOKENS) -> float:
    """Encode then decode (anchor, merge and whole) a ``num_tokens``-token request on scratch blocks of the same
    dtype, device and per-block shape as the cache layer ``like``; returns the seconds it took. The scratch
    holds small random KV (never the real cache's blocks)."""
    t0 = time.perf_counter()
    n_blocks = -(-num_tokens // layout.block_size)
    gen = torch.Generator(device="cpu").manual_seed(0)
    kv = (torch.randn((n_blocks, *like.shape[1:]), generator=gen) * 0.5).to(like.dtype).to(like.device)
    block_ids = list(range(n_blocks))
    sl = staged_layout(codec, layout, num_tokens, 1)
    a_buf = torch.zeros(sl.anchor.nbytes, dtype=torch.uint8, device=like.device)
    r_buf = torch.zeros(sl.residual.nbytes, dtype=torch.uint8, device=like.device)
    anchor = sl.anchor.plane(a_buf, 0)
    residual = sl.residual.plane(r_buf, 0) if sl.residual.plane_nbytes else None
    encode(codec, kv, block_ids, layout, num_tokens, anchor, residual, layer_name="warmup")
    out = torch.zeros_like(kv)
    decode_full(codec, anchor, residual, out, block_ids, layout, num_tokens)
    if codec.two_stream and residual is not None:
        decode_anchor(codec, anchor, out, block_ids, layout, num_tokens)
        merge_residual(codec, anchor, residual, out, block_ids, layout, num_tokens)
    return time.perf_counter() - t0
