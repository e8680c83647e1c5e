"""``lynx bench accuracy``: statistics helpers and the summary on synthetic generations (fast), the JSON shape of
a real ``--quick`` run with real P and D engines (slow). Accuracy values are not asserted beyond sanity."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_connector.lab.bench import accuracy, report

ROOT = Path(__file__).resolve().parents[2]


def test_wilson_interval() -> None:
    lo, hi = report.wilson(9, 10)
    assert 0.55 < lo < 0.6 and 0.98 < hi <= 1.0
    assert report.wilson(0, 5)[0] == 0.0 and report.wilson(5, 5)[1] == 1.0
    assert report.wilson(0, 0) == (None, None)


def test_mean_ci_uses_t_quantiles() -> None:
    m, (lo, hi) = accuracy.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert accuracy.mean_ci([1.0]) == (1.0, (None, None))
    assert accuracy.t95(100) == 1.984 and accuracy.t95(22) == accuracy.t95(20)
    assert accuracy.t95(31) == 2.042 and accuracy.t95(1000) == 1.980  # never narrower than t(df) itself


def test_bits_per_value() -> None:
    assert accuracy.bits_per_value("bf16") == 32.0  # fp32 cache passthrough
    assert accuracy.bits_per_value("anchor") < accuracy.bits_per_value("int8") <= accuracy.bits_per_value("full")
    assert accuracy.bits_per_value("int4") == pytest.approx(4.5)


def test_engines_come_from_the_shared_harness_and_presets() -> None:
    """P and D are lab.engine.EngineProcess (no copy of the harness here); D's speculative arguments are
    presets.speculative_engine_args(SPEC_K)."""
    from lynx_connector import presets
    from lynx_connector.lab.engine import EngineProcess

    assert not hasattr(accuracy, "Engine") and not hasattr(accuracy, "_engine_main")
    assert accuracy.EngineProcess is EngineProcess
    kw, note = accuracy.speculative_overrides()
    assert kw == presets.speculative_engine_args(accuracy.SPEC_K) and str(accuracy.SPEC_K) in note


def _raw(tokens: list[list[int]], correct: list[bool], lps: list[list[float]]) -> dict:
    nd = [{"seed": i, "context_tokens": 1024 * (1 + i % 2), "depth": 0.5, "prompt_tokens": 1100, "answer": "1",
           "text": "", "token_ids": t, "correct": c, "num_cached_tokens": 1099}
          for i, (t, c) in enumerate(zip(tokens, correct, strict=True))]
    return {"needles": nd, "scored_logprobs": lps, "context_cached_tokens": [], "seconds": 1.0}


def test_summarize_against_reference() -> None:
    ref = _raw([[1, 2, 3], [4, 5, 6]], [True, True], [[-1.0, -1.0], [-2.0, -2.0]])
    got = _raw([[1, 2, 3], [4, 9, 6]], [True, False], [[-1.1, -1.1], [-2.1, -2.3]])
    s = accuracy.summarize("int4", got, ref)
    assert s["needle"]["correct"] == 1 and s["needle"]["ci95"][0] is not None
    assert s["greedy"]["equal"] == 1 and s["greedy"]["token_agreement"] == pytest.approx((1 + 1 / 3) / 2)
    assert s["perplexity"]["delta_nll_vs_bf16"] == pytest.approx((0.1 + 0.2) / 2)
    assert s["perplexity"]["ppl"] == pytest.approx(math.exp((1.1 * 2 + 2.1 + 2.3) / 4))
    result = {"bench": "accuracy", "modes": {"bf16": accuracy.summarize("bf16", ref, None), "int4": s,
                                             "speculative": {"available": False, "note": "x"}},
              "model": "m", "hardware": {}, "versions": {}, "git": {}, "wall_s": 1.0}
    md = report.accuracy_markdown(result)
    assert "not available" in md and "int4" in md


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_quick_run_writes_the_documented_json(tmp_path: Path) -> None:
    from lynx_connector.lab.models import is_prepared

    if not is_prepared():
        pytest.skip("the real model is not prepared")
    out = tmp_path / "accuracy.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "lynx_connector.lab.bench.accuracy", "--quick", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=850, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bench"] == "accuracy" and result["quick"] is True
    assert {"hardware", "versions", "git", "config", "modes", "speculative"} <= set(result)
    assert set(result["modes"]) == set(accuracy.MODES)
    for mode, r in result["modes"].items():
        if not r["available"]:
            assert mode == "speculative"
            continue
        assert r["needle"]["n"] >= 1 and 0 <= r["needle"]["accuracy"] <= 1
        if mode != "speculative":  # decode-time speculation: prompt scoring is full mode's (same planes)
            assert r["perplexity"]["ppl"] > 1 and r["perplexity"]["tokens"] > 0
        assert r["greedy"]["n"] == r["needle"]["n"]
    # lossless transfer of the fp32 cache: bf16 is the reference, full precision lynx stays close to it
    assert result["modes"]["full"]["perplexity"]["ppl"] == pytest.approx(result["modes"]["bf16"]["perplexity"]["ppl"],
                                                                          rel=0.02)
    assert (tmp_path / "accuracy.md").exists() and (tmp_path / "accuracy_vs_bytes.png").exists()
