#!/usr/bin/env bash
# Lynx 1P1D on one machine: prefill server, decode server, proxy; one request; everything torn down on exit,
# Ctrl-C, SIGTERM or any failure (trap). KEEP=1 keeps the deployment up until Ctrl-C.
#
#   examples/1p1d/run_1p1d.sh                       # the prepared SmolLM2 model (lynx prepare-model), mode full
#   MODEL=Qwen/Qwen2.5-7B-Instruct MODE=lynx:speculative KEEP=1 examples/1p1d/run_1p1d.sh
#
# Separate hosts: run the `lynx serve` lines below on each host with P_HOST = the prefill host's address on
# the network D reaches it by (its side channel binds and is advertised there), and point the proxy at both
# (docs/OPERATIONS.md). Settings (environment):
#   MODEL, MODE (lynx | lynx:<mode>), P_PORT, D_PORT, PROXY_PORT, SIDE_PORT (P's side channel, 0 = random),
#   P_HOST (side channel bind/advertise address, default 127.0.0.1), P_CPUS / D_CPUS (taskset CPU lists,
#   e.g. 0-7 / 8-15), LOG_DIR, STARTUP_TIMEOUT (s), KEEP, LYNX (the lynx command), PYTHON.
set -euo pipefail

LYNX=${LYNX:-lynx}
PYTHON=${PYTHON:-python3}
MODE=${MODE:-lynx}
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
SIDE_PORT=${SIDE_PORT:-5600}
P_HOST=${P_HOST:-127.0.0.1}
LOG_DIR=${LOG_DIR:-./lynx-1p1d-logs}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
KEEP=${KEEP:-0}
if [[ -z "${MODEL:-}" ]]; then
  MODEL=$("$PYTHON" -c 'from lynx_connector.lab.models import model_dir; print(model_dir())')
fi
mkdir -p "$LOG_DIR"
export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false

PIDS=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done   # whole process groups
  for _ in $(seq 1 30); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.5
  done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  echo "[1p1d] stopped (logs in $LOG_DIR)"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME CPUS CMD...: own session/process group, log to LOG_DIR/NAME.log
  local name=$1 cpus=$2; shift 2
  local pin=()
  [[ -n "$cpus" ]] && pin=(taskset -c "$cpus")
  setsid "${pin[@]}" "$@" >"$LOG_DIR/$name.log" 2>&1 < /dev/null &
  PIDS+=("$!")
  echo "[1p1d] $name pid $! (log $LOG_DIR/$name.log)"
}

wait_healthy() {  # wait_healthy NAME URL PID
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until "$PYTHON" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$2/health" \
        2>/dev/null; do
    if ! kill -0 "$3" 2>/dev/null; then echo "[1p1d] $1 exited; last log lines:"; tail -n 30 "$LOG_DIR/$1.log"; exit 1; fi
    if (( SECONDS > deadline )); then echo "[1p1d] $1 not healthy after ${STARTUP_TIMEOUT}s"; exit 1; fi
    sleep 1
  done
  echo "[1p1d] $1 healthy at $2"
}

kv_config() {  # the preset plus where P's side channel binds (and what it advertises to D)
  printf '{"kv_connector": "%s", "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"side_channel_host": "%s", "side_channel_port": %s}}' \
    "$MODE" "$P_HOST" "$1"
}

SERVE_ARGS=(--max-model-len 4096 --seed 0)
start prefill "${P_CPUS:-}" "$LYNX" serve "$MODEL" --host 127.0.0.1 --port "$P_PORT" "${SERVE_ARGS[@]}" \
  --kv-transfer-config "$(kv_config "$SIDE_PORT")"
P_PID=${PIDS[-1]}
start decode "${D_CPUS:-}" "$LYNX" serve "$MODEL" --host 127.0.0.1 --port "$D_PORT" "${SERVE_ARGS[@]}" \
  --kv-transfer-config "$(kv_config 0)"
D_PID=${PIDS[-1]}
wait_healthy prefill "http://127.0.0.1:$P_PORT" "$P_PID"
wait_healthy decode "http://127.0.0.1:$D_PORT" "$D_PID"
start proxy "" "$LYNX" proxy --host 127.0.0.1 --port "$PROXY_PORT" \
  --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT"
wait_healthy proxy "http://127.0.0.1:$PROXY_PORT" "${PIDS[-1]}"

"$PYTHON" - "$PROXY_PORT" "$MODEL" <<'PY'
import json, sys, time, urllib.request
port, model = sys.argv[1], sys.argv[2]
body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
t0 = time.time()
with urllib.request.urlopen(req, timeout=300) as resp:
    out = json.load(resp)
print(f"[1p1d] answer in {time.time() - t0:.2f}s: {out['choices'][0]['text']!r}")
PY

if [[ "$KEEP" == 1 ]]; then
  echo "[1p1d] proxy at http://127.0.0.1:$PROXY_PORT (Ctrl-C stops everything)"
  wait -n "${PIDS[@]}" || true
  echo "[1p1d] a server exited"
  exit 1
fi
