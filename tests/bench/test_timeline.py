"""lynx_connector/trace.py (the opt-in LYNX_TRACE timeline) and benchmarks/timeline.py, which lines it up."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest

from lynx_connector.trace import ENV, trace, tracing

ROOT = Path(__file__).resolve().parents[2]


def _timeline():
    spec = importlib.util.spec_from_file_location("timeline", ROOT / "benchmarks" / "timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_is_off_unless_the_environment_names_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    trace("P", "t1", "published")
    assert not tracing() and list(tmp_path.iterdir()) == []


def test_trace_lines_from_threads_stay_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(ENV, str(path))
    threads = [threading.Thread(target=lambda i=i: [trace("D", f"k{i}", "pull", n=j) for j in range(50)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 200 and {x["key"] for x in lines} == {"k0", "k1", "k2", "k3"}
    assert all(x["who"] == "D" and x["ev"] == "pull" and isinstance(x["t"], float) for x in lines)


def test_a_trace_path_that_cannot_be_written_never_fails_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """LYNX_TRACE with a typo'd folder (or a full disk): the events are dropped with one warning; trace() used to
    raise into the serving path (the proxy's pipelined flow then kept the request's prefill slot)."""
    import logging

    from lynx_connector import trace as trace_mod

    bad = str(tmp_path / "no_such_dir" / "t.jsonl")
    monkeypatch.setenv(ENV, bad)
    monkeypatch.setattr(trace_mod, "_warned", set())
    with caplog.at_level(logging.WARNING):
        trace("proxy", "k", "start")
        trace("proxy", "k", "p_answered", odd=object())  # a field JSON cannot hold: dropped too
        trace("proxy", "k", "end")
    assert sum(bad in r.getMessage() for r in caplog.records) == 1


def test_timeline_lines_up_requests_from_the_proxy_start(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    events = [(10.0, "proxy", "a", "start", {"mode": "int8"}), (10.2, "D", "a", "pull", {}),
              (12.9, "P", "a", "published", {}), (13.3, "proxy", "a", "d_first_bytes", {}),
              (20.0, "proxy", "b", "start", {"mode": "int8"}), (23.0, "P", "b", "published", {}),
              (23.5, "proxy", "b", "d_first_bytes", {}), (5.0, "D", "orphan", "pull", {})]
    path.write_text("".join(json.dumps({"t": t, "who": w, "key": k, "ev": e, **f}) + "\n"
                            for t, w, k, e, f in events))
    tl = _timeline()
    reqs = tl.load(path)
    assert set(reqs) == {"a", "b"}  # a key the proxy never started is not a pipelined request
    table = tl.summarize(reqs)
    assert table["int8"]["n"] == 2
    assert table["int8"]["P.published"] == pytest.approx(2.95)  # median of 2.9 and 3.0
    assert table["int8"]["proxy.d_first_bytes"] == pytest.approx(3.4)
    assert table["int8"]["D.pull"] == pytest.approx(0.2)
    md = tl.markdown(table)
    assert "| int8 | 2 |" in md and "P.published" in md
    assert set(tl.load(path, min_prefill_s=2.95)) == {"b"}  # a (published after 2.9 s) taken for a warm-up
    out = tmp_path / "t.json"
    assert tl.main([str(path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["medians"]["int8"]["n"] == 2
