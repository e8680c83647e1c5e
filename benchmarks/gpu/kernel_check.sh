#!/usr/bin/env bash
# The GPU kernel check, as one script for the lent GPU machine (torch and Triton, no vLLM, no NIXL, no network):
#   1. tests/kernels/test_triton_twins.py compiled on the GPU (LYNX_TEST_DEVICE=cuda): every layout, dtype and
#      grouping of the Triton kernels against their torch twins, bit for bit, and non-finite KV refused;
#   2. benchmarks/gpu/gpu_codec.py at the paper's shape (Qwen3-32B KV, 16K tokens, 64 layers): every codec's
#      encode/decode GB/s next to a device copy, and Triton == torch twin on those tensors;
#   3. benchmarks/gpu/tune.py: the Lynx kernels' GB/s per launch shape (warps x rows per program);
#   4. benchmarks/gpu/exact_diag.py: the CPU twin (the reference) against the torch twin on CUDA and the Triton
#      kernels compiled with FMA contraction off (the codec's setting) and on (Triton's default), byte counts.
#
#   LYNX_SOURCE_COMMIT=$(git rev-parse HEAD) OUT=benchmarks/results/gpu bash benchmarks/gpu/kernel_check.sh
#
# Writes into $OUT (default benchmarks/results/gpu): env.txt, triton_twins_cuda.txt, gpu_codec.{json,md,txt},
# tune.json, exact_diag.json (the device tool brings back at most 8 files).
# The package is imported from the checkout; kernels/ is linked in as lynx_connector.kernels, as the wheel
# lays it out (the wheel itself is checked on the CPU: tests/test_wheel_install.py). Exit status: 0 only if
# every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -e lynx_connector/kernels ] || ln -s ../kernels lynx_connector/kernels
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'device', torch.cuda.get_device_name(0))"
  echo "source commit: ${LYNX_SOURCE_COMMIT:-unknown}"
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. Triton kernels vs torch twins, compiled on the GPU"
LYNX_TEST_DEVICE=cuda timeout 150 $PY -m pytest -q -p no:cacheprovider -o addopts= -rA \
  tests/kernels/test_triton_twins.py 2>&1 | tee "$OUT/triton_twins_cuda.txt"
twins=${PIPESTATUS[0]}

echo "== 2. codec kernels at the paper's shape"
timeout 200 $PY benchmarks/gpu/gpu_codec.py --out "$OUT/gpu_codec.json" 2>&1 | tee "$OUT/gpu_codec.txt"
codec=${PIPESTATUS[0]}

echo "== 3. launch-shape sweep of the Lynx kernels"
timeout 150 $PY benchmarks/gpu/tune.py --warps 2,4,8 --rows 32,64,128 --layers 4 --out "$OUT/tune.json" 2>&1
tune=$?

echo "== 4. where GPU results differ from the CPU reference"
timeout 120 $PY benchmarks/gpu/exact_diag.py --out "$OUT/exact_diag.json" 2>&1
diag=$?

echo "twins exit $twins, codec exit $codec, tune exit $tune, diag exit $diag"
[ "$twins" = 0 ] && [ "$codec" = 0 ] && [ "$tune" = 0 ] && [ "$diag" = 0 ]
