"""The codec contract over vLLM's paged KV (docs/ARCHITECTURE.md): encode on P, decode_anchor and
merge_residual on D (or decode_full when both planes are at hand), each on one layer of one request, by block ids
(in any order, as vLLM allocated them).

``impl`` picks the implementation: ``"triton"`` (default on CUDA tensors) and ``"numba"`` (default on CPU when
numba is importable and the codec is a token/channel group codec) address the cache directly; ``"torch"`` runs
the twins, which define the format: gather the listed blocks with one ``index_select``, quantize token-major,
and scatter with one ``index_copy_`` (the last, partial block is read-modified-written so rows >= num_tokens
keep their bytes). The numba kernels are bit-exact with the twins and hand over to them when they cannot be
(non-finite input, values beyond the fp16 metadata range, signed-zero ties): errors always come from the twins.

Heterogeneous P and D (docs/ARCHITECTURE.md, "Heterogeneous P and D"): the planes are token-major, so they do not
depend on P's paging (block size, backend, ISA tiles): D decodes them into its own layout. ``staged_dtype`` on the
D-side functions is the dtype P encoded from (its cache dtype; default: D's own). Only a codec that
``stages_cache_dtype`` (the passthrough) sizes and reads its plane by it; D converts on write, rounding to nearest
even once when its cache is narrower, and refuses values its dtype cannot hold (``KVRangeError``).
"""

from __future__ import annotations

import torch

from lynx_connector.kernels.errors import KVRangeError

from .base import Codec, check_plane
from .layout import BlockIds, KVLayout

IMPLS = ("auto", "torch", "triton", "numba")
#: The cache dtypes a plane may be staged from and decoded into (the numba kernels' dtypes too).
STAGED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_numba(codec: Codec, kv_layer: torch.Tensor, layout: KVLayout, impl: str) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if impl not in ("auto", "numba"):
        return False
    from .numba_path import supports_numba

    ok = supports_numba(codec, kv_layer, layout)
    if impl == "numba" and not ok:
        raise ValueError(f"codec {codec!r} cannot run on the numba kernels here (numba missing, or unsupported)")
    return ok


def _use_triton(codec: Codec, kv_layer: torch.Tensor, impl: str) -> bool:
    if impl in ("torch", "numba") or (impl == "auto" and not kv_layer.is_cuda):
        return False
    from .triton_path import supports_triton

    ok = supports_triton(codec)
    if impl == "triton":
        if not ok:
            raise ValueError(f"codec {codec!r} has no Triton kernels")
        return True
    return ok and kv_layer.is_cuda


def kernel_path(codec: Codec, kv_layer: torch.Tensor, layout: KVLayout) -> str:
    """Which implementation ``encode(..., impl="auto")`` runs for this codec on this cache tensor: "triton",
    "numba" or "torch" (the worker logs it at start-up: the torch twin is several times slower)."""
    if _use_triton(codec, kv_layer, "auto"):
        return "triton"
    return "numba" if _use_numba(codec, kv_layer, layout, "auto") else "torch"


def encode(
    codec: Codec,
    kv_layer: torch.Tensor,
    block_ids: BlockIds,
    layout: KVLayout,
    num_tokens: int,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor | None = None,
    *,
    layer_name: str = "layer",
    impl: str = "auto",
) -> None:
    """P side: quantize the first ``num_tokens`` tokens held by ``block_ids`` into the planes."""
    if num_tokens == 0:
        return
    if _use_triton(codec, kv_layer, impl):
        from .triton_path import encode_triton

        encode_triton(codec, kv_layer, block_ids, layout, num_tokens, anchor_out, residual_out, layer_name)
        return
    if _use_numba(codec, kv_layer, layout, impl):
        from .numba_path import encode_numba

        if encode_numba(codec, kv_layer, block_ids, layout, num_tokens, anchor_out, residual_out):
            return
    k, v = layout.gather(kv_layer, block_ids, num_tokens)
    codec.encode_tokens(k, v, anchor_out, residual_out, layer_name)


def decode_anchor(
    codec: Codec,
    anchor: torch.Tensor,
    kv_layer: torch.Tensor,
    block_ids: BlockIds,
    layout: KVLayout,
    num_tokens: int,
    *,
    skip_blocks: int = 0,
    impl: str = "auto",
    staged_dtype: torch.dtype | None = None,
) -> None:
    """D side: write anchor-precision values (baselines: their only precision) into rows < num_tokens.

    The first ``skip_blocks`` blocks are left untouched (D's prefix cache already holds them, shared).
    ``staged_dtype``: P's cache dtype (module docstring); None = ``layout.dtype``."""
    _decode(codec, anchor, None, kv_layer, block_ids, layout, num_tokens, impl, skip_blocks, staged_dtype)


def merge_residual(
    codec: Codec,
    anchor: torch.Tensor,
    residual: torch.Tensor,
    kv_layer: torch.Tensor,
    block_ids: BlockIds,
    layout: KVLayout,
    num_tokens: int,
    *,
    skip_blocks: int = 0,
    impl: str = "auto",
    staged_dtype: torch.dtype | None = None,
) -> None:
    """D side: overwrite rows < num_tokens with full precision (anchor + residual). Idempotent.
    The first ``skip_blocks`` blocks are left untouched, as in :func:`decode_anchor`."""
    if not codec.two_stream:
        raise ValueError(f"codec {codec.name} is single-stream: nothing to merge")
    _decode(codec, anchor, residual, kv_layer, block_ids, layout, num_tokens, impl, skip_blocks, staged_dtype)


