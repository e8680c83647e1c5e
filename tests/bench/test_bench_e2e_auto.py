"""``lynx bench e2e --modes auto``: P's choices read from its counter and its log, rows built from the mode chosen
per request, the flow the proxy really used, issue 16's target and the Markdown, all on synthetic inputs (the
real run is benchmarks/results/e2e_auto.json, made by the command in benchmarks/README.md)."""

from __future__ import annotations

import pytest

from lynx_connector.lab.bench import e2e, report
from lynx_connector.lab.bench.e2e import choices
from lynx_connector.lab.bench.e2e.cli import add_parser
from lynx_connector.lab.bench.e2e.measure import attribute_auto, request_modes

SHAPE = e2e.ModelShape(layers=30, kv_heads=3, head_dim=64)

METRICS = """# HELP vllm:lynx_auto_choices_total Transfer modes chosen by auto on P
# TYPE vllm:lynx_auto_choices_total counter
vllm:lynx_auto_choices_total{engine="0",mode="speculative",model_name="m",reason="slow_link"} 3.0
vllm:lynx_auto_choices_created{engine="0",mode="speculative",model_name="m",reason="slow_link"} 1.7e9
vllm:lynx_auto_choices_total{engine="1",mode="speculative",model_name="m",reason="slow_link"} 1.0
vllm:lynx_auto_choices_total{engine="0",mode="bf16",model_name="m",reason="no_link_rate"} 2.0
vllm:lynx_transfer_bytes_total{engine="0",stream="anchor"} 5.0
"""


def _req(rid: str, ttft: float = 1.0, seed: int = 1, mode: str = "auto") -> dict:
    return {"mode": mode, "request_id": rid, "prompt_tokens": 1100, "seed": seed, "depth": None, "ttft_s": ttft,
            "tt32_s": ttft + 1, "tt64_s": ttft + 2, "tokens": 64, "total_s": ttft + 2, "error": None,
            "needle_found": None, "text_sha1": "a", "rate_label": "r", "concurrency": 1, "nominal_tokens": 1024,
            "link_gbps": 0.1, "flow": "sequential"}


def test_counter_parsed_by_mode_and_reason_summed_over_engines() -> None:
    got = choices.parse_auto_choices(METRICS)
    assert got == {("speculative", "slow_link"): 4.0, ("bf16", "no_link_rate"): 2.0}  # _created ignored
    later = dict(got)
    later[("speculative", "slow_link")] += 2
    later[("full", "slow_link_no_speculation")] = 1.0
    assert choices.choice_delta(got, later) == {("speculative", "slow_link"): 2, ("full", "slow_link_no_speculation"): 1}
    assert choices.choice_delta(None, later) is None  # P's /metrics unreadable: unknown, not zero


def test_log_lines_matched_to_the_bench_request_ids() -> None:
    log = ("(EngineCore_DP0 pid=7) INFO 12-01 19:00:01 [auto.py:255] Request cmpl-lynxbench-ab-00010-0-1a2b3c4d: "
           "auto chose full (slow_link_no_speculation): link 0.25 Gbit/s (configured), ...\n"
           "INFO [auto.py:255] Request cmpl-lynxbench-ab-00001-0-ffff0000: auto chose speculative (slow_link): ...\n"
           "INFO [auto.py:255] Request cmpl-someone-else-0-00000000: auto chose bf16 (fast_link): ...\n")
    got = choices.parse_choice_log(log, ["lynxbench-ab-00001", "lynxbench-ab-00010", "lynxbench-ab-00002"])
    # 00001 is not taken for 00010's line (the id ends at "-"), 00002 was not logged
    assert got == {"lynxbench-ab-00001": ("speculative", "slow_link"),
                   "lynxbench-ab-00010": ("full", "slow_link_no_speculation")}


