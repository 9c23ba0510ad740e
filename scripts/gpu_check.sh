#!/usr/bin/env bash
# GPU check of the DFlash kernels and block-vs-token latencies on one NVIDIA GPU (dflash_export/kernels/gpu_check.py).
# Needs only python3 with torch (+ triton for the kernels): no install, no transformers, no TensorRT.
# Writes $OUT/gpu_check.json when OUT is set (or --out DIR). --cpu: tiny shapes on the CPU, for CI.
# Bounded by GPU_CHECK_TIMEOUT seconds (default 480 = 8 min); finished sections are kept when it cuts the run short.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
exec timeout --signal=TERM --kill-after=10 "${GPU_CHECK_TIMEOUT:-480}" "$python" -m dflash_export.kernels.gpu_check "$@"
