"""``lynx bench model``: the arithmetic on tiny hand-checked cases, the reading of the measured result files, the
calibration, and the CLI's outputs. Nothing here runs an engine; no timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lynx_connector import cli
from lynx_connector.lab.bench import model as bench_model
from lynx_connector.lab.bench import model_inputs
from lynx_connector.lab.bench.ttft_model import (
    Acceptance,
    Assumptions,
    Constants,
    ModeCost,
    Workload,
    calibrate,
    predict,
    serve_link,
)
from lynx_connector.modes import comparison_order, get_mode

GB = 10**9
# 8 Gbit/s at efficiency 1 and achieved/paced 1: exactly 1e9 bytes/s
LINK = 8.0


def _constants(anchor_share: float = 1.0, acceptance: float = 1.0, held_cap: float | None = None,
               control_s: float = 0.0) -> Constants:
    return Constants(codec_frac={}, merge_frac=1.0, transport_ratio=1.0, anchor_share=anchor_share,
                     descriptors_per_region=1, control_s=control_s,
                     acceptance=Acceptance(acceptance, held_cap, "test"), max_speculative_tokens=64)


ASSUME = Assumptions(prefill_s=1.0, link_efficiency=1.0, decode_step_s=0.1, gpu_memcpy_gbps=1.0,
                     per_descriptor_s=0.0, verify_steps=1.0, encode_on_critical_path=0.0)


def _cost(mode: str, anchor: float, residual: float = 0.0) -> ModeCost:
    m = get_mode(mode)
    first = anchor if m.first_token_after == "anchor" else anchor + residual
    return ModeCost(m, int(anchor), int(residual), int(first), encode_layer_s=0.1, decode_layer_s=0.05,
                    merge_layer_s=0.05)


# ---- the link ------------------------------------------------------------------------------------------------
def test_link_serves_in_order_and_waits_for_ready_items() -> None:
    a, r = serve_link([(0.0, GB), (5.0, GB)], [], rate=GB, anchor_share=1.0)
    assert a == pytest.approx([1.0, 6.0]) and r == []


def test_link_shares_between_streams_then_gives_the_rest_to_one() -> None:
    # both 1 GB at t=0, anchor 3/4 of 1 GB/s: anchor done at 4/3 s; the residual had 1/3 GB by then, rest at 1 GB/s
    a, r = serve_link([(0.0, GB)], [(0.0, GB)], rate=GB, anchor_share=0.75)
    assert a == pytest.approx([4 / 3]) and r == pytest.approx([2.0])
    a, r = serve_link([(0.0, GB)], [(0.0, GB)], rate=GB, anchor_share=1.0)  # strict priority
    assert a == pytest.approx([1.0]) and r == pytest.approx([2.0])


# ---- one request, by hand -----------------------------------------------------------------------------------
def test_sequential_single_stream_by_hand() -> None:
    # prefill 1 + encode 2 x 0.1 = 1.2; 2 layers x 0.5 GB at 1 GB/s land at 1.7, 2.2; decode 2 x 0.05 -> 2.3
    p = predict(_cost("int8", 0.5 * GB), "sequential", LINK, 2, ASSUME, _constants())
    assert p["p_done_s"] == pytest.approx(1.2)
    assert p["all_landed_s"] == pytest.approx(2.2)
    assert p["ttft_s"] == pytest.approx(2.4)  # + one decode step
    assert p["tt32t_s"] == pytest.approx(2.4 + 31 * 0.1)
    assert p["limit_ttft_s"] == pytest.approx(max(1.0, 1.0) + 0.1)


def test_pipelined_single_stream_by_hand() -> None:
    # layer forwards end at 0.5, 1.0; encodes at 0.6, 1.1; the link carries 0.6-1.1 and 1.1-1.6; decodes 1.15, 1.65
    p = predict(_cost("int8", 0.5 * GB), "pipelined", LINK, 2, ASSUME, _constants())
    assert p["all_landed_s"] == pytest.approx(1.6)
    assert p["ttft_s"] == pytest.approx(1.75)
    # the encode on the critical path slows each layer's forward by its encode time
    slow = predict(_cost("int8", 0.5 * GB), "pipelined", LINK, 2,
                   Assumptions(**{**ASSUME.__dict__, "encode_on_critical_path": 1.0}), _constants())
    assert slow["p_done_s"] == pytest.approx(1.3)  # forwards end 0.6, 1.2; encodes 0.7, 1.3


def test_pipelined_waits_for_the_side_channel_at_least_once() -> None:
    p = predict(_cost("int8", 0.5 * GB), "pipelined", LINK, 2, ASSUME, _constants(control_s=2.0))
    # layer 0 is ready at 0.6 + 1.0 (one-way notify) but D's first query returns at 2.0: 2.0-2.5, then 2.5-3.0
    assert p["all_landed_s"] == pytest.approx(3.0)


@pytest.mark.parametrize(("acceptance", "tt32"), [(1.0, 2.4 + 26 * 0.1), (0.5, 2.4 + 28 * 0.1)])
def test_speculative_by_hand(acceptance: float, tt32: float) -> None:
    # start 1.2; anchors (0.25 GB per layer) land 1.45, 1.7; residuals 1.95, 2.2; anchor KV written 1.8, TTFT 1.9;
    # merge 2 x 0.05 -> 2.3; 4 tokens held (1.9 + 4 x 0.1 = 2.3); verify -> 2.4; released 2 + accepted
    p = predict(_cost("speculative", 0.25 * GB, 0.25 * GB), "sequential", LINK, 2, ASSUME,
                _constants(acceptance=acceptance))
    assert p["anchor_landed_s"] == pytest.approx(1.7) and p["all_landed_s"] == pytest.approx(2.2)
    assert p["ttft_s"] == pytest.approx(1.9)
    assert p["residual_merged_s"] == pytest.approx(2.3)
    assert p["held_tokens"] == 4 and p["accepted_tokens"] == pytest.approx(4 * acceptance)
    assert p["tt32t_s"] == pytest.approx(tt32)
    capped = predict(_cost("speculative", 0.25 * GB, 0.25 * GB), "sequential", LINK, 2, ASSUME,
                     _constants(held_cap=1.0))
    assert capped["held_tokens"] == 1 and capped["tt32t_s"] == pytest.approx(2.4 + 29 * 0.1)


def test_full_mode_waits_for_both_planes() -> None:
    p = predict(_cost("full", 0.25 * GB, 0.25 * GB), "sequential", LINK, 2, ASSUME, _constants())
    assert p["ttft_s"] == pytest.approx(2.2 + 2 * 0.05 + 0.1)


def test_calibration_recovers_the_assumptions_that_made_the_reference() -> None:
    truth = Assumptions(**{**ASSUME.__dict__, "prefill_s": 0.3, "link_efficiency": 0.8})
    costs = {m: _cost(m, b * GB) for m, b in (("bf16", 1.0), ("int8", 0.5), ("int4", 0.25))}
    ref = {m: predict(c, "sequential", LINK, 2, truth, _constants())["ttft_s"] for m, c in costs.items()}
    free = Assumptions(**{**ASSUME.__dict__, "prefill_s": None, "link_efficiency": None})
    got, info = calibrate(free, ref, costs, LINK, 2, _constants())
    assert got.prefill_s == pytest.approx(0.3) and got.link_efficiency == pytest.approx(0.8)
    assert info["calibrated"] == ["prefill_s", "link_efficiency"]
    # rows that would need a link faster than its nominal rate are refused, not fitted
    with pytest.raises(ValueError, match="link efficiency"):
        calibrate(free, {m: v / 10 for m, v in ref.items()}, costs, LINK, 2, _constants())


def test_assumptions_are_validated() -> None:
    with pytest.raises(ValueError, match="link_efficiency"):
        Assumptions(link_efficiency=1.5)
    with pytest.raises(ValueError, match="decode_step_s"):
        Assumptions(decode_step_s=-1.0)
    with pytest.raises(ValueError, match="tokens"):
        Workload("m", 1, 1, 1, 0)


# ---- the measured files -------------------------------------------------------------------------------------
def _write_results(d: Path) -> None:
    rows = [{"codec": c, "encode_gbps": 2.0, "decode_gbps": 5.0} for c in
            ("lynx_anchor", "bf16", "fp8", "int8", "int4", "int4_kivi")]
    rows.append({"codec": "lynx_full", "encode_gbps": 2.0, "decode_gbps": 4.0, "merge_gbps": 2.5})
    (d / "codec.json").write_text(json.dumps({"bench": "codec", "memcpy_gbps": 10.0, "rows": rows,
                                              "model": "m", "cache_dtype": "float32"}))

    def row(scheme: str, rate: float, frac: float, t_full: float, nbytes: int, **kw: float) -> dict:
        return {"scheme": scheme, "link_gbps": rate, "rate_frac": frac, "t_full_s": t_full, "t_data_s": t_full - 0.001,
                "bytes": nbytes, "descriptors": 2 if scheme == "lynx" else 1, **kw}

    transfer = {"bench": "transfer", "rows": [
        row("int4", 10.0, 1.02, 1.0, 100), row("lynx", 10.0, 1.01, 2.0, 200, t_anchor_s=1.25, anchor_bytes=100,
                                               residual_bytes=100),
        row("int4", 50.0, 0.5, 1.0, 100), row("lynx", 50.0, 0.6, 2.0, 200, t_anchor_s=5.0, anchor_bytes=100,
                                              residual_bytes=100)],
        "checks": [{"row": "bf16@10", "metric": "achieved / paced rate (worst scheme)", "pass": True},
                   {"row": "int4@50", "metric": "achieved / paced rate (worst scheme)", "pass": False}]}
    (d / "transfer.json").write_text(json.dumps(transfer))
    spec = {"mode": "speculative", "concurrency": 1, "n": 2, "speculated": 10, "accepted": 9}
    (d / "e2e_gate.json").write_text(json.dumps({"bench": "e2e", "rows": [spec, {**spec, "concurrency": 4}]}))
    (d / "e2e.json").write_text(json.dumps({"bench": "e2e", "rows": [{**spec, "n": 3, "speculated": 5,
                                                                       "accepted": 5}]}))


def test_reads_the_measured_files(tmp_path: Path) -> None:
    _write_results(tmp_path)
    c, rec = model_inputs.read_constants(tmp_path)
    assert c.codec_frac["int8"] == pytest.approx((0.2, 0.5)) and c.merge_frac == pytest.approx(0.25)
    assert rec["transfer"]["rates_used_gbps"] == [10.0]  # 50 failed its check: the machine, not the transport
    assert c.transport_ratio == 1.0 and rec["transfer"]["transport_ratio_worst"] == pytest.approx(1.01)
    assert c.anchor_share == pytest.approx(0.8)  # int4 0.01 s/B over lynx anchor 0.0125 s/B
    assert c.descriptors_per_region == 1 and c.control_s == pytest.approx(0.001)
    # pooled at concurrency 1 over both files: 14 of 15 held tokens, 15 held over 5 requests
    assert c.acceptance.acceptance == pytest.approx(14 / 15) and c.acceptance.held_cap == pytest.approx(3.0)
    given, _ = model_inputs.read_constants(tmp_path, acceptance=0.5, held_cap=0)
    assert given.acceptance.acceptance == 0.5 and given.acceptance.held_cap is None


def test_missing_or_wrong_file_says_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(model_inputs.MissingResultError, match="lynx bench codec --out"):
        model_inputs.read_constants(tmp_path)
    _write_results(tmp_path)
    (tmp_path / "transfer.json").write_text(json.dumps({"bench": "codec"}))
    with pytest.raises(model_inputs.MissingResultError, match="not a `lynx bench transfer` result"):
        model_inputs.read_constants(tmp_path)


def test_bytes_come_from_the_codec_registry(tmp_path: Path) -> None:
    _write_results(tmp_path)
    c, _ = model_inputs.read_constants(tmp_path)
    w = Workload("t", layers=2, kv_heads=2, head_dim=64, tokens=256)
    costs = model_inputs.mode_costs([get_mode(n) for n in comparison_order()], w, c, Assumptions())
    assert costs["bf16"].layer_anchor == 2 * 256 * 2 * 64 * 2 and costs["bf16"].layer_residual == 0
    full, spec, anchor = costs["full"], costs["speculative"], costs["anchor"]
    assert full.layer_residual == spec.layer_residual > 0 and anchor.layer_residual == 0
    assert spec.layer_first == spec.layer_anchor and full.layer_first == full.layer_anchor + full.layer_residual


def test_the_real_result_files_parse() -> None:
    c, rec = model_inputs.read_constants(model_inputs.RESULTS)
    assert 0 < c.transport_ratio <= 1 and 0 < c.anchor_share <= 1 and 0 <= c.acceptance.acceptance <= 1
    assert rec["transfer"]["rates_used_gbps"] and rec["acceptance"]["files"]


# ---- the CLI ------------------------------------------------------------------------------------------------
def test_cli_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    assert cli.main(["bench", "model", "--out", str(out), "--links", "10,100"]) == 0
    result = json.loads(out.read_text())
    assert (tmp_path / "model.md").read_text().startswith("## lynx bench model")
    assert (tmp_path / "model_ttft_vs_link.png").stat().st_size > 0
    gate = [c for c in result["checks"] if c["gate"]]
    assert {c["mode"] for c in gate} == set(bench_model.PAPER["rows"])
    assert result["check_passed"] == all(c["pass"] for c in gate)
    assert all(c["pass"] == (abs(c["model"] / c["paper"] - 1) <= bench_model.TOLERANCE) for c in result["checks"])
    flows = {"sequential", "pipelined"} if result["check_passed"] else {"sequential"}
    got = {(r["mode"], r["flow"], r["link_gbps"]) for r in result["rows"]}
    assert got == {(m, f, x) for m in comparison_order() for f in flows for x in (10.0, 100.0)}
    assert result["calibration"]["calibrated"] == ["prefill_s", "link_efficiency"]
    assert all("why" in v for v in result["assumptions"].values())


def test_cli_without_a_passing_check_predicts_no_pipelined_flow(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    # a prefill of 3 s cannot give the paper's 1.4 s INT4 TTFT: the check fails, the pipelined flow is withheld
    cli.main(["bench", "model", "--out", str(out), "--prefill-s", "3", "--link-efficiency", "0.9",
              "--modes", "int4,speculative"])
    result = json.loads(out.read_text())
    assert not result["check_passed"] and result["flows"] == ["sequential"]
    assert {r["flow"] for r in result["rows"]} == {"sequential"} and "not predicted" in result["pipelined"]
    assert result["calibration"]["calibrated"] == []
    cli.main(["bench", "model", "--out", str(out), "--prefill-s", "3", "--link-efficiency", "0.9", "--force"])
    assert "unchecked" in json.loads(out.read_text())["pipelined"]


def test_cli_missing_inputs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="lynx bench model: .*codec.json not found: run `lynx bench codec"):
        cli.main(["bench", "model", "--results-dir", str(tmp_path), "--out", str(tmp_path / "m.json")])
    assert not (tmp_path / "m.json").exists()


def test_from_an_installed_wheel_results_are_the_working_directory_s_and_git_is_not_asked(tmp_path) -> None:
    """Installed, the package's parents are site-packages: the default results folder was site-packages/benchmarks
    (read nothing, --out wrote there) and git described whatever repository holds site-packages. From a checkout
    it is the checkout's."""
    from lynx_connector.lab.bench import common

    assert model_inputs.RESULTS == Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # a checkout
    assert common.git_revision(None) == {"commit": None, "dirty": None}
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "lynx_connector" / "lab" / "bench").mkdir(parents=True)
    fake = site / "lynx_connector" / "lab" / "bench" / "common.py"
    fake.write_text(Path(common.__file__).read_text())
    spec = importlib.util.spec_from_file_location("wheel_common", fake)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.REPO_ROOT is None and common.REPO_ROOT == Path(__file__).resolve().parents[2]
