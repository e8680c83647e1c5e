"""``lynx bench codec``: the JSON shape of a real ``--quick`` run, and the targets table on synthetic rows.

Speeds are not asserted (shared CI machines); the benchmark shows them against its targets.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_connector.lab.bench import codec as bench_codec
from lynx_connector.lab.bench import common

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"codec", "bits_per_value", "vnmse_k", "vnmse_v", "encode_gbps", "decode_gbps"}


def _row(name: str, bits: float, vk: float, vv: float, enc: float = 5.0, dec: float = 5.0) -> dict:
    return {"codec": name, "bits_per_value": bits, "vnmse_k": vk, "vnmse_v": vv, "encode_gbps": enc,
            "decode_gbps": dec}  # fmt: skip


def test_targets_pass_and_fail() -> None:
    rows = [
        _row("lynx_anchor", 4.5, 1e-3, 5e-3),
        _row("lynx_full", 8.5, 1e-5, 6e-5, dec=1.0),
        _row("int4", 4.5, 1e-2, 1e-2),
    ]
    checks = {
        (c["row"], c["metric"]): c["pass"] for c in bench_codec.evaluate_targets(rows, memcpy_gbps=10.0)
    }
    assert checks[("lynx_anchor", "bits_per_value")]
    assert checks[("lynx_anchor", "vnmse_k")]  # 1e-3 <= 0.3 * 1e-2
    assert checks[("lynx_anchor", "vnmse_v")]  # 5e-3 <= 1.0 * 1e-2 (int4's own V format may not be worse)
    assert checks[("lynx_full", "vnmse_k")] and not checks[("lynx_full", "vnmse_v")]
    assert checks[("lynx_full", "encode_gbps")] and not checks[("lynx_full", "decode_gbps")]  # 1.0 < 2.5
    worse_v = [_row("lynx_anchor", 4.5, 1e-3, 1.1e-2), _row("int4", 4.5, 1e-2, 1e-2)]
    assert not {c["metric"]: c["pass"] for c in bench_codec.evaluate_targets(worse_v, 10.0)}["vnmse_v"]


def test_report_table_shows_targets_and_verdicts() -> None:
    rows = [
        _row("lynx_anchor", 4.5, 1e-3, 5e-3),
        _row("lynx_full", 8.5, 1e-5, 6e-5),
        _row("int4", 4.5, 1e-2, 1e-2),
    ]
    result = {"rows": rows, "memcpy_gbps": 10.0, "model": "m", "tokens": 512, "layers": 30, "kv_heads": 3,
              "head_size": 64, "cache_dtype": "float32", "block_size": 32, "gather_gbps": 1.0,
              "checks": bench_codec.evaluate_targets(rows, 10.0)}  # fmt: skip
    text = bench_codec.format_report(result)
    lines = {line.split()[0]: line for line in text.splitlines() if line.split()}
    assert lines["lynx_anchor"].rstrip().endswith("PASS") and "(<= 4.6)" in lines["lynx_anchor"]
    assert lines["lynx_full"].rstrip().endswith("FAIL") and "(<= 5e-05)" in lines["lynx_full"]
    assert lines["int4"].rstrip().endswith("-")
    assert "missed: lynx_full vnmse_v" in text


def test_checksum_row_next_to_memcpy() -> None:
    rows = [_row("lynx_anchor", 4.5, 1e-3, 5e-3)]
    for cks, ok in ((25.0, True), (15.0, False)):
        checks = bench_codec.evaluate_targets(rows, 10.0, checksum_gbps=cks)
        c = next(c for c in checks if c["row"] == "checksum")
        assert c["metric"] == "checksum_gbps" and c["pass"] is ok and c["target"] == ">= 20"
        result = {"rows": rows, "memcpy_gbps": 10.0, "checksum_gbps": cks, "checksum": "xxh3_64", "model": "m",
                  "tokens": 512, "layers": 30, "kv_heads": 3, "head_size": 64, "cache_dtype": "float32",
                  "block_size": 32, "gather_gbps": 1.0, "checks": checks}  # fmt: skip
        text = bench_codec.format_report(result)
        line = next(line for line in text.splitlines() if line.startswith("checksum (xxh3_64"))
        assert f"{cks:.2f} (>= 20)" in line and f"{cks / 10:.2f}" in line
        assert line.rstrip().endswith("PASS" if ok else "FAIL")
        assert ("missed: checksum checksum_gbps" in text) is not ok
    assert not any(c["row"] == "checksum" for c in bench_codec.evaluate_targets(rows, 10.0))


def test_measure_checksum_runs_over_the_memcpy_bytes() -> None:
    paged = bench_codec.PagedKV(layers=[None, None], block_ids=None, layout=None, num_tokens=1,
                                kv_bytes_per_layer=1 << 16)  # fmt: skip
    assert bench_codec.measure_checksum(paged, repeats=2) > 0


def test_format_table_aligns_columns() -> None:
    out = common.format_table(["a", "bb"], [["x", 1], ["yyy", 22]]).splitlines()
    assert out == ["a    bb", "---  --", "x     1", "yyy  22"]


def test_environment_info_is_json_serializable() -> None:
    env = common.environment_info()
    json.dumps(env)
    assert env["versions"]["torch"] and "commit" in env["git"] and env["hardware"]["usable_cores"] >= 1


@pytest.mark.slow
def test_quick_run_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lynx_connector.lab.bench.codec", "--quick", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bench"] == "codec"
    assert result["model"] == "SmolLM2-135M-Instruct"
    assert result["tokens"] == bench_codec.QUICK_TOKENS
    assert result["memcpy_gbps"] > 0
    assert [r["codec"] for r in result["rows"]] == list(bench_codec.CODEC_ROWS)
    for r in result["rows"]:
        assert ROW_KEYS <= set(r)
        assert isinstance(r["codec"], str)
        for key in ROW_KEYS - {"codec"}:
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (r["codec"], key)
    by = {r["codec"]: r for r in result["rows"]}
    assert by["bf16"]["vnmse_k"] == 0.0 and by["bf16"]["vnmse_v"] == 0.0  # passthrough is lossless
    assert by["lynx_full"]["vnmse_k"] < by["lynx_anchor"]["vnmse_k"]
    assert by["lynx_full"]["bits_per_value"] > by["lynx_anchor"]["bits_per_value"]
    assert {"versions", "git", "hardware", "checks"} <= set(result)
    for row in bench_codec.CODEC_ROWS:  # the table printed to stdout names every row
        assert any(line.startswith(row) for line in proc.stdout.splitlines()), row
