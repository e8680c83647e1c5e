"""What a prefill (P) and a decode (D) instance must share to exchange KV, and nothing else (issue 18.4).

The staged planes are token-major (``lynx_connector.codec``): they are a function of the prompt's K/V values
and the codec only, never of P's paging. So P and D may differ in

* block size (e.g. P 32, D 128: vLLM's NixlConnector needs P's block <= D's) and attention backend / CPU ISA
  tiles (``vec``, ``vec16``, ``amx``): D decodes into its own layout;
* KV cache dtype (fp32, bf16, fp16: NixlConnector needs them identical). The quantizing codecs' planes (4/8-bit
  codes, fp16 metadata) are the same for every cache dtype. The passthrough (``bf16`` mode) stages P's values in
  P's cache dtype: P announces that dtype per request (``lynx_kv_dtype`` in kv_transfer_params, from its
  workers' handshake metadata), D sizes its staging by it and converts on write.

What must match is the compat dict below, compared field by field at the side-channel handshake
(``transport.protocol.compat_diff``: a mismatch fails the handshake naming every differing field): the model,
its layers (count and names, in order), the KV heads of this rank and the head size, the Lynx codec's options
(they define the planes' format), the staged format's checksum trailers (``INTEGRITY_FORMAT``), and the
tensor-parallel rank and size (P's rank r serves D's rank r its shard of the heads; a mismatch is a clear error,
not a silent garbled cache).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lynx_connector.codec import KVLayout


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the wire name of a cache dtype)."""
    return str(dtype).removeprefix("torch.")


def staged_dtype_names() -> tuple[str, ...]:
    """The cache dtypes a P may stage from (``lynx_kv_dtype`` values D accepts)."""
    from lynx_connector.codec.api import STAGED_DTYPES

    return tuple(dtype_name(d) for d in STAGED_DTYPES)


def staged_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a validated ``lynx_kv_dtype``; None for ``""`` (not announced: D's own dtype)."""
    if not name:
        return None
    from lynx_connector.codec.api import STAGED_DTYPES

    for d in STAGED_DTYPES:
        if dtype_name(d) == name:
            return d
    raise ValueError(f"lynx_kv_dtype {name!r} is not one of {staged_dtype_names()}")


def kv_compat(*, model: str, layer_names: list[str], layout: KVLayout, codec_options: Mapping[str, Any],
              tp_rank: int, tp_size: int) -> dict[str, Any]:
    """The fields P and D must agree on (module docstring); block size, backend, ISA and dtype are not among
    them."""
    from lynx_connector.codec import INTEGRITY_FORMAT, get_codec
    from lynx_connector.modes import LYNX_CODEC

    # the grouping the codec really uses, not the options as spelled: ``group_tokens`` replaces both per-tensor
    # defaults, so {"group_tokens": 128} and {"group_tokens": 128, "k_group_tokens": 64} differ though the merged
    # options looked alike (and equal codecs spelled two ways were refused); the default's string is unchanged
    codec = get_codec(LYNX_CODEC, **dict(codec_options))
    codec.check_head_size(layout.head_size)  # at start-up, not at every request's encode
    grouping = {"k_group": codec.k_group, "k_group_tokens": codec.k_tokens, "v_group": codec.v_group,
                "v_group_tokens": codec.v_tokens}
    return {
        "model": model,
        "layers": len(layer_names),
        "layer_names": ",".join(layer_names),
        "kv_heads": layout.num_heads,
        "head_size": layout.head_size,
        "lynx_codec": json.dumps(grouping, sort_keys=True),
        "integrity": INTEGRITY_FORMAT,  # the staged layout's trailers
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
