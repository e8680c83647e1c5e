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
not a silent garbled cache), and what else makes the same model path compute other K/V (:func:`model_identity`):
the model's revision as vLLM resolved it (a hub model's commit: P and D that resolved ``main`` on different days
may hold different weights) and its RoPE parameters after ``--hf-overrides`` (a scaled RoPE on one side turns K by
other angles). These two are later fields (``transport.protocol.LATER_COMPAT_FIELDS``): a D of an earlier release
does not send them, and P then compares the rest. Weights are not compared by content, nor the quantization
method: a quantized P's KV is its own, like its dtype's rounding.
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


def model_identity(model_config: Any) -> dict[str, str]:
    """The later compat fields of a vLLM ``ModelConfig`` (module docstring): ``model_revision``, the commit vLLM
    resolved the revision to (``""`` for a local path), and ``rope``, the canonical JSON of the text config's RoPE
    parameters, numbers as floats (``""`` when it has none)."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    rope = getattr(hf, "rope_parameters", None)
    if rope is None and hf is not None:  # transformers before rope_parameters spelled them apart
        rope = {k: v for k in ("rope_theta", "rope_scaling") if (v := getattr(hf, k, None)) is not None} or None
    revision = getattr(model_config, "revision", None)
    # vLLM stores huggingface_hub's ResolvedRevision: a str of the revision asked for ("main"), the commit in
    # .resolved; a revision vLLM could not resolve (the hub unreachable) stays what was asked
    revision = getattr(revision, "resolved", None) or revision
    return {"model_revision": str(revision or ""),
            "rope": json.dumps(_numbers_as_floats(rope), sort_keys=True, default=str) if rope else ""}


def _numbers_as_floats(value: Any) -> Any:
    """``10000`` and ``10000.0`` are the same RoPE parameter (a config or an override may write either)."""
    if isinstance(value, dict):
        return {k: _numbers_as_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_numbers_as_floats(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def kv_compat(*, model: str, layer_names: list[str], layout: KVLayout, codec_options: Mapping[str, Any],
              tp_rank: int, tp_size: int, identity: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The fields P and D must agree on (module docstring); block size, backend, ISA and dtype are not among
    them. ``identity``: :func:`model_identity` of the model config (None: not compared, as from an earlier
    release)."""
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
        **(identity or {}),
    }
