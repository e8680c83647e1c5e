"""The gate-calibration arithmetic of benchmarks/anchor_agreement.py (the policy of lynx_connector.speculative)."""

from __future__ import annotations

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
