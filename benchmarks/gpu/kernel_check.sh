#!/usr/bin/env bash
# The GPU kernel check, as one script for the lent GPU machine (torch and Triton, no vLLM, no NIXL, no network).
# In the order of their value, so that a run cut short loses the least:
#   1. tests/kernels/test_triton_twins.py compiled on the GPU (LYNX_TEST_DEVICE=cuda): every layout, dtype, head
#      size (80 and 96 included: padded columns) and grouping of the Triton kernels against their torch twins, bit
#      for bit, and non-finite KV refused;
#   2. benchmarks/gpu/exact_diag.py: the CPU twin (the reference) against the torch twin on CUDA and the Triton
#      kernels compiled with FMA contraction off (the codec's setting) and on (Triton's default), byte counts;
#   3. benchmarks/gpu/gpu_codec.py at the paper's shape (Qwen3-32B KV, 16K tokens, 64 layers): every codec's
#      encode/decode GB/s next to a device copy, and Triton == torch twin on those tensors;
#   4. benchmarks/gpu/tune.py: the Lynx kernels' GB/s per launch shape (warps x rows per program).
# Step timeouts add up to 460 s: run it with the device tool's timeout_s of about 500, as (commit typed in: the
# device's copy of the tree has no .git; OUT must stay the tool's $OUT, or nothing comes back)
#
#   LYNX_SOURCE_COMMIT=<commit> OUT="$OUT" bash benchmarks/gpu/kernel_check.sh
#
# then copy what came back into benchmarks/results/gpu/. Writes into $OUT (default benchmarks/results/gpu):
# env.txt, triton_twins_cuda.txt, exact_diag.json, gpu_codec.{json,md}, tune.json, steps.txt (the device tool
# brings back at most 8 files). The package is imported from the checkout; kernels/ is linked in as
# lynx_connector.kernels, as the wheel lays it out (the wheel itself is checked on the CPU:
# tests/test_wheel_install.py). Exit status: 0 only if every step passed; 3 when the image lacks a module the
# kernels' import path needs (nothing else is run then).
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

$PY -c "import torch, triton, pytest, xxhash" 2>&1 | tee -a "$OUT/env.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "missing a module the kernel check imports (above)"; exit 3; }

echo "== 1. Triton kernels vs torch twins, compiled on the GPU"
LYNX_TEST_DEVICE=cuda timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts= -rA \
  tests/kernels/test_triton_twins.py 2>&1 | tee "$OUT/triton_twins_cuda.txt"
twins=${PIPESTATUS[0]}

echo "== 2. where GPU results differ from the CPU reference" | tee "$OUT/steps.txt"
timeout 90 $PY benchmarks/gpu/exact_diag.py --out "$OUT/exact_diag.json" 2>&1 | tee -a "$OUT/steps.txt"
diag=${PIPESTATUS[0]}

echo "== 3. codec kernels at the paper's shape" | tee -a "$OUT/steps.txt"
timeout 150 $PY benchmarks/gpu/gpu_codec.py --out "$OUT/gpu_codec.json" 2>&1 | tee -a "$OUT/steps.txt"
codec=${PIPESTATUS[0]}

echo "== 4. launch-shape sweep of the Lynx kernels" | tee -a "$OUT/steps.txt"
timeout 100 $PY benchmarks/gpu/tune.py --warps 2,4,8 --rows 32,64,128 --layers 4 --out "$OUT/tune.json" 2>&1 \
  | tee -a "$OUT/steps.txt"
tune=${PIPESTATUS[0]}

echo "twins exit $twins, diag exit $diag, codec exit $codec, tune exit $tune" | tee -a "$OUT/steps.txt"
[ "$twins" = 0 ] && [ "$diag" = 0 ] && [ "$codec" = 0 ] && [ "$tune" = 0 ]