def test_attribution_from_the_log_checked_against_the_counter(tmp_path) -> None:
    log = tmp_path / "prefill.log"
    log.write_text("Request cmpl-old-0-0: auto chose bf16 (fast_link)\n")
    at = choices.log_size(log)
    with open(log, "a") as f:
        f.write("Request cmpl-a-0-1: auto chose speculative (slow_link)\nRequest cmpl-b-0-2: auto chose full "
                "(slow_link_no_speculation)\n")
    reqs = [_req("a"), _req("b", seed=2)]
    before = {("speculative", "slow_link"): 5.0}
    after = {("speculative", "slow_link"): 6.0, ("full", "slow_link_no_speculation"): 1.0}
    delta, source = attribute_auto(reqs, log, at, before, after)
    assert source == "p_log"
    assert choices.summarize_choices(reqs, delta) == {"chosen": {"speculative": 1, "full": 1},
                                                      "chosen_reasons": {"slow_link": 1, "slow_link_no_speculation": 1}}
    assert [(r["auto_mode"], r["auto_reason"]) for r in reqs] == [("speculative", "slow_link"),
                                                                  ("full", "slow_link_no_speculation")]
    assert request_modes(reqs, "auto") == ["speculative", "full"] and request_modes(reqs, "int8") == ["int8"] * 2


def test_attribution_falls_back_to_the_counter_only_when_it_is_unambiguous() -> None:
    reqs = [_req("a"), _req("b")]
    # nothing logged; the counter says both were bf16: that is each request's mode
    assert choices.attribute(reqs, {}, {("bf16", "fast_link"): 2}) == "p_metrics"
    assert [r["auto_mode"] for r in reqs] == ["bf16", "bf16"]
    # the log disagrees with the counter, which names two modes: no request gets a mode
    logged = {"a": ("bf16", "fast_link"), "b": ("bf16", "fast_link")}
    assert choices.attribute(reqs, logged, {("bf16", "fast_link"): 1, ("full", "slow_link_no_speculation"): 1}) \
        == "unresolved"
    assert [r["auto_mode"] for r in reqs] == [None, None]
    # the log alone (counter unreadable) is taken as it is
    assert choices.attribute(reqs, logged, None) == "p_log"


def test_auto_row_uses_each_requests_chosen_mode() -> None:
    reqs = [_req("a", 1.0), _req("b", 2.0, seed=2)]
    reqs[0].update(auto_mode="speculative", auto_reason="slow_link")
    reqs[1].update(auto_mode="bf16", auto_reason="fast_link")
    delta = {"lynx_drafted": 8.0, "lynx_accepted": 8.0, "lynx_early": 1.0}
    row = e2e.summarize_cell(reqs, "auto", 1024, 2, 0.1, "r", 0.5, SHAPE, delta)
    spec, bf16 = e2e.wire_bytes("speculative", 1100, SHAPE), e2e.wire_bytes("bf16", 1100, SHAPE)
    assert row["mode"] == "auto" and row["wire_bytes"] == round((spec[1] + bf16[1]) / 2)
    # a batch of two: the speculative request's anchor, then the bf16 request's whole KV, on the link in order
    ideals = e2e.ideal_ttfts(0.5, [spec[0], bf16[0]], 0.1)
    assert row["ideal_ttft_s"] == pytest.approx(e2e.quantile(ideals, 0.5))
    assert row["acceptance"] == 1.0 and row["first_token_on_anchor"] == 1  # a speculative choice: figures kept
    only_bf16 = [dict(r, auto_mode="bf16") for r in reqs]
    assert e2e.summarize_cell(only_bf16, "auto", 1024, 2, 0.1, "r", 0.5, SHAPE, delta)["speculated"] is None
    unknown = [dict(r, auto_mode=None) for r in reqs]
    blind = e2e.summarize_cell(unknown, "auto", 1024, 2, 0.1, "r", 0.5, SHAPE, {})
    assert blind["wire_bytes"] is None and blind["ideal_ttft_s"] is None and blind["limit_ttft_s"] is None
    assert blind["ttft_s_median"] == 1.5  # the measurement itself stays


