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


def test_the_revision_is_the_commit_vllm_resolved() -> None:
    """vLLM keeps huggingface_hub's ``ResolvedRevision`` in ``ModelConfig.revision``: its string is what was asked
    ("main"), the commit is ``.resolved``. P and D that resolved "main" to different commits hold different weights
    and must differ; the same commit asked as "main" on one side and pinned on the other is the same model."""
    from types import SimpleNamespace

    from huggingface_hub._revision import ResolvedRevision

    rope = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def revision_of(rev: object) -> str:
        return model_identity(SimpleNamespace(revision=rev, hf_text_config=rope))["model_revision"]

    a, b = "607a30d783dfa663caf39e06633721c8d4cfcd7e", "1" * 40
    assert revision_of(ResolvedRevision(a, None, "org/m")) != revision_of(ResolvedRevision(b, None, "org/m"))
    assert revision_of(ResolvedRevision(a, None, "org/m")) == revision_of(ResolvedRevision(a, a, "org/m")) == a
    assert revision_of("main") == "main" and revision_of(None) == ""  # unresolved (hub unreachable); a local path


def test_rope_numbers_compare_as_values() -> None:
    from types import SimpleNamespace

    def rope_of(params: dict) -> str:
        return model_identity(SimpleNamespace(revision=None, hf_text_config=SimpleNamespace(rope_parameters=params)))[
            "rope"]

    assert rope_of({"rope_type": "default", "rope_theta": 10000}) == rope_of({"rope_theta": 10000.0,
                                                                             "rope_type": "default"})
    assert rope_of({"rope_type": "yarn", "factor": 4, "beta_fast": 32}) != rope_of({"rope_type": "yarn", "factor": 2,
                                                                                    "beta_fast": 32})
