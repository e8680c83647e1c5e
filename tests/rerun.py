"""Run one test file in a fresh Python process with extra environment: for cases whose process state (the
Triton interpreter flag, vLLM's module scan) must not meet the rest of the pytest session."""

from __future__ import annotations

import os
import subprocess
import sys


def rerun_in_subprocess(path: str, extra_env: dict[str, str], timeout: float) -> str:
    """Run pytest on ``path`` with ``extra_env`` added; assert it exited 0 without failures; return its stdout."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                       env=dict(os.environ, **extra_env), capture_output=True, text=True, timeout=timeout)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0 and " failed" not in r.stdout, tail
    return r.stdout
