"""The suite's tiers (tests/conftest.py): an ``extended`` test is skipped, with the command that runs it as the
reason, unless pytest runs with ``--extended``; core tests run either way."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

def test_core():
    pass

@pytest.mark.extended
def test_extended():
    pass
'''


def _run(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "--strict-markers",
                           *args, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_extended_tests_are_skipped_with_the_command_unless_asked_for(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = _run(tmp_path)
    assert "1 passed, 1 skipped" in out, out
    assert "bash scripts/test.sh --extended" in out, out
    out = _run(tmp_path, "--extended")
    assert "2 passed" in out and "skipped" not in out, out


def test_ci_runs_the_readmes_test_command_and_that_is_the_core_tier() -> None:
    root = HERE.parent
    ci = (root / ".ci" / "run").read_text()
    assert "exec bash scripts/test.sh\n" in ci and "--extended" not in ci
    assert "bash scripts/test.sh   #" in (root / "README.md").read_text()
