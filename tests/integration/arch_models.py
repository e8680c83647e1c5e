"""Shapes this model does not have, built from the real model so that attention still carries the text.

Only SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, full attention) can be obtained here. Two checkpoints
are derived from it into a test folder (the weights file is linked, or rewritten, never downloaded):

* :func:`sliding_window_model`: the same weights with every layer a sliding-window layer (``layer_types``, the
  way vLLM's Llama reads Mistral-style windows). vLLM then lists its null block (id 0) for every block the window
  dropped, in P's block table and in D's.
* :func:`wide_head_model`: head_dim 256 and ``kv_heads`` KV heads. Each old head's 64 dimensions are placed so that
  RoPE rotates them by the same angles (pair ``(i, i + 32)`` at ``(4i, 4i + 128)``: the frequency of dimension
  ``j`` of 256 is that of ``j/4`` of 64), the rest are zero, and the query is scaled by 2 for the softmax scale
  ``256**-0.5``: with the 3 KV heads kept, the model computes what SmolLM2 computes. With ``kv_heads=1`` every
  query head reads the first KV head: the text is no longer English, but every token still depends on the KV.
* :func:`k_outlier_model`: K outlier channels. In every KV head, the RoPE pairs ``channels`` of K are scaled up by
  ``factor`` and the same channels of the query heads that read it scaled down: q.k, hence the model, is unchanged
  (a rotation pair scaled as one commutes with RoPE), but K now has the outlier channels some models have.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _derive(src: Path, dst: Path, config: dict[str, Any], weights: dict[str, Any] | None) -> str:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    if weights is not None:
        from safetensors.torch import save_file

        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if not (dst / f).exists():
            os.symlink(src / f, dst / f)
    return str(dst)


def sliding_window_model(src: str, dst: Path, window: int) -> str:
    """The real weights, every layer attending to its last ``window`` positions."""
    layers = json.loads((Path(src) / "config.json").read_text())["num_hidden_layers"]
    return _derive(Path(src), dst, {"layer_types": ["sliding_attention"] * layers, "sliding_window": window}, None)


def wide_head_model(src: str, dst: Path, kv_heads: int, head_dim: int = 256) -> str:
    """The real weights with heads widened to ``head_dim`` (RoPE angles kept) and the first ``kv_heads`` KV heads."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((Path(src) / "config.json").read_text())
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    r = head_dim // hd
    assert head_dim == r * hd and 1 <= kv_heads <= nkv
    place = torch.tensor([r * i for i in range(hd // 2)] + [r * i + head_dim // 2 for i in range(hd // 2)])

    def widen(w: torch.Tensor, heads: int, scale: float = 1.0) -> torch.Tensor:  # [heads*hd, in] -> [heads*head_dim, in]
        out = torch.zeros(heads, head_dim, w.shape[-1], dtype=w.dtype)
        out[:, place] = w.view(heads, hd, -1) * scale
        return out.reshape(heads * head_dim, -1)

    weights = {}
    for name, w in load_file(str(Path(src) / "model.safetensors")).items():
        if name.endswith("self_attn.q_proj.weight"):
            w = widen(w, nh, r ** 0.5)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            w = widen(w.view(nkv, hd, -1)[:kv_heads].reshape(kv_heads * hd, -1), kv_heads)
        elif name.endswith("self_attn.o_proj.weight"):  # [hidden, nh*hd] -> [hidden, nh*head_dim]
            out = torch.zeros(w.shape[0], nh, head_dim, dtype=w.dtype)
            out[:, :, place] = w.view(-1, nh, hd)
            w = out.reshape(w.shape[0], nh * head_dim)
        weights[name] = w.contiguous()
    return _derive(Path(src), dst, {"head_dim": head_dim, "num_key_value_heads": kv_heads}, weights)


def k_outlier_model(src: str, dst: Path, channels: tuple[int, ...] = (3, 17), factor: float = 16.0) -> str:
    """The real weights with K outlier channels (RoPE pairs ``(c, c + head_dim/2)`` of K x ``factor``, the query's
    same channels / ``factor``): the same model, an outlier-heavy K cache."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(src) / "config.json").read_text())
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    cols = [c for c in channels] + [c + hd // 2 for c in channels]
    weights = {}
    for name, w in load_file(str(Path(src) / "model.safetensors")).items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = nh if "q_proj" in name else nkv
            w = w.clone().view(heads, hd, -1)
            w[:, cols] *= 1 / factor if "q_proj" in name else factor
            w = w.reshape(heads * hd, -1)
        weights[name] = w.contiguous()
    return _derive(Path(src), dst, {}, weights)


def block_tables(llm: Any) -> list[list[int]]:
    """Probe run inside an engine: installs (first call) and then drains a record of the block tables the
    connector's scheduler half is handed at ``request_finished`` (P: the blocks it sends from)."""
    from tests.integration.spec_probes import _core

    half = _core(llm).scheduler.connector.connector_scheduler
    rec = half.__dict__.get("_test_tables")
    if rec is None:
        rec = half._test_tables = []
        real = half.request_finished

        def finished(request: Any, block_ids: list[int]) -> Any:
            rec.append(list(block_ids))
            return real(request, block_ids)

        half.request_finished = finished
    out = list(rec)
    rec.clear()
    return out


def kv_layout(llm: Any) -> dict[str, Any]:
    """Probe: the KV layout the connector's worker half registered (heads, head size, block size)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    lay = get_kv_transfer_group().connector_worker.layout
    return {"num_heads": lay.num_heads, "head_size": lay.head_size, "block_size": lay.block_size}


def k_channel_peaks(llm: Any, block_ids: list[int], num_tokens: int, layer: int = 0) -> list[float]:
    """Probe: per K channel, the largest |K| over the heads and the first ``num_tokens`` tokens of ``block_ids``
    in ``layer`` (blocks a finished request left behind: vLLM does not clear freed blocks)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().connector_worker
    k, _ = w.layout.gather(w.layers[layer][1], block_ids, num_tokens)
    return k.abs().amax(dim=(0, 1)).tolist()
