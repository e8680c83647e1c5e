#!/usr/bin/env bash
# Lynx 1P1D on one machine: prefill server, decode server, proxy; one request; everything torn down on exit,
# Ctrl-C, SIGTERM or any failure (trap). KEEP=1 keeps the deployment up until Ctrl-C.
#
#   examples/1p1d/run_1p1d.sh                       # the prepared SmolLM2 model (lynx prepare-model), mode full
#   MODEL=Qwen/Qwen2.5-7B-Instruct MODE=lynx:speculative EXTRA_SERVE_ARGS="--dtype bfloat16" HF_HUB_OFFLINE=0 \
#     KEEP=1 examples/1p1d/run_1p1d.sh               # on a GPU
#
# The servers get exactly the arguments and environment of the Python launcher (lynx_connector.lab.launch,
# which the demo, the benches and the server tests use): its CPU defaults (fp32, eager, block size 32,
# HF_HUB_OFFLINE=1, half of the cores each, LYNX_SERVERS_PER_DEVICE=2: `lynx serve` then sizes each server's
# memory for two on one machine or one GPU, lynx_connector/memory.py), printed by
# `python -m lynx_connector.lab.launch MODEL --shell prefill|decode --port ...`; EXTRA_SERVE_ARGS override
# them, variables already set in the environment win over its environment. A P and a D started another way
# must use the same --block-size (and dtype): docs/OPERATIONS.md "Starting P and D".
#
# Separate hosts: run the `lynx serve` commands this script prints (in LOG_DIR/*.log) on each host with P_HOST =
# the prefill host's address on the network D reaches it by (its side channel binds and is advertised there),
# and point the proxy at both (docs/OPERATIONS.md). Settings (environment):
#   MODEL, MODE (lynx | lynx:<mode>), P_PORT, D_PORT, PROXY_PORT, SIDE_PORT (P's side channel, 0 = random),
#   P_HOST (side channel bind/advertise address, default 127.0.0.1), P_CPUS / D_CPUS (taskset CPU lists,
#   e.g. 0-7 / 8-15, also the servers' VLLM_CPU_OMP_THREADS_BIND), MAX_MODEL_LEN, EXTRA_SERVE_ARGS (one string),
#   LOG_DIR, STARTUP_TIMEOUT (s), KEEP, LYNX (the lynx command), PYTHON.
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
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
EXTRA_SERVE_ARGS=${EXTRA_SERVE_ARGS:-}
if [[ -z "${MODEL:-}" ]]; then
  MODEL=$("$PYTHON" -c 'from lynx_connector.lab.models import model_dir; print(model_dir())')
fi
mkdir -p "$LOG_DIR"

PIDS=()
STOPPING=0
HURRY=0
on_signal() {  # the first Ctrl-C/SIGTERM/SIGHUP stops everything; one during the stop kills the servers now
  if [[ $STOPPING == 1 ]]; then HURRY=1; return; fi
  STOPPING=1   # at once: a second signal before cleanup runs must not start a second, full-length stop
  exit "$1"
}
cleanup() {
  local rc=$?
  STOPPING=1
  trap - EXIT
  echo "[1p1d] stopping the servers (a second Ctrl-C kills them at once)"
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done   # whole process groups
  for _ in $(seq 1 30); do
    [[ $HURRY == 1 ]] && break
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
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP   # a closed terminal stops the servers too

start() {  # start NAME CPUS CMD...: own session/process group, log to LOG_DIR/NAME.log
  local name=$1 cpus=$2; shift 2
  local pin=()
  [[ -n "$cpus" ]] && pin=(taskset -c "$cpus")
  { printf '[1p1d]'; printf ' %q' "${pin[@]}" "$@"; echo; } >"$LOG_DIR/$name.log"   # the exact command
  setsid "${pin[@]}" "$@" >>"$LOG_DIR/$name.log" 2>&1 < /dev/null &
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

kv_config() {  # kv_config ROLE PORT: the preset, the role (P only prefills: kv_producer, so a speculative preset
  # installs no speculative scheduler there) and where P's side channel binds (and what it advertises to D)
  printf '{"kv_connector": "%s", "kv_role": "%s", "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"side_channel_host": "%s", "side_channel_port": %s}}' \
    "$MODE" "$1" "$P_HOST" "$2"
}

serve() {  # serve NAME PORT CPUS KV_CONFIG: the launcher's environment and `lynx serve` arguments for it
  local name=$1 port=$2 cpus=$3 assignments
  assignments=$("$PYTHON" -m lynx_connector.lab.launch "$MODEL" --shell "$name" --port "$port" \
    --host 127.0.0.1 ${cpus:+--cpus "$cpus"} --max-model-len "$MAX_MODEL_LEN" --serve-args "$EXTRA_SERVE_ARGS" \
    --kv-transfer-config "$4")
  local ENV ARGS
  eval "$assignments"
  local env_set=() kv key
  for kv in "${ENV[@]}"; do  # what the caller's environment already sets wins
    key=${kv%%=*}
    [[ -n "${!key+x}" ]] || env_set+=("$kv")
  done
  start "$name" "$cpus" env "${env_set[@]}" "$LYNX" "${ARGS[@]}"
}

# P and D must share the side channel's deployment key (docs/OPERATIONS.md "Security"): the caller's, else a
# random one for this pair (inherited by both servers)
if [[ -z "${LYNX_SIDE_CHANNEL_KEY:-}${LYNX_SIDE_CHANNEL_KEY_FILE:-}" ]]; then
  LYNX_SIDE_CHANNEL_KEY=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')
  export LYNX_SIDE_CHANNEL_KEY
fi
serve prefill "$P_PORT" "${P_CPUS:-}" "$(kv_config kv_producer "$SIDE_PORT")"
P_PID=${PIDS[-1]}
serve decode "$D_PORT" "${D_CPUS:-}" "$(kv_config kv_both 0)"
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
