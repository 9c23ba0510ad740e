#!/usr/bin/env bash
# GPU check of the DFlash kernels, losslessness through them (greedy DFlash == AR over 128 tokens on a tiny and a
# mid-size random target, fp32 / bf16; sampled FusedVerify against closed-form conditionals, fp32 / fp16 / bf16) and
# block-vs-token latencies on one NVIDIA GPU (dflash_export/validate/gpu_check.py, gpu_lossless.py, synthetic.py).
# Needs only python3 with torch (+ triton for the kernels): no install, no transformers. Where tensorrt + onnx are
# importable it builds one-op engines of both plugins with the real builder and checks their layers right after the
# kernels, and (with onnxruntime + transformers + pytest too) builds tiny-qwen3 and compares its tokens with the
# ONNX Runtime twin (tests/test_tensorrt_engine.py's GPU test); otherwise each says it skipped.
# Writes $OUT/gpu_check.json when OUT is set (or --out DIR). --cpu: tiny shapes on the CPU, for CI.
# Bounded by GPU_CHECK_TIMEOUT seconds (default 480 = 8 min); finished sections are kept when it cuts the run short
# (the JSON then names the section it cut and those not run). When python ends before writing a report (no torch,
# a crash at import, the limit hit while importing), a gpu_check.json saying so and with its exit code is written.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
out_dir="${OUT:-}"
prev=""
for arg in "$@"; do
  if [ "$prev" = "--out" ]; then out_dir="$arg"; fi
  case "$arg" in --out=*) out_dir="${arg#--out=}" ;; esac
  prev="$arg"
done
rc=0
timeout --signal=TERM --kill-after=10 "${GPU_CHECK_TIMEOUT:-480}" "$python" -m dflash_export.validate.gpu_check "$@" \
  || rc=$?
if [ -n "$out_dir" ] && [ ! -f "$out_dir/gpu_check.json" ]; then
  mkdir -p "$out_dir"
  printf '{"error": "gpu_check ended with exit code %s before writing a report (see its output)", "exit_code": %s}\n' \
    "$rc" "$rc" > "$out_dir/gpu_check.json"
fi
exit "$rc"
