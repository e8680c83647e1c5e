"""The GPU scripts (benchmarks/gpu/) run only on a lent GPU machine; here their logic runs on the CPU so they do
not rot between loans: gpu_codec.py's torch path and report, exact_diag.py with Triton in its interpreter,
tune.py's imports, and the shell scripts' syntax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"


def _run(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_gpu_codec_smoke_writes_json_and_table(tmp_path: Path) -> None:
    out = tmp_path / "gpu_codec.json"
    r = _run([str(GPU / "gpu_codec.py"), "--smoke-cpu", "--tokens", "64", "--layers", "1", "--repeats", "1",
              "--out", str(out)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["all_exact"] is True
    assert {row["codec"] for row in result["rows"]} == {"lynx", "int4", "int4_kivi", "int8", "fp8", "bf16"}
    assert all(row["encode_gbps"] > 0 for row in result["rows"])
    table = out.with_suffix(".md").read_text()
    assert "| lynx | torch |" in table and "All exact: True" in table


@pytest.mark.triton
def test_exact_diag_smoke_compares_every_path(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "diag.json"
    r = _run([str(GPU / "exact_diag.py"), "--smoke-cpu", "--out", str(out)], {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    for row in rows:
        for path in ("cuda_torch", "triton_fma_off", "triton_fma_on"):
            assert "error" not in row[path], row[path]
            assert {part: v["differ"] for part, v in row[path].items()} == {
                "anchor": 0, "residual": 0, "decoded_anchor": 0, "decoded_merged": 0}


def test_tune_imports_and_needs_a_gpu() -> None:
    r = _run([str(GPU / "tune.py"), "--help"])
    assert r.returncode == 0 and "--warps" in r.stdout, r.stderr[-2000:]
    if not __import__("torch").cuda.is_available():
        r = _run([str(GPU / "tune.py")])
        assert r.returncode == 2 and "needs an NVIDIA GPU" in r.stderr, r.stderr[-2000:]


def test_gpu_shell_scripts_parse() -> None:
    for script in ("kernel_check.sh", "run.sh"):
        r = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
