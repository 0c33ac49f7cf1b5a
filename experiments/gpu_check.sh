#!/usr/bin/env bash
# The device checks of issue 15, as one prepared script for a machine with an NVIDIA GPU
# (an H100 / H200: bfloat16 dense peak 989 TFLOP/s on the datasheet; pass PEAK_BF16 for
# another chip). Run from the repository root; writes into ${OUT:-gpu-results}/.
#   1. the accelerator parity tests (float32 at highest matmul precision) in .venv-gpu;
#   2. the benchmark on the GPU sizes, float32 and bfloat16, MFU against the datasheet peak
#      (the target: >= 40 % for the d1024 T2048 block train step).
set -euo pipefail
OUT=${OUT:-gpu-results}
PEAK_BF16=${PEAK_BF16:-989}
PEAK_F32=${PEAK_F32:-67}
mkdir -p "$OUT"
make test-gpu 2>&1 | tee "$OUT/test-gpu.log"
.venv-gpu/bin/python -m experiments.bench --sizes gpu --dtypes float32,bfloat16 --no-torch-compile \
    --peak-tflops "bfloat16=$PEAK_BF16" --peak-tflops "float32=$PEAK_F32" --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
