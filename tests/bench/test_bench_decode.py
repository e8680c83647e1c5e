"""``lynx bench decode``: throughput arithmetic, the interleaving, the per-round ratios, the servers' arguments and
the Markdown, on synthetic timings (the real run is benchmarks/results/decode.json, made by the command in
benchmarks/README.md). Speeds are never asserted."""

from __future__ import annotations

import argparse

import pytest

from lynx_connector.lab.bench import decode


def test_batch_throughput_sums_the_requests_decode_rates() -> None:
    # two requests of 11 tokens each over 1 s after their first token: 10 + 10 tokens/s
    times = [[0.5 + 0.1 * i for i in range(11)], [0.6 + 0.1 * i for i in range(11)]]
    assert decode.batch_throughput(times) == pytest.approx(20.0)
    assert decode.batch_throughput([[0.5]]) is None  # one token: no decode rate
    # a verification step releasing tokens together: gaps of the distinct arrivals
    assert decode.step_times([[1.0, 1.0, 1.5, 2.5]]) == [pytest.approx(0.5), pytest.approx(1.0)]


def test_rounds_rotate_the_order() -> None:
    names = ["vllm", "lynx", "lynx:speculative"]
    assert [decode.rotated(names, r)[0] for r in range(4)] == ["vllm", "lynx", "lynx:speculative", "vllm"]


def _m(rnd: int, config: str, batch: int, tps: float | None) -> dict:
    return {"round": rnd, "config": config, "batch": batch, "tokens_per_s": tps, "step_s": [0.02], "errors": 0}


def test_ratio_is_the_median_of_per_round_ratios() -> None:
    ms = [_m(0, "vllm", 1, 100.0), _m(0, "lynx:speculative", 1, 95.0),
          _m(1, "vllm", 1, 50.0), _m(1, "lynx:speculative", 1, 49.0),  # the machine got busier: both slower
          _m(2, "vllm", 1, 100.0), _m(2, "lynx:speculative", 1, 99.0),
          _m(0, "vllm", 8, 400.0), _m(0, "lynx:speculative", 8, None)]
    rows = {(r["config"], r["batch"]): r for r in decode.summarize(ms, ["vllm", "lynx:speculative"], [1, 8])}
    spec = rows[("lynx:speculative", 1)]
    assert spec["per_round_ratios"] == pytest.approx([0.95, 0.98, 0.99])
    assert spec["ratio_vs_vllm"] == pytest.approx(0.98) and spec["tokens_per_s_median"] == 95.0
    assert rows[("vllm", 1)]["ratio_vs_vllm"] is None
    assert rows[("lynx:speculative", 8)]["ratio_vs_vllm"] is None  # no measurement: no ratio
    verdicts = {(c["config"], c["batch"]): c["pass"] for c in decode.checks(list(rows.values()))}
    assert verdicts == {("lynx:speculative", 1): True, ("lynx:speculative", 8): None}
    result = {"model": "m", "config": {"cpus": "1", "server_cpus": "1", "prompt_tokens": 128, "max_tokens": 128, "rounds": 3},
              "rows": list(rows.values()), "checks": decode.checks(list(rows.values())), "hardware": {},
              "versions": {}, "git": {}}
    md = decode.markdown(result)
    assert "| lynx:speculative | 1 | 3 | 95.0 |" in md and "0.980" in md and "PASS" in md


def test_servers_differ_only_in_their_kv_transfer_config() -> None:
    plain = decode.server_argv("vllm", "/m", 1234, 512)
    spec = decode.server_argv("lynx:speculative", "/m", 1234, 512)
    assert "--kv-transfer-config" not in plain
    i = spec.index("--kv-transfer-config")
    assert spec[i + 1] == "lynx:speculative" and spec[:i] + spec[i + 2:] == plain
    assert plain[plain.index("--kv-cache-memory-bytes") + 1] == str(decode.KV_CACHE_BYTES)
    gpu = decode.server_argv("vllm", "/m", 1234, 512, ["--dtype", "bfloat16"])
    assert gpu[-2:] == ["--dtype", "bfloat16"]  # after the CPU defaults: it wins


def test_cli_needs_the_baseline_and_valid_batches() -> None:
    parser = argparse.ArgumentParser()
    decode.add_parser(parser.add_subparsers(dest="bench"))
    with pytest.raises(SystemExit, match="includes vllm"):
        decode.run(parser.parse_args(["decode", "--configs", "lynx:speculative"]))
    with pytest.raises(SystemExit, match="batch sizes"):
        decode.run(parser.parse_args(["decode", "--batches", "1,16"]))


def test_a_server_that_exits_mid_run_stops_the_bench_naming_it() -> None:
    """A decode server that died left every later cell n/a in a table that looked complete: now its name, exit code
    and log tail end the run."""
    from types import SimpleNamespace

    alive = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None), log_path="a.log", log_tail=lambda n: "")
    dead = SimpleNamespace(proc=SimpleNamespace(poll=lambda: -9, returncode=-9), log_path="d.log",
                           log_tail=lambda n: "Killed")
    decode._raise_if_exited({"vllm": alive}, "in round 0")
    with pytest.raises(RuntimeError, match=r"server lynx:speculative exited with code -9 in round 0(.|\n)*Killed"):
        decode._raise_if_exited({"vllm": alive, "lynx:speculative": dead}, "in round 0")
