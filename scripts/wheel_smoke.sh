#!/usr/bin/env bash
# The package as users install it, alone: build the wheel (pip wheel --no-deps), check what it holds, install it
# non-editable into a fresh virtual environment that borrows .venv's dependencies, import every module from it,
# check that its [cpu] extra resolves no CUDA build, and serve one real P/D request with its `lynx` console script
# (tests/test_packaging.py, tests/test_wheel_install.py; both also run in `bash scripts/test.sh`, i.e. in CI).
# Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec bash "$ROOT/scripts/test.sh" "$ROOT/tests/test_packaging.py" "$ROOT/tests/test_wheel_install.py" "$@"