def test_rederived_ideals_follow_the_stored_choices() -> None:
    reqs = [_req("a"), _req("b", seed=2)]
    for r, m in zip(reqs, ("full", "speculative"), strict=True):
        r["auto_mode"] = m
    row = e2e.summarize_cell(reqs, "auto", 1024, 1, 0.1, "r", 0.5, SHAPE, {})
    row["flow"] = "sequential"
    expected = row["ideal_ttft_s"]
    row["ideal_ttft_s"] = None
    result = {"model_shape": SHAPE.__dict__, "rows": [row], "requests": reqs, "config": {"ratios": [2.0]}}
    e2e.rederive_ideals(result)
    assert row["ideal_ttft_s"] == pytest.approx(expected)
    reqs[1]["auto_mode"] = None
    e2e.rederive_ideals(result)
    assert row["ideal_ttft_s"] is None and row["limit_ttft_s"] is None


def test_rederived_ideal_and_limit_take_each_round_on_its_own() -> None:
    """A stored ``--batches 2`` row at concurrency 2: re-derived, its ideal and limit are those of one round of two
    requests (what summarize_cell computes), not of the four requests queued as one batch."""
    reqs = [dict(_req(f"r{i}", seed=i % 2, mode="int8"), concurrency=2) for i in range(4)]
    row = e2e.summarize_cell(reqs, "int8", 1024, 2, 0.1, "r", 0.5, SHAPE, {}, batches=2)
    row.update(flow="sequential", batches=2)
    expected = row["ideal_ttft_s"], row["limit_ttft_s"]
    one_round = e2e.ideal_ttfts(0.5, [e2e.wire_bytes("int8", 1100, SHAPE)[0]] * 2, 0.1)
    assert expected[0] == pytest.approx(e2e.quantile(one_round, 0.5))
    row["ideal_ttft_s"] = row["limit_ttft_s"] = 99.0  # as an older version stored them
    result = {"model_shape": SHAPE.__dict__, "rows": [row], "requests": reqs, "config": {"ratios": [2.0]}}
    e2e.rederive_ideals(result)
    assert (row["ideal_ttft_s"], row["limit_ttft_s"]) == (pytest.approx(expected[0]), pytest.approx(expected[1]))


def _row(mode: str, ttft: float | None, conc: int = 1, flow: str = "sequential") -> dict:
    return {"mode": mode, "rate_label": "r", "concurrency": conc, "nominal_tokens": 512, "flow": flow,
            "ttft_s_median": ttft, "target_ratio": None}


def test_auto_target_against_the_best_fixed_mode_of_the_same_cell() -> None:
    rows = [_row("auto", 1.04), _row("bf16", 2.0), _row("full", 1.2), _row("speculative", 1.0),
            _row("auto", 3.0, conc=4), _row("full", 2.0, conc=4),
            _row("auto", 1.0, flow="pipelined")]
    checks = e2e.targets.auto_checks(rows)
    assert [c["pass"] for c in checks] == [True, False, None]
    c1, c4, alone = checks
    assert c1["value"] == pytest.approx(1.04) and "speculative; conc 1" in c1["metric"]
    assert "not run: int8" in c1["metric"]  # int8 was not in the run: named, the others compared
    assert c4["value"] == pytest.approx(1.5) and "not run: bf16, int8, speculative" in c4["metric"]
    assert alone["value"] is None and alone["note"].startswith("not run")  # no rival through that proxy
    assert any(c["metric"].startswith("auto TTFT") for c in e2e.evaluate_targets(rows))


