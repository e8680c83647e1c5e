"""The fake quantizer of benchmarks/anchor_search.py: the codec's twin for its groupings, and the search-only
options (symmetric groups, int8 outlier channels) within their error bounds and bit counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.anchor_search import Fmt, TensorFmt, fake_quant, quantize_cache, self_check


def _kv(outlier: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(192, 2, 64, generator=gen) * torch.linspace(0.2, 3.0, 64)
    if outlier is not None:
        x[:, :, outlier] *= 40.0
    return x


def test_fake_quant_equals_the_codec_twin() -> None:
    self_check()  # raises when fake_quant and kernels.groupquant_ref differ


@pytest.mark.parametrize("fmt", [TensorFmt("token", symmetric=True), TensorFmt("channel", 64, symmetric=True)])
def test_symmetric_groups_stay_within_half_a_step(fmt: TensorFmt) -> None:
    x = _kv()
    anchor, full = fake_quant(x, fmt)
    dim = -1 if fmt.group == "token" else 0
    if fmt.group == "token":
        amax = x.abs().amax(dim, keepdim=True)
    else:
        amax = x.view(-1, 64, *x.shape[1:]).abs().amax(1, keepdim=True).expand(-1, 64, -1, -1).reshape(x.shape)
    step = amax / 7  # 4 bits: codes -7..7
    assert bool(((anchor - x).abs() <= step * 0.5 * 1.01 + 1e-6).all())
    assert bool(((full - x).abs() <= step / 32 * 1.01 + 1e-6).all())  # 16 residual cells of the step
    assert fmt.bits_per_value(1024, 64) == pytest.approx(4.25 if fmt.group == "token" else 4 + 16 / 64)


def test_outlier_channels_are_sent_at_int8() -> None:
    x = _kv(outlier=7)
    plain_a, _ = fake_quant(x, TensorFmt("token"))
    anchor, full = fake_quant(x, TensorFmt("token", outliers=1))
    err = lambda z: float((z - x).pow(2).sum() / x.pow(2).sum())  # noqa: E731
    assert err(anchor) < 0.2 * err(plain_a)  # the other channels no longer share the outlier's range
    col = x[:, :, 7]
    step = (col.amax(0) - col.amin(0)) / 255
    assert bool(((anchor[:, :, 7] - col).abs() <= step * 0.51 + 1e-5).all())
    assert torch.equal(anchor[:, :, 7], full[:, :, 7])
    # 63 channels at 4 bits + 1 at 8, one fp32 (two fp16) of metadata per token and head, and per outlier channel
    assert TensorFmt("token", outliers=1).bits_per_value(1024, 64) == pytest.approx(
        (63 * 4 + 8) / 64 + 32 / 64 + 32 / (1024 * 64))
    assert Fmt("o", TensorFmt("token", outliers=1), TensorFmt("token")).bits() < 4.6
    with pytest.raises(ValueError, match="token-group"):
        fake_quant(x, TensorFmt("channel", 64, outliers=1))


def test_mixed_layers_give_their_layers_the_higher_bits() -> None:
    f = Fmt("m", TensorFmt("channel", 64), TensorFmt("token"), hi_layers=(0, 29))
    assert f.at(0)[0].bits == 5 and f.at(29)[1].bits == 5 and f.at(1) == (f.k, f.v)
    # two of thirty layers pay one more bit per value
    assert f.bits() == pytest.approx(4.5 + 2 / 30)
    x = _kv()
    assert float((fake_quant(x, f.at(0)[1])[0] - x).abs().max()) < float((fake_quant(x, f.v)[0] - x).abs().max())


def test_progressive_layers_decode_on_anchor_plus_residual_and_count_its_bits() -> None:
    """A ``full_layers`` candidate (the residual of some layers landed) puts the full reconstruction into those
    layers' cache and the anchor elsewhere, and counts 4 more bits/value for each landed layer."""
    base = Fmt("b", TensorFmt("channel", 64), TensorFmt("token"))
    half = Fmt("p", TensorFmt("channel", 64), TensorFmt("token"), full_layers=tuple(range(15)))
    assert half.bits() == pytest.approx(base.bits() + 2.0)
    g = torch.Generator().manual_seed(0)
    layers = [SimpleNamespace(keys=torch.randn(1, 2, 128, 64, generator=g),
                              values=torch.randn(1, 2, 128, 64, generator=g)) for _ in range(30)]
    exact = [(lay.keys.clone(), lay.values.clone()) for lay in layers]
    quantize_cache(SimpleNamespace(layers=layers), half)

    def err(i: int) -> float:
        return float((layers[i].values - exact[i][1]).pow(2).mean() / exact[i][1].pow(2).mean())

    assert err(0) < 1e-4 < 1e-3 < err(29)  # full precision (~8.5 bits) where landed, the 4-bit anchor elsewhere


def test_divergences_against_the_exact_tokens_or_a_reference_candidate() -> None:
    from benchmarks.anchor_search import EXACT, divergences, markdown

    seqs = {EXACT: [[1, 2, 3, 4], [5, 6, 7, 8]], "anchor": [[1, 2, 9, 9], [5, 6, 7, 8]],
            "full": [[1, 2, 9, 4], [5, 0, 7, 8]]}
    assert divergences(seqs) == {"anchor": [2, 4], "full": [2, 1]}
    # against lynx full: the anchor follows full's first prompt one token further and leaves its second at 1
    assert divergences(seqs, "full") == {"anchor": [3, 1], "full": [4, 4]}
    row = {"name": "anchor", "bits": 4.5, "in_budget": True, **dict.fromkeys(
        ("vnmse_k", "vnmse_v", "full_vnmse_k", "full_vnmse_v", "attn_err", "attn_err_k", "attn_err_v", "dnll",
         "dnll_ci95"), 0.0), "first_div": [2, 4], "first_div_ref": [3, 1]}
    result = {"model": "m", "command": "c", "wall_s": 1.0, "sink_share": 0.5, "formats": [row],
              "sink_norm_ratio": {"k": {"median": 1.0, "min": 1.0, "max": 1.0}},
              "config": {"windows": 1, "window_tokens": 8, "continuation_tokens": 4, "prompts": 2, "context": 8,
                         "tokens": 4, "reference": "full"}}
    table = markdown(result)
    assert "| 3.0 | 3.0 | 2.0 | 2.0 |" in table and "`full`'s KV" in table
    header, rule = [line for line in table.splitlines() if line.startswith("|")][:2]
    assert header.count("|") == rule.count("|")
