"""The gate-calibration arithmetic of benchmarks/anchor_agreement.py (the policy of lynx_connector.speculative)."""

from __future__ import annotations

import json

import pytest

from benchmarks.anchor_agreement import first_difference, gate_outcome


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3


def test_gate_outcome_follows_the_speculative_policy() -> None:
    margins = [0.1, 2.0, 1.5, 0.2, 3.0, 3.0]  # position 0 is P's token: its margin does not matter
    assert gate_outcome(0, margins, 0.4, 64) == (0, 0)  # first token differs from P's: nothing held
    assert gate_outcome(6, margins, 0.4, 64) == (2, 2)  # held 1, 2; stops at position 3 (0.2 < 0.4)
    assert gate_outcome(2, margins, 0.4, 64) == (2, 1)  # position 2 differs: only position 1 is accepted
    assert gate_outcome(6, margins, 0.0, 64) == (5, 5)  # gate off: every position after the first
    assert gate_outcome(6, margins, 0.0, 3) == (3, 3)  # the cap


def test_gate_adapt_replays_the_same_policy_and_its_gates() -> None:
    from benchmarks.gate_adapt import budget, first_error, fixed, outcome, running

    margins = [0.1, 2.0, 1.5, 0.2, 3.0, 3.0]
    row: dict = {"anchor_error": [0.05, 0.1]}
    for div in (0, 2, 6):
        for tau in (0.0, 0.4):
            for cap in (3, 64):
                assert outcome(div, margins, fixed(tau), cap, row) == gate_outcome(div, margins, tau, cap)
    # running: 1.5 is not below 0.5 x median(2.0); 0.2 is below the floor
    assert outcome(6, margins, running(0.5, 0.1), 64, row) == (2, 2)
    assert outcome(6, [0.1, 2.0, 0.9, 3.0], running(0.5, 0.1), 64, row) == (1, 1)  # 0.9 < 0.5 x 2.0
    # budget: exp(-2/0.5) + exp(-1.5/0.5) = 0.068 passes 0.1; adding exp(-0.2/0.5) = 0.67 does not
    assert outcome(6, margins, budget(0.5, 0.1), 64, row) == (2, 2)
    assert outcome(6, margins, budget(0.5, 0.01), 64, row) == (0, 0)
    # first error: tau = 4 x 0.05 = 0.2 holds position 3 (0.2 is not below 0.2)
    assert outcome(6, margins, first_error(4.0, 0.0, 1.0), 64, row) == (5, 5)
    assert outcome(6, margins, first_error(40.0, 0.0, 1.6), 64, row) == (1, 1)  # tau 1.6 stops at 1.5


def test_gate_adapt_main_writes_the_table_and_the_halvings(tmp_path) -> None:
    from benchmarks.gate_adapt import main

    # prompt k diverges at 3 + k % 5; its margins dip (0.05) right at the divergence and are high elsewhere
    prompts = []
    for k in range(12):
        div = 3 + k % 5
        margins = [2.0] * 16
        margins[div] = 0.05
        prompts.append({"seed": k, "first_difference": div, "anchor_margins": margins, "exact_margins": margins,
                        "anchor_error": [0.01 * k, 0.02, 0.03]})
    dump = tmp_path / "m.json"
    dump.write_text(json.dumps({"tokens": 16, "prompts": prompts}))
    out = tmp_path / "g.json"
    assert main([str(dump), "--splits", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    default = next(r for r in res["splits"] if r["gate"].startswith("fixed tau 0.4"))
    # the dip stops every anchor phase exactly at the divergence: all held tokens are accepted
    assert default["worst_acceptance"] == 1.0 and default["kept_floor"] == 1.0
    assert 2.0 <= default["accepted_per_prompt"] <= 6.0  # div - 1 per prompt, 2..6
    assert res["oracle_accepted"] == pytest.approx(sum(2 + k % 5 for k in range(12)) / 12)
    assert {r["gate"] for r in res["table"]} == {"fixed", "running", "budget", "first error"}
    assert (tmp_path / "g.md").read_text().startswith("## Adaptive confidence gate")
