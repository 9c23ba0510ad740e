#!/usr/bin/env bash
# GPU check of the DFlash kernels, losslessness through them (greedy DFlash == AR over 128 tokens on a tiny and a
# mid-size random target, fp32 / bf16; sampled FusedVerify against closed-form conditionals, fp32 / fp16 / bf16) and
# block-vs-token latencies on one NVIDIA GPU (dflash_export/validate/gpu_check.py, gpu_lossless.py, synthetic.py).
# Needs only python3 with torch (+ triton for the kernels): no install, no transformers. Where tensorrt + onnx are
# importable it builds one-op engines of both plugins with the real builder and checks their layers right after the
# kernels, and (with onnxruntime + transformers + pytest too) builds tiny-qwen3 and compares its tokens with the
# ONNX Runtime twin (tests/test_tensorrt_engine.py's GPU test); otherwise each says it skipped.
# Writes $OUT/gpu_check.json when OUT is set (or --out DIR). --cpu: tiny shapes on the CPU, for CI.
# Bounded by GPU_CHECK_TIMEOUT seconds (default 480 = 8 min); finished sections are kept when it cuts the run short.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
exec timeout --signal=TERM --kill-after=10 "${GPU_CHECK_TIMEOUT:-480}" "$python" -m dflash_export.validate.gpu_check "$@"
