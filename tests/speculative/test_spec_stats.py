"""Speculation counters in the connector's stats (the KV Transfer metrics line)."""

from __future__ import annotations

from lynx_connector.stats import LynxStats


def test_speculation_counters_reduce_and_aggregate() -> None:
    a, b = LynxStats(), LynxStats()
    a.record_speculation(16, 12)
    b.record_speculation(4, 4, early=1)
    total = a.aggregate(b).reduce()
    assert total["First tokens released on the anchor"] == 1
    assert total["Speculated tokens"] == 20 and total["Accepted tokens"] == 16
    assert total["Rejected tokens"] == 4 and total["Acceptance rate"] == 0.8
    assert "Speculated tokens" not in LynxStats().reduce()
