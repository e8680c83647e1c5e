"""The modes table (lynx_connector/modes.py) against the codecs, and the one list every consumer takes."""

import ast
import re
from pathlib import Path

import pytest
import torch

from lynx_connector import modes
from lynx_connector.codec import CODEC_NAMES, get_codec
from lynx_connector.config import LynxConfig, LynxConfigError
from lynx_connector.modes import MODE_NAMES, MODES, UnknownModeError, get_mode
from lynx_connector.presets import (
    PRESET_MODES,
    PresetError,
    expand_kv_transfer_config,
    preset_config,
    speculative_defaults,
)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 1, 64, torch.float32), (37, 3, 64, torch.float32), (1024, 8, 128, torch.bfloat16),
          (300, 2, 128, torch.float16)]


def test_rows_are_consistent():
    assert len(set(MODE_NAMES)) == len(MODES) and MODE_NAMES[0] == modes.DEFAULT_MODE
    assert modes.LYNX_MODE_NAMES == ("full", "anchor", "speculative")
    assert set(modes.LYNX_MODE_NAMES) | set(modes.BASELINE_MODE_NAMES) == set(MODE_NAMES)
    for m in MODES:
        assert m.codec in CODEC_NAMES, m
        assert get_codec(m.codec).two_stream == m.two_stream, m
        assert m.planes[0] == modes.ANCHOR and set(m.planes) <= {modes.ANCHOR, modes.RESIDUAL}, m
        assert m.pulls_residual <= m.two_stream, m  # a single-stream codec has no residual to pull
        assert m.decode_after in (modes.AFTER_ANCHOR, modes.AFTER_BOTH), m
        assert m.decode_after == modes.AFTER_ANCHOR or m.pulls_residual, m
        assert m.first_token_after in (modes.RELEASE_ON_ANCHOR, modes.RELEASE_WITH_KV), m
        if m.first_token_after == modes.RELEASE_ON_ANCHOR:  # released before the KV it will be verified on
            assert m.late_residual and m.needs_spec_scheduler, m
        if m.needs_spec_scheduler:
            assert m.fallback is not None and not get_mode(m.fallback).needs_spec_scheduler, m
            assert get_mode(m.fallback).planes == m.planes, m  # the pull is the same, D just waits
            assert not m.prefix_cached, m  # reported ready on the (lossy) anchor
        else:
            assert m.fallback is None, m
        if m.prefix_cached:  # D's prefix cache keeps only blocks at full precision when the request is ready
            assert m.full_precision and not m.late_residual, m
        assert m.summary, m


def test_lossy_modes_stay_out_of_the_prefix_cache_and_are_not_allowed_by_default():
    """Issue 14.6: blocks loaded in a lossy mode never enter D's prefix cache; clients may ask only for the
    full-precision modes unless the operator allows more."""
    assert {m.name for m in MODES if m.prefix_cached} == {"full", "bf16"}
    assert set(modes.default_allowed_modes()) == {"full", "speculative", "bf16"}
    for name in ("anchor", "fp8", "int8", "int4", "int4_kivi"):
        assert not get_mode(name).full_precision and not get_mode(name).prefix_cached, name


def test_what_each_mode_does():
    """The rules the worker and scheduler halves follow, as they were written before the table."""
    full, anchor, spec = get_mode("full"), get_mode("anchor"), get_mode("speculative")
    assert full.planes == spec.planes == ("anchor", "residual") and anchor.planes == ("anchor",)
    assert not full.decodes_on_anchor and anchor.decodes_on_anchor and spec.decodes_on_anchor
    assert [m.name for m in MODES if m.late_residual] == ["speculative"]
    assert [m.name for m in MODES if m.needs_spec_scheduler] == ["speculative"] and spec.fallback == "full"
    for name in modes.BASELINE_MODE_NAMES:
        m = get_mode(name)
        assert m.codec == name and m.planes == ("anchor",) and m.decodes_on_anchor and not m.late_residual


@pytest.mark.parametrize("name", MODE_NAMES)
def test_wire_cost_is_the_codecs(name):
    m = get_mode(name)
    codec = get_codec(m.codec)
    for t, h, d, dtype in SHAPES:
        a, r = codec.plane_nbytes(t, h, d, dtype)
        pulled = (a, r) if m.pulls_residual else (a, 0)
        assert m.plane_nbytes(t, h, d, dtype) == pulled
        custom = get_codec(m.codec, **({"group_tokens": 64} if m.two_stream else {}))  # options: the worker's
        ca, cr = custom.plane_nbytes(t, h, d, dtype)
        assert m.plane_nbytes(t, h, d, dtype, codec=custom) == (ca, cr if m.pulls_residual else 0)
        first = a if m.first_token_after == modes.RELEASE_ON_ANCHOR else sum(pulled)
        assert m.wire_nbytes(t, h, d, dtype) == (first, sum(pulled))
        anchor_bits, all_bits = codec.bits_per_value(t, h, d, dtype)
        assert m.bits_per_value(t, h, d, dtype) == pytest.approx(all_bits if m.pulls_residual else anchor_bits)