def decode_full(
    codec: Codec,
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    kv_layer: torch.Tensor,
    block_ids: BlockIds,
    layout: KVLayout,
    num_tokens: int,
    *,
    skip_blocks: int = 0,
    impl: str = "auto",
    staged_dtype: torch.dtype | None = None,
) -> None:
    """D side, both planes at hand: write full-precision values into rows < num_tokens in one pass over the blocks.

    The cache ends up byte-identical to :func:`decode_anchor` followed by :func:`merge_residual` (the full values
    depend on the planes only, never on what the rows held), without the anchor pass. Single-stream codecs have no
    residual (``None`` or empty): their full precision is the anchor, so this is :func:`decode_anchor`. The first
    ``skip_blocks`` blocks are left untouched, as in :func:`decode_anchor`."""
    if not codec.two_stream:
        if residual is not None and residual.numel():
            raise ValueError(f"codec {codec.name} is single-stream: it has no residual plane")
        residual = None
    elif residual is None:
        raise ValueError(f"codec {codec.name} is two-stream: decode_full needs the residual plane")
    _decode(codec, anchor, residual, kv_layer, block_ids, layout, num_tokens, impl, skip_blocks, staged_dtype)


def _decode(
    codec: Codec,
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    kv_layer: torch.Tensor,
    block_ids: BlockIds,
    layout: KVLayout,
    num_tokens: int,
    impl: str,
    skip_blocks: int = 0,
    staged_dtype: torch.dtype | None = None,
) -> None:
    h, d = layout.num_heads, layout.head_size
    staged = _staged(codec, layout, staged_dtype)
    skip = skip_blocks * layout.block_size
    if not 0 <= skip <= num_tokens:
        raise ValueError(f"skip_blocks={skip_blocks} does not fit {num_tokens} tokens")
    if num_tokens == skip:
        return
    if skip == 0 and _use_triton(codec, kv_layer, impl):
        from .triton_path import decode_triton

        decode_triton(codec, anchor, residual, kv_layer, block_ids, layout, num_tokens)
        return
    if _use_numba(codec, kv_layer, layout, impl):
        from .numba_path import decode_numba

        decode_numba(codec, anchor, residual, kv_layer, block_ids, layout, num_tokens, skip)
        return
    k, v = codec.decode_tokens(anchor, residual, num_tokens, h, d, staged)
    if staged != layout.dtype:
        k, v = _convert(k, layout.dtype), _convert(v, layout.dtype)
    if skip:  # groups may span blocks, so decode everything and write only the blocks after the skipped ones
        block_ids = list(block_ids)[skip_blocks:]
        k, v = k[skip:], v[skip:]
    layout.scatter(kv_layer, block_ids, num_tokens - skip, k, v)


def _staged(codec: Codec, layout: KVLayout, staged_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the codec reads its planes as: P's (``staged_dtype``) for a codec that stages the cache dtype,
    D's own otherwise (the quantizing codecs' planes do not depend on it)."""
    if staged_dtype is None or not codec.stages_cache_dtype:
        return layout.dtype
    if staged_dtype not in STAGED_DTYPES:
        raise ValueError(f"staged dtype {staged_dtype} is not one of {STAGED_DTYPES}")
    return staged_dtype


def _convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """P's staged values in D's cache dtype: exact when D's is at least as wide, rounded to nearest even once
    otherwise; a value D's dtype cannot hold (e.g. beyond fp16's 65504) raises instead of writing inf."""
    out = x.to(dtype)
    if torch.finfo(dtype).max < torch.finfo(x.dtype).max and not bool(torch.isfinite(out).all()):
        raise KVRangeError(f"P's {x.dtype} KV holds values beyond the range of D's {dtype} cache")
    return out


def check_metadata(codec: Codec, anchor: torch.Tensor, layout: KVLayout, num_tokens: int, *,
                   layer_name: str = "layer", staged_dtype: torch.dtype | None = None) -> None:
    """D side, before decoding: raise ``NonFiniteKVError`` when the anchor plane's metadata (the fp16 scales and
    minima of the group codecs, fp8's scales) is not finite, so such a plane never reaches the cache."""
    if num_tokens:
        codec.check_metadata(anchor, num_tokens, layout.num_heads, layout.head_size,
                             _staged(codec, layout, staged_dtype), layer_name)


def plane_nbytes(codec: Codec, layout: KVLayout, num_tokens: int, *,
                 staged_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(anchor_nbytes, residual_nbytes) of one layer of a ``num_tokens``-token request (``staged_dtype``: P's
    cache dtype, which sizes the passthrough's plane; None = ``layout.dtype``)."""
    return codec.plane_nbytes(num_tokens, layout.num_heads, layout.head_size, _staged(codec, layout, staged_dtype))


__all__ = ["encode", "decode_anchor", "merge_residual", "decode_full", "check_metadata", "plane_nbytes",
           "check_plane"]
