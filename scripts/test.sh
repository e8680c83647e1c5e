#!/usr/bin/env bash
# Set up everything (project venv, dependencies, the real model in the user's cache) and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`; `--extended` adds the extended tier
# (tests/conftest.py; README "Tests").
# The suite includes the package as users install it: the wheel built, installed non-editable into a fresh venv
# that borrows .venv's dependencies, every module imported and one real P/D request served from that install
# (tests/test_packaging.py, tests/test_wheel_install.py; scripts/wheel_smoke.sh runs only these).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LYNX_VENV:-$ROOT/.venv}"  # as scripts/setup_env.sh
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
set +e
"$VENV/bin/python" -m pytest -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: failing on purpose (an empty run proves nothing)" >&2
  exit 1
fi
exit "$rc"