def test_markdown_shows_the_choices_and_the_flow_used() -> None:
    auto = _row("auto", 1.0, flow="pipelined")
    fixed = _row("full", 1.1, flow="pipelined")
    for r in (auto, fixed):
        r.update(prompt_tokens=512, n=4, errors=0, ttft_s_p90=1.2, tt32_s_median=2, tt32_s_p90=2, tt64_s_median=3,
                 tt64_s_p90=3, wire_bytes=10**7, ideal_ttft_s=0.9, ttft_vs_ideal=1.1)
    auto.update(chosen={"speculative": 3, "full": 1}, chosen_reasons={"slow_link": 3, "slow_link_no_speculation": 1},
                chosen_source="p_log", flow_used={"sequential": 4})
    fixed["flow_used"] = {"pipelined": 4}
    rows = [auto, fixed]
    result = {"bench": "e2e", "rows": rows, "checks": e2e.evaluate_targets(rows), "config": {}, "model": "m",
              "deployments": [], "speculative": {"available": True, "note": "n"}}
    md = report.e2e_markdown(result)
    assert "auto chose (reasons)" in md
    assert "full 1, speculative 3 (slow_link 3, slow_link_no_speculation 1)" in md
    assert "pipelined (used: sequential 4)" in md  # auto went the sequential way behind the pipelined proxy
    assert "| pipelined |" in md  # full really was pipelined
    assert "PASS" in md  # 1.0 / 1.1


def test_cli_accepts_auto_and_concurrency_8() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["e2e", "--modes", "auto,full", "--concurrency", "1,4,8", "--link-gbps", "0.5,1"])
    from lynx_connector.lab.bench.e2e.cli import _ints, run

    assert _ints(args.concurrency) == [1, 4, 8]
    with pytest.raises(SystemExit, match="auto with several --link-gbps"):  # auto passed the mode check
        run(args)
    with pytest.raises(SystemExit, match="or auto"):
        run(parser.parse_args(["e2e", "--modes", "auto,nope"]))
    assert e2e.kv_config(0.5, None, True).count('"auto_speculative": true') == 1
    assert "auto_speculative" not in e2e.kv_config(0.5)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_quick_run_with_auto_names_each_choice(tmp_path) -> None:
    """The real thing: P's log line and counter as the bench reads them, and the proxy's flow counts."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lynx_connector.lab.models import is_prepared
    from lynx_connector.modes import auto_candidates

    if not is_prepared():
        pytest.skip("the real model is not prepared")
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "lynx_connector.lab.bench.e2e", "--quick", "--modes", "full,auto",
                           "--out", str(out), "--log-dir", str(tmp_path / "logs")],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=850,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    shape = e2e.ModelShape(**result["model_shape"])
    autos = [r for r in result["rows"] if r["mode"] == "auto"]
    assert {(r["concurrency"], r["flow"]) for r in autos} == {(1, "sequential"), (1, "pipelined"), (2, "sequential"),
                                                             (2, "pipelined")}
    for row in autos:
        assert row["errors"] == 0 and row["chosen_source"] == "p_log", row  # every request found in P's log
        assert sum(row["chosen"].values()) == row["n"] and set(row["chosen"]) <= set(auto_candidates())
        assert row["flow_used"] == {row["flow"]: row["n"]}  # auto is pipelined behind the pipelined proxy too
        reqs = [q for q in result["requests"] if q["mode"] == "auto" and q["rate_label"] == row["rate_label"]
                and q["concurrency"] == row["concurrency"] and q["flow"] == row["flow"]]
        wire = [e2e.wire_bytes(q["auto_mode"], q["prompt_tokens"], shape)[1] for q in reqs]
        assert row["wire_bytes"] == round(sum(wire) / len(wire)) and row["ideal_ttft_s"] > 0
    piped = [r for r in result["rows"] if r["mode"] == "full" and r["flow"] == "pipelined"]
    assert piped and all(r["flow_used"].get("pipelined") == r["n"] for r in piped)
    assert any(c["metric"].startswith("auto TTFT / best fixed TTFT") for c in result["checks"])
