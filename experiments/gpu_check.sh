#!/usr/bin/env bash
# The device checks, as one prepared script for a machine with an NVIDIA GPU (an H100 /
# H200: bfloat16 dense peak 989 TFLOP/s on the datasheet; pass PEAK_BF16 for another chip).
# Run from the repository root; writes into ${OUT:-gpu-results}/.
#   1. the accelerator parity tests (float32 at highest matmul precision) in .venv-gpu;
#   2. the benchmark on the GPU sizes, float32 and bfloat16, MFU against the datasheet peak
#      (the target: >= 40 % for the d1024 T2048 block train step);
#   3. the long-sequence attention alone: the blocked (flash, custom-VJP) path
#      against jax.nn.dot_product_attention on cuDNN, T 2048-8192, bfloat16, with MFU;
#   4. a short slice of the `full` lab preset: every variant of the preset at 6
#      and 48 layers, two learning rates, one seed, 200 steps, with its report
#      (`python -m experiments.stability --preset full --estimate` sizes the whole preset);
#   5. the same slice of `full-text`: the grid on characters of CPython's
#      documentation at d_model 128.
# SKIP="1 2" skips steps by number.
set -euo pipefail
OUT=${OUT:-gpu-results}
PEAK_BF16=${PEAK_BF16:-989}
PEAK_F32=${PEAK_F32:-67}
SKIP=${SKIP:-}
mkdir -p "$OUT"
run() { [[ " $SKIP " == *" $1 "* ]] && { echo "skipping step $1"; return 0; }; shift; "$@"; }
run 1 bash -c "make test-gpu 2>&1 | tee '$OUT/test-gpu.log'"
run 2 bash -c ".venv-gpu/bin/python -m experiments.bench --sizes gpu --dtypes float32,bfloat16 --no-torch-compile \
    --peak-tflops 'bfloat16=$PEAK_BF16' --peak-tflops 'float32=$PEAK_F32' --out '$OUT/bench' 2>&1 | tee '$OUT/bench.log'"
run 3 bash -c ".venv-gpu/bin/python -m experiments.bench.long_attention --vs-library cudnn --dtype bfloat16 \
    --seqs 2048,4096,8192 --reps 10 --peak-tflops $PEAK_BF16 2>&1 | tee '$OUT/attention-vs-cudnn.log'"
run 4 bash -c ".venv-gpu/bin/python -m experiments.stability --preset full --depths 6,48 --lrs 1e-3,1e-2 \
    --warmups 0 --seeds 1 --steps 200 --out '$OUT/full-slice' 2>&1 | tail -n 30 | tee '$OUT/full-slice.log'"
run 5 bash -c ".venv-gpu/bin/python -m experiments.stability --preset full-text --depths 6,48 --lrs 1e-3,1e-2 \
    --warmups 0 --seeds 1 --steps 200 --out '$OUT/full-text-slice' 2>&1 | tail -n 30 | tee '$OUT/full-text-slice.log'"
