#!/usr/bin/env bash
# Set up everything (project venv, dependencies, the real model in the user's cache) and run the 1P1D demo:
# real vLLM prefill and decode servers with SmolLM2 on this CPU, the proxy, long-context needle questions,
# and what Lynx gained per transfer mode. Extra arguments go to `lynx demo` (see `lynx demo --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LYNX_VENV:-$ROOT/.venv}"  # as scripts/setup_env.sh
bash "$ROOT/scripts/setup_env.sh"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/lynx" demo "$@"
