"""The model identity P and D compare at the handshake (lynx_connector.compat.model_identity), built from real vLLM
``ModelConfig`` objects of a tiny local config (no weights): what makes the same model path compute other K/V."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lynx_connector.compat import kv_compat, model_identity
from lynx_connector.transport import protocol as proto
from tests.speculative.sched_harness import tiny_model_dir


def _identity(root: Path, **kwargs) -> dict[str, str]:
    from vllm.config import ModelConfig

    root.mkdir(exist_ok=True)
    model_dir = tiny_model_dir(root)
    return model_identity(ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                                      dtype="float32", max_model_len=4096, **kwargs))


def test_identity_fields_are_the_later_compat_fields(tmp_path: Path) -> None:
    ident = _identity(tmp_path)
    assert tuple(ident) == proto.LATER_COMPAT_FIELDS  # one list: what P tolerates a D of an earlier release lacking
    assert ident["model_revision"] == ""  # a local path has no revision
    assert json.loads(ident["rope"])["rope_type"] == "default"


@pytest.mark.parametrize("overrides", [
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}},
])
def test_rope_overrides_change_the_identity(tmp_path: Path, overrides: dict) -> None:
    """``--hf-overrides`` that change the RoPE vLLM builds (it reads ``rope_parameters``) change the compat dict,
    so a P and a D started with and without them are refused at the handshake instead of sharing K rotated by
    other angles."""
    base = _identity(tmp_path / "a")
    changed = _identity(tmp_path / "b", hf_overrides=overrides)
    assert changed["rope"] != base["rope"] and changed["model_revision"] == base["model_revision"]


def test_kv_compat_carries_the_identity() -> None:
    import torch

    from lynx_connector.codec import KVLayout

    layout = KVLayout.flash(2, 16, 64, torch.float32)
    ident = {"model_revision": "abc", "rope": "{}"}
    with_ident = kv_compat(model="m", layer_names=["l0"], layout=layout, codec_options={}, tp_rank=0, tp_size=1,
                           identity=ident)
    without = kv_compat(model="m", layer_names=["l0"], layout=layout, codec_options={}, tp_rank=0, tp_size=1)
    assert {k: with_ident[k] for k in ident} == ident and not set(ident) & set(without)
    assert proto.compat_diff(with_ident, without, optional=proto.LATER_COMPAT_FIELDS) == []
