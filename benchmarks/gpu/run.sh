#!/usr/bin/env bash
# Prepared GPU benchmark: codec kernels + the e2e benchmark at the paper's scale as far as one GPU allows.
# Step 1 is also in kernel_check.sh, which ran on an H200 (benchmarks/results/gpu/); step 2 is unrun: it needs
# vllm==0.32.0 (CUDA build), nixl, this package installed
# (pip install -e .), and the model in the local Hugging Face cache (the machine may be offline).
#
#   benchmarks/gpu/run.sh [OUT_DIR]           # default OUT_DIR=benchmarks/results/gpu
#   MODEL=Qwen/Qwen3-8B LENGTHS=4096,16384 benchmarks/gpu/run.sh
#
# P and D share the one GPU (each gets GPU_MEM of it); the link is paced by D exactly as on CPU, with rates
# chosen from the measured prefill so that the bf16 transfer is 0.5x, 2x and 10x the prefill time. The paper
# used Qwen3-32B at 16K tokens; two copies of a 32B bf16 model (2 x 64 GB) plus KV do not fit one 141 GB GPU,
# so the default is Qwen3-8B (same architecture family, 36 layers, 8 KV heads, head size 128).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/gpu}
MODEL=${MODEL:-Qwen/Qwen3-8B}
LENGTHS=${LENGTHS:-4096,16384}
CONC_LENGTH=${CONC_LENGTH:-8192}
GPU_MEM=${GPU_MEM:-0.42}
MAX_LEN=${MAX_LEN:-17408}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
$PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
  | tee "$OUT/versions.txt"

echo "== 1. codec kernels (GB/s vs device copy) and Triton/torch bit-exactness, Qwen3-32B KV shape, 16K tokens"
timeout 600 $PY benchmarks/gpu/gpu_codec.py --out "$OUT/gpu_codec.json" | tee "$OUT/gpu_codec.txt" || echo "codec step failed: $?"

echo "== 2. e2e: real 1P1D on one GPU, paced link, $MODEL"
# Later serve arguments override the CPU defaults of lynx_connector.lab.launch.serve_argv.
SERVE_ARGS="--dtype bfloat16 --gpu-memory-utilization $GPU_MEM --block-size 16 --max-num-batched-tokens $MAX_LEN \
--max-num-seqs 16"
timeout 3000 $PY -m lynx_connector.lab.bench.e2e --model "$MODEL" --cache-dtype bfloat16 --max-model-len "$MAX_LEN" \
  --serve-args "$SERVE_ARGS" --lengths "$LENGTHS" --conc-length "$CONC_LENGTH" --ref-tokens "$CONC_LENGTH" \
  --repeats 3 --concurrency 1,4 --out "$OUT/e2e_gpu.json" --log-dir "$OUT/logs" | tee "$OUT/e2e_gpu.txt"
echo "results in $OUT (commit the JSON/MD/PNG, not the logs)"