def test_wire_cost_examples():
    bits = {m.name: m.bits_per_value(1024, 3, 64, torch.bfloat16) for m in MODES}
    assert bits["anchor"] <= 4.6 < bits["int8"] <= bits["full"] == bits["speculative"] <= 8.6  # full: int8's 8.5
    assert bits["bf16"] == 16.0 and bits["int4"] == 4.5
    spec_first, spec_all = get_mode("speculative").wire_nbytes(1024, 3, 64, torch.float32)
    assert spec_first == get_mode("anchor").wire_nbytes(1024, 3, 64, torch.float32)[1] < spec_all


@pytest.mark.parametrize("name", MODE_NAMES)
def test_lossless_against_the_codec(name):
    """``lossless`` is what the codec's round trip of the planes D pulls gives, in the cache dtype."""
    m = get_mode(name)
    codec = get_codec(m.codec)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        t, h, d = 64, 2, 64
        k, v = (torch.randn(t, h, d, generator=g).to(dtype) for _ in range(2))
        a, r = codec.plane_nbytes(t, h, d, dtype)
        anchor, residual = torch.zeros(a, dtype=torch.uint8), (torch.zeros(r, dtype=torch.uint8) if r else None)
        codec.encode_tokens(k, v, anchor, residual, "layer")
        k2, v2 = codec.decode_tokens(anchor, residual if m.pulls_residual else None, t, h, d, dtype)
        exact = torch.equal(k2.to(dtype), k) and torch.equal(v2.to(dtype), v)
        assert exact == m.lossless, (name, dtype)


def test_get_mode_names_the_valid_modes():
    with pytest.raises(UnknownModeError, match="int4_kivi") as err:
        get_mode("int3")
    assert isinstance(err.value, ValueError) and all(n in str(err.value) for n in MODE_NAMES)
    assert not modes.is_mode("int3") and not modes.is_mode(None) and not modes.is_mode(["full"])
    assert all(modes.is_mode(n) for n in MODE_NAMES)


@pytest.mark.parametrize("name", MODE_NAMES)
def test_config_and_presets_accept_every_mode(name):
    cfg = LynxConfig.from_extra_config({"mode": name})
    assert cfg.codec_name == get_mode(name).codec and cfg.two_stream == get_mode(name).two_stream
    expanded = expand_kv_transfer_config(f"lynx:{name}")
    assert expanded is not None and f'"mode": "{name}"' in expanded
    assert preset_config(name)["kv_connector_extra_config"] == {"mode": name}
    assert (speculative_defaults(preset_config(name)) is not None) == get_mode(name).needs_spec_scheduler
    # a prefill-only instance (kv_role kv_producer over the preset) decodes nothing: no speculative scheduler
    assert speculative_defaults({**preset_config(name), "kv_role": "kv_producer"}) is None


def test_config_and_presets_accept_only_the_table():
    assert PRESET_MODES == (*MODE_NAMES, "auto")  # lynx:int4_kivi is a preset too, and lynx:auto
    for bad in ("int3", "lynx", "anchor_only", ""):
        with pytest.raises(LynxConfigError, match="mode"):
            LynxConfig(mode=bad)
        with pytest.raises(PresetError):
            preset_config(bad)


def test_wire_params_accept_exactly_the_table():
    from lynx_connector.metadata import InvalidTransferParams, RemotePrefill

    base = RemotePrefill(transfer_id="a" * 32, token="b" * 32, engine_id="e", request_id="r", host="h", ports=(5600,), num_tokens=16, mode="full",
                         first_token=None).to_params()
    for name in MODE_NAMES:
        assert RemotePrefill.from_params({**base, "lynx_mode": name}).mode == name
    with pytest.raises(InvalidTransferParams, match="int4_kivi"):
        RemotePrefill.from_params({**base, "lynx_mode": "int3"})


def test_docs_take_the_table():
    from lynx_connector.lab import docgen

    doc = docgen.DOC.read_text()
    assert docgen.current_table(doc, docgen.MODES_BEGIN, docgen.MODES_END) == modes.modes_table(), (
        "docs/OPERATIONS.md modes table is stale: run `python -m lynx_connector.lab.docgen`")
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| mode (`lynx_mode`)"):]
    table = table[:table.index("\n\n")]
    assert sorted(re.findall(r"`([a-z0-9_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:]))) \
        == sorted(MODE_NAMES)


def _mode_lists(path: Path) -> list[str]:
    """Tuple/list/set literals of two or more mode names."""
    return [f"{path}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.Tuple, ast.List, ast.Set)) and len(n.elts) >= 2
            and all(isinstance(e, ast.Constant) and e.value in MODE_NAMES for e in n.elts)]


def _codec_picks(path: Path) -> list[str]:
    """``"lynx" if mode in ...``: a codec chosen by a list of modes instead of the table."""
    return [f"{path}: {line.strip()}" for line in path.read_text().splitlines()
            if re.search(r"[\"']lynx[\"'] if [\w.]+ (not )?in\b", line)]


def test_no_other_mode_list():
    package = ROOT / "lynx_connector"
    runtime = [p for p in package.rglob("*.py") if p.name != "modes.py" and "lab" not in p.relative_to(package).parts]
    assert [hit for p in runtime for hit in _mode_lists(p)] == []
    assert [hit for p in package.rglob("*.py") for hit in _codec_picks(p)] == []
