#!/usr/bin/env bash
# Ran at c25d7e4.
# Device call 1 of 2 (H200): carries .whl and .dev/a (the embedded GGUF's first half, kept in
# /tmp for call 2). The tiny random model only: CUDA tests, then the kernels' timings.
# From the repository root: bash benchmarks/results/h200/2026-11-27-b/run1.sh
cp .dev/a/part00 /tmp/
. benchmarks/results/h200/2026-11-27-b/setup.sh
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/spec_phases/test_kv_cache_dtype.py \
    tests/spec_phases/test_lossy_kv_batched.py tests/spec_phases/test_cuda_graphs.py \
    -k "cuda or graph" 2>&1 | tee $OUT/tests-cuda.log | tail -15
timeout 120 python3 benchmarks/kernels.py --contexts 1024 8192 65536 --queries 1 9 \
    --json $OUT/kernels.json 2>&1 | tee $OUT/kernels.log | tail -30
